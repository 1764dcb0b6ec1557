"""The `brownout` command line (serve_app/cli.py) against a fake admin API (httpx.MockTransport).

Each verb's request (method, path, query, body, token header), its rendering, ``--json``, and the
exit codes a script relies on (0 ok, 2 usage/bad input, 3 unreachable, 4 auth, 5 server).
The state the fake serves is a real `PolicyCore`'s, so the renderer reads the server's shapes.
"""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from policies.config import parse_policy
from policies.service import PolicyCore
from serve_app import cli
from tests.fakes.clock import FakeClock

TOKEN = "s3cret-admin"
POLICY = {
    "level1": {"trigger": {"queue_length": 4}, "recover_dwell_s": 3, "cooldown_s": 1, "disable": ["debug_capture"]},
    "level2": {"trigger": {"queue_length": 8}, "recover_dwell_s": 3, "cooldown_s": 1, "disable": ["ab_test"]},
    "level3": {"trigger": {"queue_length": 12}, "recover_dwell_s": 3, "cooldown_s": 1,
               "disable": ["all_non_critical"]},
}


def policy_state(pin: int | None = None) -> dict[str, Any]:
    """`/admin/brownout` as the server builds it: the actor's state plus an ingress section."""
    clock = FakeClock()
    core = PolicyCore(parse_policy(POLICY), clock=clock)
    core.report("model:a", {"queue_length": 9.0})
    core.tick()
    clock.advance(1)
    core.tick()
    if pin is not None:
        core.set_override(level=pin, ttl_s=30, note="drill")
    state = json.loads(json.dumps(core.get_state()))
    state["ingress"] = {
        "pipeline": {"bypassed": {"ab_test": 7}, "failures": {"personalization": 1}, "deferred": {},
                     "circuits": {"personalization": {"state": "closed"}}},
        "admission": {"enabled": True, "in_flight": 2, "queued": 1, "per_request_s": 0.5, "base_latency_s": 1.2,
                      "class_cap": {"critical": 6, "standard": 5, "sheddable": 4},
                      "reserved": {"critical": 0, "standard": 1, "sheddable": 1},
                      "admitted": {"standard": 40, "critical": 3},
                      "refused": {"sheddable:share": 5, "standard:slo": 2}},
    }
    return state


class FakeAdmin:
    """The admin API's routes, recording every request; ``fail`` forces one response."""

    def __init__(self, features: Any = None) -> None:
        self.requests: list[httpx.Request] = []
        self.state = policy_state()
        self.features = features
        self.fail: Callable[[httpx.Request], httpx.Response] | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.fail is not None:
            return self.fail(request)
        if request.headers.get(cli.TOKEN_HEADER) != TOKEN:
            return openai_error(401 if cli.TOKEN_HEADER.lower() not in request.headers else 403, "wrong admin token")
        route = (request.method, request.url.path)
        if route == ("GET", "/admin/brownout"):
            return httpx.Response(200, json=self.state)
        if route == ("GET", "/admin/brownout/history"):
            return httpx.Response(200, json=self.state["recent_transitions"][-int(request.url.params["n"]):])
        if route == ("POST", "/admin/brownout/override"):
            body = json.loads(request.content)
            if body.get("feature") == "nope":
                return openai_error(400, "unknown feature 'nope'; valid: ab_test, ...", "feature")
            return httpx.Response(200, json={"ok": True, "state": policy_state(pin=body.get("level"))})
        if route == ("DELETE", "/admin/brownout/override"):
            return httpx.Response(200, json={"ok": True, "state": policy_state()})
        if route == ("GET", "/admin/brownout/features") and self.features is not None:
            return httpx.Response(200, json=self.features)
        if route == ("GET", "/admin/brownout/enrichments"):
            return httpx.Response(200, json={"SemanticCache": {"counters": {"semantic_cache_lookup": 12}},
                                             "Ingress": {"counters": {"prompt_rewrite": 30}}})
        return openai_error(404, f"unknown route {request.url.path}")


def openai_error(status: int, message: str, param: str | None = None) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error",
                                                  "param": param, "code": None}})


def run(argv: list[str], admin: FakeAdmin | None = None, env: dict[str, str] | None = None,
        transport: httpx.BaseTransport | None = None) -> tuple[int, str]:
    out = io.StringIO()
    env = {"BROWNOUT_ADMIN_TOKEN": TOKEN} if env is None else env
    code = cli.main([*argv, "--plain"] if "--plain" not in argv and argv[:1] != ["simulate"] else argv,
                    env=env, stdout=out, transport=transport or httpx.MockTransport(admin or FakeAdmin()))
    return code, out.getvalue()


