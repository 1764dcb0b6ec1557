"""``brownout``: the operator's command line, a client of the admin API over HTTP.

Verbs (``brownout VERB --help`` for each)::

    brownout status                                   level, why, signals against thresholds, features, admission
    brownout history [-n 20]                          recent level changes
    brownout override --level 2 --ttl 5m --note "incident 42"
    brownout override --feature debug_capture --on --ttl 30s
    brownout release [--feature F | --all]            drop the level pin (default), one feature override, or all
    brownout features                                 per-feature cost and degradation (GET /admin/brownout/features)
    brownout simulate TRACE [simulate's options]      replay a signal trace (policies/simulate.py)
    brownout watch [--interval 2] [--count N]         status, refreshed in place

Where it connects: ``--url`` (or ``BROWNOUT_URL``; default ``http://127.0.0.1:8000``, what
``make serve`` listens on). The admin token: ``--token``, else ``BROWNOUT_ADMIN_TOKEN``, else the
file ``--token-file`` (or ``BROWNOUT_ADMIN_TOKEN_FILE``; default ``~/.config/brownout/admin_token``,
the file ``make serve`` creates), sent as ``X-Brownout-Admin-Token``.

``--json`` on every verb prints the admin API's JSON unchanged (``watch``: one JSON document a
line per refresh), so scripts read what the server said, not a rendering of it. Tables use
``rich`` where it is installed, plain aligned columns otherwise.

Exit codes, so a script can tell what went wrong without parsing text:

====  =====================================================================================
0     done
2     usage or bad input (a bad duration, an unknown feature, a TTL over the server's maximum:
      the server's 4xx names the field)
3     the app is not reachable at the URL (not running, wrong port)
4     the admin token was refused, or the admin API is closed
5     the server failed (5xx, e.g. the policy actor is unavailable) or did not answer in time
====  =====================================================================================
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import httpx

EXIT_OK, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH, EXIT_SERVER = 0, 2, 3, 4, 5
DEFAULT_URL = "http://127.0.0.1:8000"
# AuthSettings().admin_token_file (serve_app/security.py), where `make serve` writes the token; a
# unit test keeps them equal (importing the server's settings here would load FastAPI for nothing).
DEFAULT_TOKEN_FILE = "~/.config/brownout/admin_token"
TOKEN_HEADER = "X-Brownout-Admin-Token"


class CliError(Exception):
    """A failure with its exit code and a message that says what to do."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# -- pure helpers ----------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``90``, ``30s``, ``5m``, ``1h``, ``1m30s``, ``1.5h``, ``500ms``.

    A bare number is seconds. Zero, negative or malformed durations raise ValueError naming
    the value (an override that never expires is refused by the server, so there is no "forever").
    """
    raw = text.strip().lower()
    try:
        seconds = float(raw)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION.finditer(raw):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _UNIT_S[match.group(2)]
            pos = match.end()
        if pos != len(raw) or not raw:
            raise ValueError(f"duration {text!r}: use a number of seconds or e.g. 30s, 5m, 1h, 1m30s") from None
    if not (0 < seconds < math.inf):
        raise ValueError(f"duration {text!r}: must be more than 0 seconds")
    return seconds


def format_duration(seconds: float) -> str:
    """The short form of ``seconds``: ``45s``, ``5m``, ``1h30m``, ``2.5s``."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    total = int(round(seconds))
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v) or "0s"


def find_token(explicit: str | None, env: Mapping[str, str], token_file: str | None) -> tuple[str | None, str]:
    """The admin token and where it came from: ``--token``, ``BROWNOUT_ADMIN_TOKEN``, then the file."""
    if explicit:
        return explicit.strip(), "--token"
    if env.get("BROWNOUT_ADMIN_TOKEN"):
        return env["BROWNOUT_ADMIN_TOKEN"].strip(), "BROWNOUT_ADMIN_TOKEN"
    path = Path(token_file or env.get("BROWNOUT_ADMIN_TOKEN_FILE") or DEFAULT_TOKEN_FILE).expanduser()
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None, str(path)
    return (token or None), str(path)


