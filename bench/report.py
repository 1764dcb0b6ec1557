"""Summaries and plots of load-generator runs (`bench.loadgen.RunResult`).

Definitions (every figure in the report uses these):

- a request is *ok* when it got HTTP 200 and its stream ended with ``[DONE]``; *good* when ok
  and its end-to-end latency (from its *scheduled* time to its last byte) is within the SLO;
- rates divide by the run's active time: from the first arrival's slot (t = 0) to the end of
  the schedule or the last completion, whichever is later (``active_s``). Offered load divides
  by the schedule's length;
- throughput = ok / active_s; goodput = good / active_s (completions within the SLO per second);
- latency percentiles (linear interpolation) are over ok requests; TTFT is from the scheduled
  time to the first content token;
- *shed* = answered with 429 or 503 (refused at once, typically with ``Retry-After``);
- *client time-outs*: requests the client gave up on (cut off at the end of a run, or an httpx
  time-out); *non-200*: every other request that did not get HTTP 200 (an error status, or a
  connection error); *time to refusal*: from when a non-200 request was sent to its response;
- *SLO met again* after a step down: seconds from the step down to the start of the first 5 s
  window (sliding by 0.5 s, binned by arrival) whose p99 end to end is within the SLO, over the
  requests of the window that were not refused (429/503), one that did not complete counting
  as late;
- windows (5 s by default): arrivals, and the latencies of the requests that arrived in the
  window, are binned by scheduled time; completions and goodput by completion time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from bench.loadgen import CLASSES, CONN_ERROR, CUT_OFF, RequestRecord, RunResult
from deployments.window import percentile  # the project's one percentile (numpy's linear rule)

SHED_STATUSES = (429, 503)
NEVER_MS = 1e12  # the latency of a request that never completed, in a percentile


def status_key(rec: RequestRecord) -> str:
    if rec.status == CUT_OFF:
        return "cut_off"
    if rec.status in (None, CONN_ERROR):
        return "conn_error"
    if rec.status == 200 and not rec.ok:
        return "200_stream_error"
    return str(rec.status)


def status_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """How many of ``records`` got each outcome (`status_key`), in key order."""
    return dict(sorted(Counter(status_key(r) for r in records).items()))


def is_timeout(rec: RequestRecord) -> bool:
    """The client gave up: cut off at the end of the run, or an httpx time-out."""
    return rec.status == CUT_OFF or (rec.error or "").split(":")[0].endswith("Timeout")


def refusals(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """How requests that did not get HTTP 200 were answered (see the module docstring)."""
    non200 = [r for r in records if r.status != 200 and not is_timeout(r)]
    answered = [r for r in non200 if r.status not in (None, CONN_ERROR) and r.sent_s is not None
                and r.done_s is not None]
    with_ra = [r for r in non200 if r.status in SHED_STATUSES and "retry-after" in r.headers]
    return {
        "non200": len(non200),
        "refusal_p50_ms": _r(percentile([(r.done_s - r.sent_s) * 1000.0 for r in answered], 50)),  # type: ignore[operator]
        "non200_shed_retry_after_share": _r(len(with_ra) / len(non200), 4) if non200 else None,
        "client_timeouts": sum(1 for r in records if is_timeout(r)),
    }


def slo_met_again_s(records: Sequence[RequestRecord], step_down_s: float, slo_ms: float, end_s: float,
                    window_s: float = 5.0, slide_s: float = 0.5) -> float | None:
    """Seconds from the step down to the first window whose p99 is within the SLO (see the module
    docstring); None if no window that ends by ``end_s`` is."""
    k = 0
    while step_down_s + k * slide_s + window_s <= end_s + 1e-9:
        t0 = step_down_s + k * slide_s
        served = [r for r in records if t0 <= r.scheduled_s < t0 + window_s and r.status not in SHED_STATUSES]
        e2e = [r.e2e_ms if r.ok and r.e2e_ms is not None else NEVER_MS for r in served]
        p99 = percentile(e2e, 99)
        if p99 is not None and p99 <= slo_ms:
            return round(k * slide_s, 3)
        k += 1
    return None


def class_figures(per_class_summary: dict[str, dict[str, Any]], min_critical_good: float = 0.99) -> dict[str, Any] | None:
    """Per class: the share of requests that succeeded within the SLO and the shed rate; whether
    the shed rates are ordered sheddable >= standard >= critical (over the classes present) and
    whether critical requests met the SLO at least ``min_critical_good`` of the time."""
    if not per_class_summary:
        return None
    shed = [per_class_summary[c]["shed_ratio"] for c in reversed(CLASSES) if c in per_class_summary]
    crit = per_class_summary.get("critical", {}).get("good_ratio")
    return {
        "per_class": {c: {"requests": v["requests"], "good_ratio": v["good_ratio"], "shed_ratio": v["shed_ratio"]}
                      for c, v in per_class_summary.items()},
        "shed_order_ok": all(a >= b for a, b in zip(shed, shed[1:], strict=False)) if len(shed) > 1 else None,
        "critical_good_ok": None if crit is None else crit >= min_critical_good,
    }


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def active_s(records: Sequence[RequestRecord], span_s: float) -> float:
    last = max((r.done_s for r in records if r.done_s is not None), default=0.0)
    return max(span_s, last, 1e-9)


def summarize(records: Sequence[RequestRecord], slo_ms: float, span_s: float,
              denominator_s: float | None = None) -> dict[str, Any]:
    """Counts, rates and percentiles of ``records`` (see the module docstring)."""
    denom = denominator_s if denominator_s is not None else active_s(records, span_s)
    ok = [r for r in records if r.ok]
    good = [r for r in ok if (r.e2e_ms or 0.0) <= slo_ms]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    shed = [r for r in records if r.status in SHED_STATUSES]
    shed_ms = [r.e2e_ms for r in shed if r.e2e_ms is not None]
    n = len(records)
    return {
        "requests": n,
        "offered_rps": _r(n / span_s if span_s else 0.0, 3),
        "ok": len(ok),
        "good": len(good),
        "throughput_rps": _r(len(ok) / denom, 3),
        "goodput_rps": _r(len(good) / denom, 3),
        "good_ratio": _r(len(good) / n if n else None, 4),
        "shed": len(shed),
        "shed_ratio": _r(len(shed) / n if n else None, 4),
        "shed_p50_ms": _r(percentile(shed_ms, 50)),
        "errors": n - len(ok),
        "status_counts": status_counts(records),
        "e2e_ms": {f"p{q}": _r(percentile(e2e, q)) for q in (50, 90, 99)},
        "ttft_ms": {f"p{q}": _r(percentile(ttft, q)) for q in (50, 90, 99)},
        "max_level_seen": max((r.level for r in records if r.level is not None), default=None),
        "active_s": _r(denom, 2),
        **refusals(records),
    }


def per_class(records: Sequence[RequestRecord], slo_ms: float, span_s: float) -> dict[str, dict[str, Any]]:
    """The summary per criticality class (rates over the whole run's active time)."""
    denom = active_s(records, span_s)
    classes = sorted({r.criticality for r in records if r.criticality},
                     key=lambda c: CLASSES.index(c) if c in CLASSES else len(CLASSES))
    return {c: summarize([r for r in records if r.criticality == c], slo_ms, span_s, denom) for c in classes}


def windows(records: Sequence[RequestRecord], slo_ms: float, span_s: float,
            window_s: float = 5.0) -> list[dict[str, Any]]:
    """Per ``window_s`` window: offered, completed and good rates, latency percentiles, shed ratio
    per class (see the module docstring for what is binned by which time)."""
    end = active_s(records, span_s)
    count = max(1, math.ceil(end / window_s - 1e-9))
    out = []
    for i in range(count):
        t0, t1 = i * window_s, (i + 1) * window_s
        arrived = [r for r in records if t0 <= r.scheduled_s < t1]
        finished = [r for r in records if r.ok and r.done_s is not None and t0 <= r.done_s < t1]
        e2e = [r.e2e_ms for r in arrived if r.ok and r.e2e_ms is not None]
        ttft = [r.ttft_ms for r in arrived if r.ok and r.ttft_ms is not None]
        shed: dict[str, float | None] = {}
        for c in sorted({r.criticality or "all" for r in arrived}):
            mine = [r for r in arrived if (r.criticality or "all") == c]
            shed[c] = _r(sum(1 for r in mine if r.status in SHED_STATUSES) / len(mine), 3) if mine else None
        levels = [r.level for r in arrived if r.level is not None]
        out.append({
            "t_s": t0,
            "offered_rps": _r(len(arrived) / window_s, 2),
            "completed_rps": _r(len(finished) / window_s, 2),
            "goodput_rps": _r(sum(1 for r in finished if (r.e2e_ms or 0.0) <= slo_ms) / window_s, 2),
            "e2e_ms": {f"p{q}": _r(percentile(e2e, q)) for q in (50, 90, 99)},
            "ttft_ms": {"p99": _r(percentile(ttft, 99))},
            "shed_ratio": shed,
            "errors": sum(1 for r in arrived if not r.ok),
            "max_level": max(levels) if levels else None,
        })
    return out


def level_timeline(result: RunResult) -> list[tuple[float, int]]:
    """(t_s, level): the admin API's polls where there are any, else the responses' headers."""
    polled = [(p["t_s"], int(p["level"])) for p in result.levels if p.get("level") is not None]
    if polled:
        return polled
    return sorted((r.done_s, lv) for r in result.records
                  if r.done_s is not None and (lv := r.level) is not None)


def reaction_s(timeline: Iterable[tuple[float, int]], step_at_s: float, min_level: int = 1) -> float | None:
    """Seconds from the load step at ``step_at_s`` to the first time the level is >= ``min_level``
    (0 when it already was at the step); None if it never was afterwards."""
    before = [lv for t, lv in timeline if t <= step_at_s]
    if before and before[-1] >= min_level:
        return 0.0
    for t, lv in timeline:
        if t > step_at_s and lv >= min_level:
            return round(t - step_at_s, 3)
    return None


def level_changes(timeline: Sequence[tuple[float, int]]) -> int:
    return sum(1 for (_, a), (_, b) in zip(timeline, timeline[1:], strict=False) if a != b)


def run_report(name: str, result: RunResult, slo_ms: float, window_s: float = 5.0,
               **extra: Any) -> dict[str, Any]:
    """Everything about one run, JSON-ready."""
    span = result.span_s
    timeline = level_timeline(result)
    steps = result.profile.change_points_s
    classes = per_class(result.records, slo_ms, span)
    return {
        "name": name,
        "profile": result.profile.name,
        "span_s": span,
        "seed": result.seed,
        "stopped_early": result.stopped_early,
        **extra,
        "overall": summarize(result.records, slo_ms, span),
        "per_class": classes,
        "classes": class_figures(classes),
        "windows": windows(result.records, slo_ms, span, window_s),
        "levels": [{"t_s": t, "level": lv} for t, lv in timeline],
        # the door's caps and service model over the run, where the server has admission
        "admission": [{"t_s": p["t_s"], **p["admission"]} for p in result.levels if p.get("admission")],
        "level_changes": level_changes(timeline),
        "load_steps_s": steps,
        # a step profile (up, then down): how soon the SLO held again after the load fell
        "slo_met_again_s": slo_met_again_s(result.records, steps[1], slo_ms, span, window_s) if len(steps) == 2 else None,
        "offered_curve": [{"t_s": round(t, 2), "rps": round(result.profile.rate_at(t), 3)}
                          for t in _frange(0.0, span, max(0.5, span / 200))],
    }


def _frange(a: float, b: float, step: float) -> list[float]:
    n = int((b - a) / step) + 1
    return [a + i * step for i in range(n)]


# -- plots -----------------------------------------------------------------------------------------

def plot_runs(runs: Sequence[dict[str, Any]], path: str, title: str, slo_ms: float,
              summary_rows: Sequence[dict[str, Any]] | None = None, notes: Sequence[str] = ()) -> None:
    """One figure: an optional summary row (goodput, p99 and shed ratio per run, ``notes`` as
    text), then per run: latency percentiles over time, offered vs completed vs goodput, the
    level timeline, shed ratio per class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extra = 1 if summary_rows else 0
    nrows = len(runs) + extra
    fig, axes = plt.subplots(nrows, 4, figsize=(20, 2.6 * nrows + 0.8), squeeze=False)
    fig.suptitle(title, fontsize=12)
    if summary_rows:
        _plot_summary(axes[0], summary_rows, slo_ms, notes)
    for row, run in zip(axes[extra:], runs, strict=True):
        _plot_run(row, run, slo_ms)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=72)
    plt.close(fig)


def _plot_summary(row: Any, rows: Sequence[dict[str, Any]], slo_ms: float, notes: Sequence[str]) -> None:
    labels = [r["name"] for r in rows]
    x = range(len(rows))
    ax = row[0]
    ax.bar(x, [r["goodput_rps"] or 0 for r in rows], color="tab:green", label="goodput")
    ax.plot(x, [r["offered_rps"] or 0 for r in rows], "k_", markersize=20, label="offered")
    ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("req/s")
    ax.set_title("goodput (bar) vs offered (tick)", fontsize=9)
    ax = row[1]
    ax.bar(x, [(r["p99_ms"] or 0) / 1000 for r in rows], color="tab:red")
    ax.axhline(slo_ms / 1000, color="k", ls="--", lw=1, label="SLO")
    ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("p99 e2e (s)")
    ax.set_title("p99 end-to-end latency", fontsize=9)
    ax.legend(fontsize=7)
    ax = row[2]
    ax.bar(x, [r["shed_ratio"] or 0 for r in rows], color="tab:orange")
    ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("shed ratio")
    ax.set_title("refused at once (429/503)", fontsize=9)
    row[3].axis("off")
    row[3].text(0.0, 1.0, "\n".join(notes), va="top", fontsize=8, family="monospace")


def _plot_run(row: Any, run: dict[str, Any], slo_ms: float) -> None:
    w = run["windows"]
    t = [x["t_s"] for x in w]
    name = run["name"]
    ax = row[0]
    for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
        ax.plot(t, [(x["e2e_ms"][q] or math.nan) / 1000 for x in w], style, label=f"e2e {q}")
    ax.axhline(slo_ms / 1000, color="k", lw=0.8, ls="-.", label="SLO")
    ax.set_ylabel("s")
    ax.set_title(f"{name}: latency by arrival window", fontsize=9)
    ax.legend(fontsize=6)
    ax = row[1]
    ax.plot([p["t_s"] for p in run["offered_curve"]], [p["rps"] for p in run["offered_curve"]], "k-", lw=1,
            label="offered (profile)")
    ax.step(t, [x["offered_rps"] for x in w], where="post", color="gray", lw=0.8, label="arrived")
    ax.step(t, [x["completed_rps"] for x in w], where="post", color="tab:blue", label="completed")
    ax.step(t, [x["goodput_rps"] for x in w], where="post", color="tab:green", label="goodput")
    ax.set_ylabel("req/s")
    ax.set_title("offered vs completed vs goodput", fontsize=9)
    ax.legend(fontsize=6)
    ax = row[2]
    levels = run["levels"]
    if levels:
        ax.step([p["t_s"] for p in levels], [p["level"] for p in levels], where="post", color="tab:purple")
    else:
        ax.text(0.5, 0.5, "no level (not Brownout)", ha="center", va="center", transform=ax.transAxes)
    for s in run["load_steps_s"]:
        ax.axvline(s, color="k", ls=":", lw=0.8)
    ax.set_ylim(-0.2, 3.2)
    ax.set_yticks([0, 1, 2, 3])
    ax.set_title("level (dotted: load steps)", fontsize=9)
    ax = row[3]
    classes = sorted({c for x in w for c in x["shed_ratio"]})
    for c in classes:
        ax.plot(t, [x["shed_ratio"].get(c) if x["shed_ratio"].get(c) is not None else math.nan for x in w],
                label=c)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("shed ratio per class", fontsize=9)
    if classes:
        ax.legend(fontsize=6)
    for a in row:
        a.set_xlabel("t (s)", fontsize=7)
        a.tick_params(labelsize=7)