# -- pure helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30), ("5m", 300), ("1h", 3600), ("1m30s", 90), ("90", 90), ("1.5h", 5400), ("500ms", 0.5),
    (" 5M ", 300), ("2h1m1s", 7261), ("0.25", 0.25),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert cli.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "0", "0s", "-5", "-5m", "5x", "m5", "5 m", "s", "inf", "nan", "1e400", "5m-3s"])
def test_parse_duration_refuses_naming_the_value(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        cli.parse_duration(text)


@pytest.mark.parametrize(("seconds", "text"), [(45, "45s"), (2.5, "2.5s"), (300, "5m"), (5400, "1h30m"),
                                               (3601, "1h1s")])
def test_format_duration(seconds: float, text: str) -> None:
    assert cli.format_duration(seconds) == text


def test_token_comes_from_option_then_env_then_file(tmp_path: Path) -> None:
    path = tmp_path / "admin_token"
    path.write_text("from-file\n")
    assert cli.find_token("opt", {"BROWNOUT_ADMIN_TOKEN": "env"}, str(path)) == ("opt", "--token")
    assert cli.find_token(None, {"BROWNOUT_ADMIN_TOKEN": "env"}, str(path)) == ("env", "BROWNOUT_ADMIN_TOKEN")
    assert cli.find_token(None, {}, str(path)) == ("from-file", str(path))
    assert cli.find_token(None, {"BROWNOUT_ADMIN_TOKEN_FILE": str(path)}, None) == ("from-file", str(path))
    assert cli.find_token(None, {}, str(tmp_path / "missing")) == (None, str(tmp_path / "missing"))


def test_default_token_file_is_the_servers() -> None:
    from serve_app.security import AuthSettings

    assert cli.DEFAULT_TOKEN_FILE == AuthSettings().admin_token_file


def test_token_file_on_the_command_line_is_sent(tmp_path: Path) -> None:
    path = tmp_path / "tok"
    path.write_text(TOKEN)
    admin = FakeAdmin()
    code, _ = run(["status", "--token-file", str(path)], admin, env={})
    assert code == 0 and admin.requests[0].headers[cli.TOKEN_HEADER] == TOKEN


# -- every verb's request --------------------------------------------------------------------------


def test_status_prints_level_reason_signals_features_and_admission() -> None:
    admin = FakeAdmin()
    code, out = run(["status"], admin)
    assert code == 0
    (req,) = admin.requests
    assert (req.method, req.url.path) == ("GET", "/admin/brownout")
    assert out.splitlines()[0] == "level 2"
    assert "reason: trigger: queue_length 9 >= 8 (level2 trigger held); 0 -> 2" in out
    signal_line = next(line for line in out.splitlines() if line.startswith("queue_length"))
    assert signal_line.split()[:2] == ["queue_length", "9"] and "8 / 6.667" in signal_line and "L2" in signal_line
    ab = next(line for line in out.splitlines() if line.startswith("ab_test"))
    assert "off (level)" in ab and " 7 " in f"{ab} "
    assert next(line for line in out.splitlines() if line.startswith("personalization")).split()[1] == "on"
    sheddable = next(line for line in out.splitlines() if line.startswith("sheddable"))
    assert sheddable.split()[:5] == ["sheddable", "4", "1", "0", "5"]
    assert "2 in flight; 1 critical waiting for a slot;" in out


def test_status_shows_a_pin_and_its_note() -> None:
    admin = FakeAdmin()
    admin.state = policy_state(pin=3)
    admin.state["pin"]["expires_at"] = time.time() + 30  # the fake clock's pin, on the real clock
    code, out = run(["status"], admin)
    assert code == 0
    # the render reads the real clock too: on a loaded CI machine it may come a second later
    head = re.match(r"level 3  PINNED by an operator for (\d+(?:\.\d+)?)s more \(drill\); the rules say 2\n", out)
    assert head is not None, out
    assert 20 < float(head.group(1)) <= 30
    assert "reason: override (level pinned at 3); 2 -> 3" in out


def test_status_says_whether_the_model_is_down_and_when_it_is_predicted_back() -> None:
    from serve_app.health import ModelHealth

    now = [1000.0]
    h = ModelHealth(clock=lambda: now[0])
    assert cli.describe_model(None, now[0]) is None and cli.describe_model(h.state(), now[0]) == "model: up"
    h.observe_start(40.0)
    h.observe(False, "the model's engine process has died")
    now[0] += 15.0
    assert cli.describe_model(h.state(), now[0]) == (
        "model: DOWN for 15s (the model's engine process has died); predicted back in 25s (the replica's start time)")
    for more in (85.0, 120.0):  # outages of 100 s (15 s of them above) and 120 s
        now[0] += more
        h.observe(True)
        h.observe(False, "gone")
    now[0] += 30.0
    assert cli.describe_model(h.state(), now[0]) == (
        "model: DOWN for 30s (gone); predicted back in 1m20s (2 outages on record, median 1m50s)")
    now[0] += 90.0
    assert cli.describe_model(h.state(), now[0]).endswith("; 10s past the predicted 1m50s (2 outages on record, median 1m50s)")
    h.observe(True)
    assert cli.describe_model(h.state(), now[0]) == "model: up (3 outages on record, median 2m)"
    now[0] += 10.0
    assert h.observe_expired(2.0)  # down on silence alone: nothing predicted
    assert cli.describe_model(h.state(), now[0]).endswith("(no model replica took a request within its deadline "
                                                          "(2.0 s), and none has answered for 10.0 s); taken for down "
                                                          "on silence alone, no answer has said so yet")
    state = policy_state()
    state["ingress"]["model_health"] = h.state()
    out = io.StringIO()
    cli.render_status(state, cli.Out(out, plain=True), now=now[0])
    assert "\nmodel: DOWN for 0s (no model replica took a request" in out.getvalue()


def test_status_renders_with_rich_too() -> None:
    pytest.importorskip("rich")
    out = io.StringIO()
    code = cli.main(["status"], env={"BROWNOUT_ADMIN_TOKEN": TOKEN}, stdout=out,
                    transport=httpx.MockTransport(FakeAdmin()))
    assert code == 0
    assert "level 2" in out.getvalue() and "queue_length" in out.getvalue() and "ab_test" in out.getvalue()


def test_history_asks_for_n() -> None:
    admin = FakeAdmin()
    code, out = run(["history", "-n", "5"], admin)
    assert code == 0
    assert admin.requests[0].url.path == "/admin/brownout/history"
    assert admin.requests[0].url.params["n"] == "5"
    assert "0 -> 2" in out and "trigger" in out


@pytest.mark.parametrize(("argv", "body"), [
    (["override", "--level", "2", "--ttl", "5m", "--note", "incident 42"],
     {"level": 2, "ttl_s": 300.0, "note": "incident 42"}),
    (["override", "--feature", "debug_capture", "--on", "--ttl", "30s"],
     {"feature": "debug_capture", "enabled": True, "ttl_s": 30.0}),
    (["override", "--feature", "ab_test", "--off", "--ttl", "1h"],
     {"feature": "ab_test", "enabled": False, "ttl_s": 3600.0}),
])
def test_override_posts_the_body_the_server_validates(argv: list[str], body: dict[str, Any]) -> None:
    admin = FakeAdmin()
    code, out = run(argv, admin)
    assert code == 0, out
    (req,) = admin.requests
    assert (req.method, req.url.path) == ("POST", "/admin/brownout/override")
    assert json.loads(req.content) == body
    # the server's own schema accepts it (extra fields are forbidden there)
    from serve_app.ingress import OverrideBody

    OverrideBody.model_validate(body)


def test_override_level_says_what_it_did() -> None:
    code, out = run(["override", "--level", "2", "--ttl", "30s"])
    assert code == 0 and out.startswith("level pinned at 2 for 30s (until ")


@pytest.mark.parametrize(("argv", "params"), [
    (["release"], [{"level": "true"}]),
    (["release", "--feature", "ab_test"], [{"feature": "ab_test"}]),
])
def test_release_deletes_the_override(argv: list[str], params: list[dict[str, str]]) -> None:
    admin = FakeAdmin()
    code, out = run(argv, admin)
    assert code == 0 and "released" in out
    assert [(r.method, r.url.path, dict(r.url.params)) for r in admin.requests] == [
        ("DELETE", "/admin/brownout/override", p) for p in params]


def test_release_all_drops_the_pin_and_every_feature_override() -> None:
    admin = FakeAdmin()
    admin.state["feature_overrides"] = {"ab_test": {"enabled": True, "expires_at": None},
                                        "debug_capture": {"enabled": False, "expires_at": None}}
    code, _ = run(["release", "--all"], admin)
    assert code == 0
    assert [dict(r.url.params) for r in admin.requests if r.method == "DELETE"] == [
        {"level": "true"}, {"feature": "ab_test"}, {"feature": "debug_capture"}]


def test_features_reads_the_cost_table_when_the_server_has_one() -> None:
    table = {"features": [{"feature": "semantic_cache_lookup", "cpu_ms_per_call": 12.5, "turned_off": 3},
                          {"feature": "ab_test", "cpu_ms_per_call": 0.1, "turned_off": 0}]}
    admin = FakeAdmin(features=table)
    code, out = run(["features"], admin)
    assert code == 0
    assert [r.url.path for r in admin.requests] == ["/admin/brownout/features"]
    rows = [line.split()[0] for line in out.splitlines()[3:] if line.strip()]
    assert rows == ["semantic_cache_lookup", "ab_test"]  # the server's order is kept


def test_features_falls_back_to_the_enrichment_counters() -> None:
    admin = FakeAdmin()
    code, out = run(["features"], admin)
    assert code == 0
    assert [r.url.path for r in admin.requests] == ["/admin/brownout/features", "/admin/brownout/enrichments"]
    assert "semantic_cache_lookup" in out and "12" in out


@pytest.mark.parametrize("doc", [
    [{"feature": "a", "x": 1}],
    {"features": [{"feature": "a", "x": 1}]},
    {"features": {"a": {"x": 1}}},
    {"a": {"x": 1}},
])
def test_feature_rows_accepts_the_plausible_envelopes(doc: Any) -> None:
    assert cli.feature_rows(doc) == [{"feature": "a", "x": 1}]


def test_watch_refreshes_count_times() -> None:
    admin = FakeAdmin()
    code, out = run(["watch", "--count", "3", "--interval", "1ms"], admin)
    assert code == 0
    assert len(admin.requests) == 3 and out.count("brownout watch") == 3


def test_watch_keeps_going_through_an_error_and_returns_the_last_frames_code() -> None:
    admin = FakeAdmin()
    calls = iter([httpx.ConnectError("refused"), None, httpx.ConnectError("refused")])

    def flaky(request: httpx.Request) -> httpx.Response:
        err = next(calls)
        if err is not None:
            raise err
        admin.fail = None
        response = admin(request)
        admin.fail = flaky
        return response

    admin.fail = flaky
    code, out = run(["watch", "--count", "3", "--interval", "1ms"], admin)
    assert code == cli.EXIT_UNREACHABLE
    assert out.count("error: app not running") == 2 and "level 2" in out


def test_simulate_delegates_to_the_trace_replay(capsys: pytest.CaptureFixture[str]) -> None:
    trace = Path(__file__).resolve().parents[2] / "configs" / "traces" / "oscillating.jsonl"
    assert cli.main(["simulate", str(trace), "--json", "--baseline", "naive"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in doc["runs"]][0] == "brownout" and len(doc["runs"]) == 2
    assert cli.main(["--json", "simulate", str(trace)]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] > 0
    assert cli.main(["simulate", "no-such-trace.jsonl"]) == cli.EXIT_USAGE


# -- --json ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["status", "--json"], ["--json", "status"], ["history", "--json"],
    ["override", "--level", "1", "--ttl", "30s", "--json"], ["release", "--json"], ["release", "--all", "--json"],
    ["features", "--json"],
])
def test_json_output_parses(argv: list[str]) -> None:
    code, out = run(argv)
    assert code == 0
    json.loads(out)