def check_url(url: str) -> str:
    if not re.fullmatch(r"https?://[^/\s]+(/[^\s]*)?", url):
        raise CliError(EXIT_USAGE, f"--url {url!r}: expected http://HOST:PORT (e.g. {DEFAULT_URL})")
    return url.rstrip("/")


def _error_message(response: httpx.Response) -> str:
    """The server's own words: OpenAI's ``{"error": {"message": ...}}`` or FastAPI's ``detail``."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("detail"):
            return str(body["detail"])
    return json.dumps(body)[:300]


# -- the admin API client --------------------------------------------------------------------------


class AdminClient:
    """The admin API over HTTP, each failure mapped to a `CliError` with its exit code."""

    def __init__(self, url: str, token: str | None, token_source: str, timeout_s: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = check_url(url)
        self.token_source = token_source
        self.has_token = token is not None
        headers = {TOKEN_HEADER: token} if token else {}
        self.timeout_s = timeout_s
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
                body: Mapping[str, Any] | None = None, allow_404: bool = False) -> Any:
        try:
            response = self.http.request(method, path, params=params, json=body)
        except httpx.TimeoutException as err:
            if isinstance(err, httpx.ConnectTimeout):
                raise self._unreachable(err) from None
            raise CliError(EXIT_SERVER, f"the app at {self.url} did not answer {method} {path} within "
                           f"{self.timeout_s:g} s (busy, or the policy actor is stuck): retry, or pass "
                           "--timeout") from None
        except httpx.TransportError as err:
            raise self._unreachable(err) from None
        status = response.status_code
        if status == 404 and allow_404:
            return None
        if status in (401, 403):
            raise CliError(EXIT_AUTH, self._auth_message(status, _error_message(response)))
        if 400 <= status < 500:
            raise CliError(EXIT_USAGE, f"{method} {path} refused ({status}): {_error_message(response)}")
        if status >= 500:
            raise CliError(EXIT_SERVER, f"{method} {path} failed on the server ({status}): {_error_message(response)}")
        try:
            return response.json()
        except ValueError:
            raise CliError(EXIT_SERVER, f"{self.url}{path} answered {status} without JSON: is this the Brownout "
                           "app? (check --url)") from None

    def _unreachable(self, err: Exception) -> CliError:
        return CliError(EXIT_UNREACHABLE, f"app not running at {self.url} ({type(err).__name__}): start it with "
                        "`make serve`, or point --url / BROWNOUT_URL at it")

    def _auth_message(self, status: int, server: str) -> str:
        if "disabled" in server or "no admin token configured" in server:
            return (f"the admin API at {self.url} is closed ({server}): configure auth.admin_token_file in "
                    "serve_config.yaml (`make serve` creates one)")
        if not self.has_token:
            return (f"no admin token: none in --token, BROWNOUT_ADMIN_TOKEN or {self.token_source}; pass --token "
                    "or set BROWNOUT_ADMIN_TOKEN (`make serve` writes it to ~/.config/brownout/admin_token)")
        return (f"admin token refused ({status}: {server}; token from {self.token_source}): pass --token or set "
                "BROWNOUT_ADMIN_TOKEN to the token in the server's auth.admin_token_file")

    # the admin API, one method a route
    def state(self) -> dict[str, Any]:
        return self.request("GET", "/admin/brownout")

    def history(self, n: int) -> list[dict[str, Any]]:
        return self.request("GET", "/admin/brownout/history", params={"n": n})

    def override(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/admin/brownout/override", body=body)

    def release(self, *, level: bool = False, feature: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"level": "true"} if level else {}
        if feature is not None:
            params["feature"] = feature
        return self.request("DELETE", "/admin/brownout/override", params=params)


# -- output ----------------------------------------------------------------------------------------


def _rich() -> Any:
    try:
        import rich.box
        import rich.console
        import rich.table
    except ImportError:
        return None
    return rich


class Out:
    """Lines and tables on ``stream``: ``rich`` tables where available (and not ``plain``),
    else plain columns aligned by width."""

    def __init__(self, stream: TextIO, plain: bool = False) -> None:
        self.stream = stream
        rich = None if plain else _rich()
        self.console = None
        if rich is not None:
            # a terminal's own width; piped output is not cut at rich's default of 80 columns
            width = None if stream.isatty() else max(100, int(os.environ.get("COLUMNS", "0") or 0))
            self.console = rich.console.Console(file=stream, width=width, highlight=False, soft_wrap=False)
            self._rich = rich

    def line(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, markup=False)
        else:
            self.stream.write(text + "\n")

    def table(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        cells = [[_cell(v) for v in row] for row in rows]
        if self.console is not None:
            table = self._rich.table.Table(title=title, title_justify="left", box=self._rich.box.SIMPLE_HEAD)
            for i, h in enumerate(headers):
                table.add_column(h, overflow="fold", no_wrap=i == 0)  # names stay whole
            for row in cells:
                table.add_row(*row)
            self.console.print(table)
            return
        self.line(title)
        widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
        self.line("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
        self.line("  ".join("-" * w for w in widths))
        for row in cells:
            self.line("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        self.line()

    def clear(self) -> None:
        """Home the cursor and clear the screen (a terminal only), so a refresh replaces the view."""
        if self.stream.isatty():
            self.stream.write("\x1b[H\x1b[2J")
            self.stream.flush()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _clock(at: float | None, now: float) -> str:
    if at is None:
        return "-"
    return f"{time.strftime('%H:%M:%S', time.localtime(at))} ({format_duration(max(0.0, now - at))} ago)"


def describe_reason(transition: Mapping[str, Any] | None) -> str:
    """One line: why the last level change happened."""
    if not transition:
        return "no level change since the policy actor started"
    reason = transition.get("reason") or {}
    kind = reason.get("kind", "?")
    text = f"{kind}"
    if reason.get("signal") is not None:
        text += f": {reason['signal']} {_cell(reason.get('value'))} >= {_cell(reason.get('threshold'))}"
    if reason.get("detail"):
        text += f" ({reason['detail']})"
    return f"{text}; {transition.get('from')} -> {transition.get('to')}"


def optional_features(state: Mapping[str, Any]) -> list[str]:
    """The optional features, in run order: the server's accounting if it sent one, else the
    registry (`policies.features`)."""
    if isinstance(state.get("feature_time"), dict) and state["feature_time"]:
        return list(state["feature_time"])
    from policies.features import optional_names

    return list(optional_names())


def describe_model(health: Any, now: float) -> str | None:
    """One line: the model's health as the ingress replica that answered sees it
    (`serve_app.health.ModelHealth.state`); None where the state carries none."""
    if not isinstance(health, Mapping):
        return None
    outages = health.get("outages_s") or []
    predicted = health.get("predicted_outage_s")
    # with outages on record, the prediction is their median (`ModelHealth.predicted_outage_s`)
    record = "" if not outages or predicted is None else (
        f"{len(outages)} outage{'s' if len(outages) != 1 else ''} on record, median {format_duration(predicted)}")
    if health.get("up", True):
        return "model: up" + (f" ({record})" if record else "")
    since = health.get("since")
    down_s = max(0.0, now - since) if isinstance(since, (int, float)) else None
    text = f"model: DOWN{'' if down_s is None else f' for {format_duration(down_s)}'} ({health.get('reason')})"
    if health.get("inferred"):
        return text + "; taken for down on silence alone, no answer has said so yet"
    if isinstance(predicted, (int, float)) and down_s is not None:
        basis = record or "the replica's start time"
        rest = predicted - down_s
        text += (f"; predicted back in {format_duration(rest)}" if rest > 0
                 else f"; {format_duration(-rest)} past the predicted {format_duration(predicted)}") + f" ({basis})"
    return text


def render_status(state: Mapping[str, Any], out: Out, now: float | None = None) -> None:
    now = time.time() if now is None else now
    pin = state.get("pin")
    recent = state.get("recent_transitions") or []
    head = f"level {state.get('level')}"
    if pin:
        until = "until cleared" if pin.get("expires_at") is None else f"for {format_duration(max(0.0, pin['expires_at'] - now))} more"
        head += f"  PINNED by an operator {until}" + (f" ({pin['note']})" if pin.get("note") else "")
        head += f"; the rules say {state.get('policy_level')}"
    out.line(head)
    out.line(f"reason: {describe_reason(recent[-1] if recent else None)}"
             + (f", at {_clock(recent[-1].get('at'), now)}" if recent else ""))
    blocked = state.get("recovery_blocked_by") or []
    if blocked:
        out.line(f"recovery blocked by stale signals: {', '.join(blocked)}")
    if state.get("last_config_error"):
        out.line(f"last policy rejected: {state['last_config_error']}")
    model = describe_model((state.get("ingress") or {}).get("model_health"), now)
    if model:
        out.line(model)
    out.line()

    signals = state.get("signals") or {}
    values = signals.get("values") or {}
    stale = set(signals.get("stale") or [])
    thresholds = state.get("thresholds") or {}
    rows = []
    for name in sorted(set(values) | set(thresholds) | stale):
        levels = thresholds.get(name, {})
        cols = []
        for lv in ("1", "2", "3"):
            b = levels.get(lv)
            cols.append(None if b is None else f"{_cell(b['trigger'])} / {_cell(b['recover'])}")
        value = values.get(name)
        hot = [lv for lv in ("1", "2", "3") if lv in levels and value is not None and value >= levels[lv]["trigger"]]
        rows.append([name, value, "STALE" if name in stale else "", *cols, f"L{hot[-1]}" if hot else ""])
    out.table(f"signals ({signals.get('sources', 0)} fresh sources) against trigger / recover values",
              ["signal", "value", "stale", "level1", "level2", "level3", "over"], rows)

    enabled = set(state.get("enabled") or [])
    forced = state.get("feature_overrides") or {}
    pipeline = (state.get("ingress") or {}).get("pipeline") or {}
    circuits = pipeline.get("circuits") or {}
    times = state.get("feature_time") or {}
    rows = []
    for f in optional_features(state):
        on = f in enabled
        ft = times.get(f) or {}
        why = "" if on else (ft.get("cause") or ("override" if f in forced else "level"))
        force = forced.get(f)
        rows.append([
            f, "on" if on else f"off ({why})",
            None if force is None else ("on" if force.get("enabled") else "off")
            + ("" if force.get("expires_at") is None else f" {format_duration(max(0.0, force['expires_at'] - now))}"),
            (pipeline.get("bypassed") or {}).get(f, 0), (pipeline.get("failures") or {}).get(f, 0),
            (pipeline.get("deferred") or {}).get(f, 0), (circuits.get(f) or {}).get("state"),
            ft.get("disabled_s_window"),
        ])
    out.table("features (counters: this ingress replica since its start)",
              ["feature", "state", "forced", "bypassed", "failed", "deferred", "circuit", "off s (5 min)"], rows)

    adm = (state.get("ingress") or {}).get("admission")
    if adm:
        classes = sorted({*(adm.get("class_cap") or {}), *(adm.get("admitted") or {})},
                         key=lambda c: ("critical", "standard", "sheddable").index(c)
                         if c in ("critical", "standard", "sheddable") else 9)
        refused = adm.get("refused") or {}
        rows = [[c, (adm.get("class_cap") or {}).get(c), (adm.get("reserved") or {}).get(c),
                 (adm.get("admitted") or {}).get(c, 0),
                 sum(n for k, n in refused.items() if k.split(":")[0] == c),
                 ", ".join(f"{k.split(':', 1)[1]} {n}" for k, n in refused.items() if k.split(":")[0] == c)]
                for c in classes]
        queued = f"{adm['queued']} critical waiting for a slot; " if adm.get("queued") else ""
        out.table(f"admission ({'on' if adm.get('enabled') else 'off'}; {adm.get('in_flight')} in flight; {queued}"
                  f"{_cell(adm.get('per_request_s'))} s per request, base {_cell(adm.get('base_latency_s'))} s)",
                  ["class", "cap", "reserved", "admitted", "refused", "by reason"], rows)


def render_history(history: Sequence[Mapping[str, Any]], out: Out, now: float | None = None) -> None:
    now = time.time() if now is None else now
    rows = []
    for t in history:
        r = t.get("reason") or {}
        rows.append([_clock(t.get("at"), now), f"{t.get('from')} -> {t.get('to')}", r.get("kind"), r.get("signal"),
                     r.get("value"), r.get("threshold"), r.get("detail")])
    out.table(f"level changes (last {len(history)}, oldest first)",
              ["at", "change", "reason", "signal", "value", "threshold", "detail"], rows)


def feature_rows(doc: Any) -> list[dict[str, Any]]:
    """The rows of ``GET /admin/brownout/features``, whatever its envelope: a list of objects,
    ``{"features": [...]}`` or ``{"features": {name: {...}}}`` / ``{name: {...}}``."""
    body = doc.get("features", doc) if isinstance(doc, dict) else doc
    if isinstance(body, dict):
        body = [{"feature": name, **(v if isinstance(v, dict) else {"value": v})} for name, v in body.items()]
    return [r for r in body if isinstance(r, dict)] if isinstance(body, list) else []


def _minutes(seconds: Any) -> str:
    return f"{seconds / 60:g} min" if isinstance(seconds, (int, float)) and seconds > 0 else "window"


def render_features(doc: Any, out: Out) -> None:
    """The cost table (``GET /admin/brownout/features``) in the server's order: first the most
    expensive feature, then the most often off. Rows in another shape are shown as they came."""
    rows = feature_rows(doc)
    if rows and all(isinstance(r.get("window"), dict) for r in rows):
        span = _minutes(doc.get("window_s") if isinstance(doc, dict) else None)
        table = []
        for r in rows:
            w = r["window"]
            state = f"off ({r.get('cause') or 'level'})" if r.get("off") else "on"
            bypassed = r.get("bypassed") or {}
            table.append([r.get("rank"), r.get("feature"), state, w.get("cost_ms"), w.get("calls"),
                          w.get("latency_ms_per_call"), w.get("cpu_ms_per_call"), w.get("failures"),
                          w.get("disabled_s"), w.get("turned_off"), r.get("cost_ms"), r.get("calls"),
                          r.get("disabled_s"), r.get("turned_off"),
                          ", ".join(f"{c} {n}" for c, n in sorted(bypassed.items())) or "-"])
        out.table(f"features, most expensive and most often off first (last {span}; then since start)",
                  ["#", "feature", "now", "cost ms", "calls", "ms/call", "cpu ms/call", "failed", "off s",
                   "turned off", "cost ms (all)", "calls (all)", "off s (all)", "turned off (all)", "bypassed by cause"],
                  table)
        out.line("cost: (ms per call + CPU ms per call) x calls, on this ingress replica; off time: the "
                 "policy actor's")
        return
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    out.table("features, as the server ranks them (first: most expensive and most often off)", columns,
              [[row.get(c) for c in columns] for row in rows])


def render_enrichments(doc: Mapping[str, Any], out: Out) -> None:
    rows = []
    for host, stats in doc.items():
        if "error" in stats:
            rows.append([host, "-", stats["error"]])
            continue
        for feature, calls in sorted((stats.get("counters") or {}).items()):
            rows.append([host, feature, calls])
    out.table("calls per feature, by the replica that runs it (GET /admin/brownout/enrichments)",
              ["host", "feature", "calls"], rows)


# -- verbs -----------------------------------------------------------------------------------------


def _print_json(doc: Any, stream: TextIO) -> None:
    stream.write(json.dumps(doc, sort_keys=True) + "\n")


def cmd_status(args: argparse.Namespace, client: AdminClient, out: Out) -> int:
    state = client.state()
    if args.json:
        _print_json(state, out.stream)
    else:
        render_status(state, out)
    return EXIT_OK


def cmd_history(args: argparse.Namespace, client: AdminClient, out: Out) -> int:
    history = client.history(args.n)
    if args.json:
        _print_json(history, out.stream)
    else:
        render_history(history, out)
    return EXIT_OK


def override_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"ttl_s": args.ttl}
    if args.level is not None:
        body["level"] = args.level
    else:
        body["feature"] = args.feature
        body["enabled"] = args.enabled
    if args.note:
        body["note"] = args.note
    return body


def cmd_override(args: argparse.Namespace, client: AdminClient, out: Out) -> int:
    result = client.override(override_body(args))
    if args.json:
        _print_json(result, out.stream)
        return EXIT_OK
    state = result.get("state") or {}
    until = time.strftime("%H:%M:%S", time.localtime(time.time() + args.ttl))
    if args.level is not None:
        out.line(f"level pinned at {args.level} for {format_duration(args.ttl)} (until {until}); level now "
                 f"{state.get('level')}. `brownout release` drops the pin.")
    else:
        out.line(f"{args.feature} forced {'on' if args.enabled else 'off'} for {format_duration(args.ttl)} "
                 f"(until {until}). `brownout release --feature {args.feature}` drops it.")
    return EXIT_OK


def cmd_release(args: argparse.Namespace, client: AdminClient, out: Out) -> int:
    results = []
    if args.all:
        state = client.state()
        results.append(client.release(level=True))
        for feature in sorted(state.get("feature_overrides") or {}):
            results.append(client.release(feature=feature))
        what = "the level pin and every feature override"
    elif args.feature:
        results.append(client.release(feature=args.feature))
        what = f"the override of {args.feature}"
    else:
        results.append(client.release(level=True))
        what = "the level pin"
    if args.json:
        _print_json(results[-1] if len(results) == 1 else results, out.stream)
        return EXIT_OK
    state = results[-1].get("state") or {}
    out.line(f"released {what}; level now {state.get('level')} (what the rules say).")
    return EXIT_OK


def cmd_features(args: argparse.Namespace, client: AdminClient, out: Out) -> int:
    doc = client.request("GET", "/admin/brownout/features", allow_404=True)
    if doc is not None:
        if args.json:
            _print_json(doc, out.stream)
        else:
            render_features(doc, out)
        return EXIT_OK
    doc = client.request("GET", "/admin/brownout/enrichments")
    print("brownout: this app has no GET /admin/brownout/features (no cost accounting): showing "
          "GET /admin/brownout/enrichments", file=sys.stderr)
    if args.json:
        _print_json(doc, out.stream)
    else:
        render_enrichments(doc, out)
    return EXIT_OK


def cmd_watch(args: argparse.Namespace, client: AdminClient, out: Out,
              sleep: Callable[[float], None] = time.sleep) -> int:
    """Status every ``interval`` until ``count`` frames (0: until Ctrl-C). A failed fetch shows
    the error in its frame and watching goes on (an app restarting comes back in view); the exit
    code is the last frame's."""
    code, frame = EXIT_OK, 0
    try:
        while True:
            frame += 1
            try:
                state = client.state()
                code = EXIT_OK
            except CliError as err:
                state, code = None, err.code
                message = err.message
            if args.json:
                _print_json(state if state is not None else {"error": message, "exit_code": code}, out.stream)
            else:
                out.clear()
                out.line(f"brownout watch {client.url}  every {args.interval:g}s  "
                         f"{time.strftime('%H:%M:%S')}  (Ctrl-C to stop)")
                if state is not None:
                    render_status(state, out)
                else:
                    out.line(f"error: {message}")
            out.stream.flush()
            if args.count and frame >= args.count:
                return code
            sleep(args.interval)
    except KeyboardInterrupt:
        return code