def test_status_json_is_the_servers_document() -> None:
    admin = FakeAdmin()
    code, out = run(["status", "--json"], admin)
    assert code == 0 and json.loads(out) == admin.state


def test_watch_json_is_one_document_a_line() -> None:
    code, out = run(["watch", "--json", "--count", "2", "--interval", "1ms"])
    assert code == 0
    assert [json.loads(line)["level"] for line in out.splitlines()] == [2, 2]


# -- exit codes and what the errors say ----------------------------------------------------------


def test_unreachable_app_is_exit_3_and_says_make_serve(capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    code, _ = run(["status"], transport=httpx.MockTransport(refuse))
    assert code == cli.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "app not running at http://127.0.0.1:8000" in err and "make serve" in err


def test_url_comes_from_the_environment() -> None:
    admin = FakeAdmin()
    code, _ = run(["status"], admin, env={"BROWNOUT_ADMIN_TOKEN": TOKEN, "BROWNOUT_URL": "http://10.1.2.3:9000/"})
    assert code == 0 and str(admin.requests[0].url).startswith("http://10.1.2.3:9000/admin/brownout")


def test_missing_token_is_exit_4_and_says_where_to_put_one(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run(["status", "--token-file", str(tmp_path / "none")], env={})
    assert code == cli.EXIT_AUTH
    err = capsys.readouterr().err
    assert "no admin token" in err and "--token" in err and "BROWNOUT_ADMIN_TOKEN" in err


def test_wrong_token_is_exit_4(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run(["status"], env={"BROWNOUT_ADMIN_TOKEN": "wrong"})
    assert code == cli.EXIT_AUTH
    err = capsys.readouterr().err
    assert "admin token refused" in err and "wrong admin token" in err and "BROWNOUT_ADMIN_TOKEN" in err


def test_closed_admin_api_is_exit_4_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    admin = FakeAdmin()
    admin.fail = lambda r: openai_error(403, "admin API disabled: no admin token configured (auth.admin_token_file)")
    assert run(["status"], admin)[0] == cli.EXIT_AUTH
    assert "admin API at http://127.0.0.1:8000 is closed" in capsys.readouterr().err


def test_bad_input_refused_by_the_server_is_exit_2_with_its_message(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run(["override", "--feature", "nope", "--on", "--ttl", "5m"])
    assert code == cli.EXIT_USAGE
    assert "unknown feature 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(("response", "code"), [
    (lambda r: openai_error(503, "policy actor unavailable: GetTimeoutError"), cli.EXIT_SERVER),
    (lambda r: openai_error(500, "internal error"), cli.EXIT_SERVER),
    (lambda r: httpx.Response(200, text="<html>not us</html>"), cli.EXIT_SERVER),
    (lambda r: openai_error(422, "n: must be >= 1"), cli.EXIT_USAGE),
])
def test_server_failures_map_to_exit_codes(response: Callable[[httpx.Request], httpx.Response], code: int) -> None:
    admin = FakeAdmin()
    admin.fail = response
    assert run(["status"], admin)[0] == code


def test_a_slow_server_is_exit_5_and_a_connect_timeout_exit_3() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    def unroutable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("no route", request=request)

    assert run(["status"], transport=httpx.MockTransport(slow))[0] == cli.EXIT_SERVER
    assert run(["status"], transport=httpx.MockTransport(unroutable))[0] == cli.EXIT_UNREACHABLE


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["override", "--level", "2"],  # no --ttl
    ["override", "--level", "2", "--ttl", "soon"],
    ["override", "--level", "7", "--ttl", "5m"],
    ["override", "--feature", "ab_test", "--ttl", "5m"],  # neither --on nor --off
    ["override", "--level", "2", "--on", "--ttl", "5m"],
    ["override", "--level", "2", "--feature", "ab_test", "--on", "--ttl", "5m"],
    ["history", "-n", "0"],
    ["release", "--all", "--feature", "ab_test"],
    ["watch", "--count", "-1"],
    ["status", "--url", "localhost:8000"],
])
def test_usage_errors_are_exit_2_and_send_nothing(argv: list[str]) -> None:
    admin = FakeAdmin()
    code, _ = run(argv, admin)
    assert code == cli.EXIT_USAGE
    assert admin.requests == []


def test_help_is_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "exit codes" in capsys.readouterr().out


def test_features_prints_the_servers_cost_ranking_first_row_first() -> None:
    """The shape ``GET /admin/brownout/features`` answers with (policies.feature_cost.rank)."""
    from policies.feature_cost import FeatureCost, merge, rank

    cost = FeatureCost()
    for _ in range(5):
        cost.record("semantic_cache_lookup", 1.0, 0.300, 0.010)
        cost.record("ab_test", 1.0, 0.002, 0.001)
    clock = {"debug_capture": {"off": True, "cause": "level", "disabled_s": 40.0, "turned_off": {"level": 2},
                               "disabled_s_window": 40.0, "turned_off_window": {"level": 2}}}
    rows = rank(merge(cost.snapshot(1.0), clock, {"ab_test": {"override": 1}}))
    doc = {"features": rows, "window_s": 300.0}
    admin = FakeAdmin(features=doc)
    code, out = run(["features"], admin)
    assert code == 0, out
    lines = [line for line in out.splitlines() if line.strip()]
    body = [line.split() for line in lines if line.split()[0].isdigit()]
    assert [b[1] for b in body] == ["semantic_cache_lookup", "ab_test", "debug_capture"]
    assert "last 5 min" in out and "off (level)" in out and "override 1" in out
    code, out = run(["features", "--json"], FakeAdmin(features=doc))
    assert code == 0 and json.loads(out)["features"][0]["feature"] == "semantic_cache_lookup"