def cmd_simulate(args: argparse.Namespace) -> int:
    from policies import simulate

    argv = [args.trace, *args.rest]
    if args.json and "--json" not in argv:
        argv.append("--json")
    return simulate.main(argv)


# -- argument parsing ------------------------------------------------------------------------------


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    # Options accepted before or after the verb: `brownout --json status` = `brownout status --json`.
    # SUPPRESS keeps a subparser's unset default from overwriting what the main parser read.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print the admin API's JSON unchanged")
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help=f"the app (env BROWNOUT_URL; default {DEFAULT_URL})")
    common.add_argument("--token", default=argparse.SUPPRESS, help="admin token (env BROWNOUT_ADMIN_TOKEN)")
    common.add_argument("--token-file", default=argparse.SUPPRESS,
                        help=f"file holding the admin token (env BROWNOUT_ADMIN_TOKEN_FILE; default {DEFAULT_TOKEN_FILE})")
    common.add_argument("--timeout", type=_duration, default=argparse.SUPPRESS,
                        help="per request (default 10s)")
    common.add_argument("--plain", action="store_true", default=argparse.SUPPRESS,
                        help="plain columns, even where rich is installed")

    ap = argparse.ArgumentParser(prog="brownout", parents=[common],
                                 description="Operate Brownout through its admin API.",
                                 epilog="exit codes: 0 ok, 2 usage/bad input, 3 app not reachable, "
                                        "4 admin token refused, 5 server error or time-out")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")
    sub.add_parser("status", parents=[common], help="level, why, signals, features, admission")
    h = sub.add_parser("history", parents=[common], help="recent level changes")
    h.add_argument("-n", type=_positive_int, default=20, help="how many (default 20)")

    o = sub.add_parser("override", parents=[common], help="pin a level, or force one feature on/off, for a TTL",
                       description="Pin the level (--level) or force a feature (--feature with --on/--off) "
                                   "for --ttl; the server refuses a TTL over auth.max_override_ttl_s.")
    what = o.add_mutually_exclusive_group(required=True)
    what.add_argument("--level", type=int, choices=[0, 1, 2, 3])
    what.add_argument("--feature")
    onoff = o.add_mutually_exclusive_group()
    onoff.add_argument("--on", dest="enabled", action="store_const", const=True, default=None)
    onoff.add_argument("--off", dest="enabled", action="store_const", const=False)
    o.add_argument("--ttl", type=_duration, required=True, help="how long: 30s, 5m, 1h")
    o.add_argument("--note", default="", help="why (kept with the pin, shown by status)")

    r = sub.add_parser("release", parents=[common], help="drop the level pin (default), a feature override, or all")
    rwhat = r.add_mutually_exclusive_group()
    rwhat.add_argument("--feature", help="drop this feature's override instead of the level pin")
    rwhat.add_argument("--all", action="store_true", help="the level pin and every feature override")

    sub.add_parser("features", parents=[common], help="per-feature cost and degradation, ranked")

    s = sub.add_parser("simulate", parents=[common], help="replay a signal trace through a policy",
                       description="Runs `python -m policies.simulate TRACE ...`: every option after TRACE "
                                   "is simulate's (--config, --baseline, --plot, --max-num-seqs).")
    s.add_argument("trace")
    s.add_argument("rest", nargs=argparse.REMAINDER)

    w = sub.add_parser("watch", parents=[common], help="status, refreshed in place")
    w.add_argument("--interval", type=_duration, default=2.0, help="between refreshes (default 2s)")
    w.add_argument("--count", type=int, default=0, help="stop after this many refreshes (default: never)")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name, default in (("json", False), ("plain", False), ("url", None), ("token", None),
                          ("token_file", None), ("timeout", 10.0)):
        if not hasattr(args, name):
            setattr(args, name, default)
    if args.verb == "override":
        if args.feature is not None and args.enabled is None:
            ap.error("override --feature needs --on or --off")
        if args.level is not None and args.enabled is not None:
            ap.error("--on/--off go with --feature, not --level")
    if args.verb == "watch" and args.count < 0:
        ap.error("--count must be >= 0 (0: until Ctrl-C)")
    return args


VERBS: dict[str, Callable[..., int]] = {"status": cmd_status, "history": cmd_history, "override": cmd_override,
                                        "release": cmd_release, "features": cmd_features, "watch": cmd_watch}


def main(argv: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None,
         stdout: TextIO | None = None, transport: httpx.BaseTransport | None = None) -> int:
    """Run one verb; returns the exit code (``transport``: tests pass `httpx.MockTransport`)."""
    env = os.environ if env is None else env
    stdout = sys.stdout if stdout is None else stdout
    try:
        args = parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage error
        return EXIT_USAGE if exit_.code else EXIT_OK
    if args.verb == "simulate":
        return cmd_simulate(args)
    out = Out(stdout, plain=args.plain)
    try:
        token, source = find_token(args.token, env, args.token_file)
        client = AdminClient(args.url or env.get("BROWNOUT_URL") or DEFAULT_URL, token, source,
                             args.timeout, transport)
    except CliError as err:
        print(f"brownout: {err.message}", file=sys.stderr)
        return err.code
    try:
        return VERBS[args.verb](args, client, out)
    except CliError as err:
        print(f"brownout: {err.message}", file=sys.stderr)
        return err.code
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
