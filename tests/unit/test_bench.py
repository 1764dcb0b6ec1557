"""The overload benchmark's pure parts: schedule, profiles, SLO rule, calibration search, report
figures; and one load run against a fake server (httpx.MockTransport). No timed assertions."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import httpx
import pytest

from bench import report as rep
from bench.loadgen import (
    CONN_ERROR,
    CRITICALITY_HEADER,
    CUT_OFF,
    DEFAULT_MIX,
    Calibration,
    Probe,
    RequestRecord,
    RunResult,
    SloRule,
    calibrate,
    calibrate_fit,
    constant,
    crossing,
    decisive_prefix,
    fit_p99,
    make_prompt,
    median_trace_seed,
    oscillate,
    parse_mix,
    reference_capacity,
    run_load,
    schedule,
    step,
    trace,
    unit_trace,
)


def rec(i: int, at: float, done: float | None, status: int | None = 200, crit: str | None = None,
        level: int | None = None, first: float | None = None) -> RequestRecord:
    r = RequestRecord(i, at, crit, sent_s=at, first_token_s=first, done_s=done, status=status)
    if level is not None:
        r.headers["x-brownout-level"] = str(level)
    return r


# -- profiles and schedule ---------------------------------------------------------------------

def test_step_profile_rates_and_change_points() -> None:
    p = step(4.0, low_s=10, high_s=20)
    assert p.duration_s == 40 and p.peak_rps == 12.0
    assert [p.rate_at(t) for t in (0, 9.9, 10, 29.9, 30, 39.9, 40)] == [2, 2, 12, 12, 2, 2, 0]
    assert p.change_points_s == [10, 30]


def test_oscillate_swings_around_center_never_negative() -> None:
    p = oscillate(3.0, 1.5, period_s=20, duration_s=40)
    assert p.rate_at(5) == pytest.approx(4.5) and p.rate_at(15) == pytest.approx(1.5)
    assert p.mean_rps(0, 40) == pytest.approx(3.0, abs=0.01)
    assert min(oscillate(1.0, 5.0, 10, 10).rate_at(t / 10) for t in range(100)) >= 0


def test_schedule_is_poisson_with_the_profile_rate_and_reproducible() -> None:
    p = constant(10.0, 200.0)
    a = schedule(p, random.Random(7))
    assert a == schedule(p, random.Random(7)) and a != schedule(p, random.Random(8))
    assert 0.9 * 2000 < len(a) < 1.1 * 2000
    times = [x.at_s for x in a]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 200
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 0.9 < cv < 1.1  # exponential gaps: coefficient of variation 1


def test_schedule_follows_a_step_and_respects_max_requests() -> None:
    p = step(10.0, low_s=100, high_s=100)  # 5/s, 30/s, 5/s
    a = schedule(p, random.Random(1))
    low = sum(1 for x in a if x.at_s < 100)
    high = sum(1 for x in a if 100 <= x.at_s < 200)
    assert 4.5 < high / low < 7.5
    assert len(schedule(p, random.Random(1), max_requests=50)) == 50


def test_mix_draws_classes_with_their_weights() -> None:
    a = schedule(constant(50.0, 100.0), random.Random(3), mix=DEFAULT_MIX)
    share = {c: sum(1 for x in a if x.criticality == c) / len(a) for c, _ in DEFAULT_MIX}
    for c, w in DEFAULT_MIX:
        assert abs(share[c] - w) < 0.03, share


def test_parse_mix() -> None:
    assert parse_mix("20/50/30") == (("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3))
    with pytest.raises(ValueError, match="three non-negative weights"):
        parse_mix("50/50")


def test_prompts_are_distinct_and_differ_between_seeds() -> None:
    rng = random.Random(5)
    prompts = [make_prompt(rng) for _ in range(500)]
    assert len(set(prompts)) == 500
    assert make_prompt(random.Random(1)) != make_prompt(random.Random(2))
    assert len(prompts[0].split()) == 12


# -- SLO rule and calibration ------------------------------------------------------------------

def test_slo_rule_allows_one_percent_late_and_one_percent_errors() -> None:
    rule = SloRule(slo_ms=2000)
    fine = [rec(i, i * 0.1, i * 0.1 + 1.0) for i in range(200)]
    assert rule.passed(fine)
    two_late = fine[:198] + [rec(198, 0, 3.0), rec(199, 0, 2.5)]
    assert rule.passed(two_late)
    assert not rule.passed(two_late[:197] + [rec(197, 0, 2.1)] + two_late[198:])
    two_errors = fine[:198] + [rec(198, 0, 0.01, 503), rec(199, 0, None, CUT_OFF)]
    assert rule.passed(two_errors)
    assert not rule.passed(fine[:197] + [rec(197, 0, 0.01, 503)] + two_errors[198:])


@pytest.mark.parametrize("done, now, expected", [
    # (per request: done time or None for still running), now, certainly failed?
    ([1.0] * 99 + [None], 1.5, False),     # nothing late yet
    ([1.0] * 98 + [3.0, None], 2.5, False),  # 1 late allowed, the overdue one may still become 1 error
    ([1.0] * 97 + [3.0, 3.0, None], 2.5, True),  # 2 late > 1 allowed
    ([1.0] * 97 + [3.0, None, None], 2.5, True),  # 1 late + 2 overdue > 1 late + 1 error
])
def test_certainly_failed(done: list, now: float, expected: bool) -> None:  # type: ignore[type-arg]
    rule = SloRule(slo_ms=2000)
    records = [rec(i, 0.0, d) for i, d in enumerate(done)]
    assert rule.certainly_failed(records, now, n_planned=100) is expected


def fake_server(capacity: float):  # type: ignore[no-untyped-def]
    calls: list[float] = []

    def measure(rate: float) -> Probe:
        calls.append(rate)
        return Probe(rate, rate <= capacity, 100, 0, None)

    return measure, calls


@pytest.mark.parametrize("capacity, start", [(3.4, 2.0), (6.75, 4.25), (0.7, 2.0), (3.4, 3.4), (20.0, 1.0)])
def test_calibrate_brackets_then_bisects(capacity: float, start: float) -> None:
    measure, calls = fake_server(capacity)
    cal = calibrate(measure, start, growth=2.0, bisect_steps=4)
    assert isinstance(cal, Calibration) and cal.bracketed
    assert cal.capacity_rps <= capacity
    lowest_failing = min(p.rate_rps for p in cal.probes if not p.passed)
    assert cal.capacity_rps == max(p.rate_rps for p in cal.probes if p.passed)
    # four halvings of a factor-2 bracket: within 1/16 of the bracket's low end
    assert lowest_failing - cal.capacity_rps <= cal.capacity_rps / 16 + 1e-9
    assert len(calls) == len(cal.probes) <= 12


def test_calibrate_stops_bisecting_within_the_tolerance() -> None:
    measure, calls = fake_server(3.4)
    cal = calibrate(measure, 2.0, growth=2.0, bisect_steps=10, rel_tol=0.15)
    assert cal.upper_rps is not None and (cal.upper_rps - cal.capacity_rps) / cal.capacity_rps <= 0.15
    assert len(calls) == 5  # 2 pass, 4 fail, bisect 3 (fail), 2.5 (pass), 2.75 (pass): 2.75..3 is 9%


def fitted_server(coarse_cap: float, p99_ms, noise_ms: float = 0.0, seed: int = 0, broken_above: float = 1e9):  # type: ignore[no-untyped-def]
    """Coarse probes pass up to coarse_cap; a fine probe at rate r measures p99_ms(r) (+ noise),
    or fails outright (errors) above ``broken_above``."""
    rng = random.Random(seed)
    calls: list[tuple[str, float]] = []

    def coarse(rate: float) -> Probe:
        calls.append(("coarse", rate))
        return Probe(rate, rate <= coarse_cap, 12, 0, None, stage="coarse")

    def fine(rate: float) -> Probe:
        calls.append(("fine", rate))
        if rate > broken_above:
            return Probe(rate, False, 24, 3, None, stage="fine")
        value = p99_ms(rate) + rng.gauss(0.0, noise_ms)
        return Probe(rate, value <= 4000.0, 24, 0, None, stage="fine", p99_fit_ms=value)

    return coarse, fine, calls


def test_fit_p99_and_crossing() -> None:
    assert fit_p99([1.0]) is None and fit_p99([2.0, 2.0]) == 2.0
    assert fit_p99([1.0, 3.0]) == pytest.approx(2.0 + 2.3263 * 2 ** 0.5)
    assert crossing([(1.0, 10.0), (2.0, 20.0), (3.0, 30.0)], 25.0) == pytest.approx(2.5)
    assert crossing([(1.0, 10.0), (2.0, 12.0), (3.0, 11.0), (4.0, 13.0)], 14.0) == pytest.approx(5.625)  # least squares: slope 0.8
    assert crossing([(1.0, 10.0), (2.0, 9.0)], 12.0) is None  # not rising
    assert crossing([(1.0, 10.0), (1.0, 20.0)], 15.0) is None  # one rate


@pytest.mark.parametrize("coarse_cap, true_cap", [(0.7, 0.6), (0.6, 0.7), (0.5, 0.5), (1.1, 0.8), (3.0, 3.3)])
def test_calibrate_fit_finds_where_the_p99_reaches_the_slo(coarse_cap: float, true_cap: float) -> None:
    # p99 rises linearly through the SLO at true_cap: 4000 ms there, 1000 ms per 10% of it
    coarse, fine, calls = fitted_server(coarse_cap, lambda r: 4000.0 + 10000.0 * (r - true_cap) / true_cap)
    cal = calibrate_fit(coarse, fine, 1.0, target_ms=4000.0)
    assert cal.capacity_rps == pytest.approx(true_cap, rel=1e-6)
    fine_rates = [r for stage, r in calls if stage == "fine"]
    assert 4 <= len(fine_rates) <= 6 and cal.probes[-len(fine_rates):][0].stage == "fine"
    assert cal.bracketed == any(r > true_cap for r in fine_rates)


def test_calibrate_fit_averages_noise_and_extends_its_design() -> None:
    # noisy p99 (sd 300 ms on a slope of 1000 ms per 10%): the fit lands within 10%
    for seed in range(5):
        coarse, fine, _ = fitted_server(0.6, lambda r: 4000.0 + 10000.0 * (r - 0.6) / 0.6, noise_ms=300.0, seed=seed)
        assert calibrate_fit(coarse, fine, 1.0, target_ms=4000.0).capacity_rps == pytest.approx(0.6, rel=0.1)
    # the guess far below: every fine probe passes, so the design extends upwards (twice at most)
    coarse, fine, calls = fitted_server(0.3, lambda r: 4000.0 + 2000.0 * (r - 0.6) / 0.6)
    cal = calibrate_fit(coarse, fine, 1.0, target_ms=4000.0)
    fine_rates = [r for stage, r in calls if stage == "fine"]
    assert len(fine_rates) == 6 and fine_rates[-2:] == pytest.approx([fine_rates[3] * 1.2, fine_rates[3] * 1.44])
    assert cal.capacity_rps == pytest.approx(1.2 * max(fine_rates))  # no further than 1.2 x the highest probed
    # flat p99 (no rising line): the highest rate whose fine probe passed
    coarse, fine, calls = fitted_server(0.6, lambda r: 3900.0)
    cal = calibrate_fit(coarse, fine, 1.0, target_ms=4000.0)
    assert cal.capacity_rps == max(r for stage, r in calls if stage == "fine") and not cal.bracketed


def test_calibrate_fit_stays_below_a_rate_that_failed_outright() -> None:
    # the p99 line says 0.66, but above 0.58 the server returned errors: below that, the highest pass
    coarse, fine, _ = fitted_server(0.6, lambda r: 4000.0 + 10000.0 * (r - 0.66) / 0.66, broken_above=0.58)
    cal = calibrate_fit(coarse, fine, 1.0, target_ms=4000.0)
    fines = [p for p in cal.probes if p.stage == "fine"]
    broken = min(p.rate_rps for p in fines if p.p99_fit_ms is None)
    assert broken < 0.66 and cal.bracketed
    assert cal.capacity_rps == max(p.rate_rps for p in fines if p.passed and p.rate_rps < broken)
    coarse, fine, _ = fitted_server(0.0, lambda r: 0.0)
    assert calibrate_fit(coarse, fine, 1.0, target_ms=4000.0).capacity_rps == 0.0


def test_calibration_trace_is_one_pattern_scaled_to_the_rate() -> None:
    a, b = trace(0.5, 40, 7), trace(2.0, 40, 7)
    assert len(a) == 40 and [x.at_s for x in a] == pytest.approx([4 * x.at_s for x in b])
    assert trace(0.5, 16, 7) == a[:16]  # a coarse probe is a prefix of a fine one
    assert trace(0.5, 40, 8) != a
    with pytest.raises(ValueError):
        trace(0.0, 4, 1)


def test_reference_capacity_ranks_bursty_traces_lower() -> None:
    regular = [float(i) for i in range(1, 11)]
    # gaps of 1/r at rate r: the 10th request waits 9 * (1 - 1/r); sojourn <= 2.5 up to r = 1.2
    assert reference_capacity(regular, limit=2.5) == pytest.approx(1.2, abs=1e-6)
    bursty = [1.0, 1.1, 1.2, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert reference_capacity(bursty, limit=2.5) < reference_capacity(regular, limit=2.5)
    # the first `warmup` requests are not judged
    assert reference_capacity(bursty, 2.5, warmup=3) > reference_capacity(bursty, 2.5)
    assert unit_trace(3, 5) == unit_trace(3, 5) and len(unit_trace(3, 5)) == 5


def test_decisive_prefix_holds_the_worst_burst() -> None:
    # a burst at arrivals 12-14 of an otherwise regular trace: the prefix must reach it
    unit = [float(i) for i in range(1, 13)] + [12.05, 12.1] + [float(i) for i in range(13, 31)]
    k = decisive_prefix(unit, warmup=2)
    assert 13 <= k <= 14
    assert reference_capacity(unit[:k], 2.5, 2) <= 1.05 * reference_capacity(unit, 2.5, 2)
    assert decisive_prefix(unit[:10], warmup=2) <= 10


def test_median_trace_seed_is_the_median_and_fixed() -> None:
    seed = median_trace_seed(30, candidates=11)
    caps = sorted(reference_capacity(unit_trace(s, 30), 2.5, 2) for s in range(11))
    assert reference_capacity(unit_trace(seed, 30), 2.5, 2) == caps[5]
    assert median_trace_seed(30, candidates=11) == seed


def test_judge_skips_the_warm_up_requests() -> None:
    from bench import overload

    rule = SloRule(slo_ms=4000)
    records = [rec(0, 0.0, 5.0), rec(1, 0.1, 4.5)] + [rec(i, i, i + 1.0) for i in range(2, 30)]
    assert overload.judge(rule, records, 2) == (True, 0, 0)
    assert overload.judge(rule, records, 1) == (False, 1, 0)
    records[10].status = 503
    assert overload.judge(rule, records, 2) == (False, 0, 1)


def test_calibrate_edge_cases() -> None:
    measure, _ = fake_server(0.0)
    assert calibrate(measure, 1.0, min_rps=0.2).capacity_rps == 0.0
    measure, _ = fake_server(1000.0)
    cal = calibrate(measure, 1.0, max_rps=8.0)
    assert (cal.capacity_rps, cal.bracketed) == (8.0, False)


# -- report ------------------------------------------------------------------------------------

def test_percentile_interpolates() -> None:
    assert rep.percentile([], 50) is None
    assert rep.percentile([5.0], 99) == 5.0
    assert rep.percentile([1, 2, 3, 4], 50) == 2.5
    assert rep.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert rep.percentile([10, 0], 100) == 10


def test_summary_goodput_throughput_and_statuses() -> None:
    records = [rec(0, 0.0, 1.0, first=0.5), rec(1, 1.0, 4.0, first=3.0),  # ok; ok but late (3 s)
               rec(2, 2.0, 2.01, 503), rec(3, 3.0, None, CUT_OFF), rec(4, 4.0, 5.0)]
    records[4].error = "stream ended without [DONE]"
    s = rep.summarize(records, slo_ms=2000, span_s=5.0)
    assert (s["requests"], s["ok"], s["good"], s["shed"], s["errors"]) == (5, 2, 1, 1, 3)
    assert s["offered_rps"] == 1.0 and s["throughput_rps"] == 0.4 and s["goodput_rps"] == 0.2
    assert s["status_counts"] == {"200": 2, "200_stream_error": 1, "503": 1, "cut_off": 1}
    assert s["e2e_ms"]["p50"] == 2000.0 and s["ttft_ms"]["p99"] == pytest.approx(1985.0)


def test_rates_use_the_active_time_when_completions_run_past_the_schedule() -> None:
    records = [rec(i, i * 1.0, i * 1.0 + 10.0) for i in range(10)]  # last one done at t = 19
    s = rep.summarize(records, slo_ms=2000, span_s=10.0)
    assert s["active_s"] == 19.0 and s["throughput_rps"] == round(10 / 19, 3) and s["goodput_rps"] == 0.0


def test_per_class_and_windows() -> None:
    records = [rec(0, 0.5, 1.0, crit="critical", level=0), rec(1, 1.0, 1.1, 503, crit="sheddable", level=2),
               rec(2, 6.0, 9.5, crit="critical", level=1), rec(3, 7.0, 7.2, crit="sheddable", level=1)]
    pc = rep.per_class(records, 2000, span_s=10.0)
    assert list(pc) == ["critical", "sheddable"]
    assert pc["sheddable"]["shed_ratio"] == 0.5 and pc["critical"]["good"] == 1
    w = rep.windows(records, 2000, span_s=10.0, window_s=5.0)
    assert [x["t_s"] for x in w] == [0.0, 5.0]
    assert w[0]["offered_rps"] == 0.4 and w[0]["shed_ratio"] == {"critical": 0.0, "sheddable": 1.0}
    assert w[1]["completed_rps"] == 0.4 and w[1]["goodput_rps"] == 0.2 and w[1]["e2e_ms"]["p50"] == 1850.0
    assert (w[0]["max_level"], w[1]["max_level"]) == (2, 1)


def test_refusal_figures() -> None:
    records = [rec(0, 0.0, 1.0), rec(1, 1.0, 1.02, 503), rec(2, 2.0, 2.04, 429), rec(3, 3.0, 3.1, 503),
               rec(4, 4.0, 4.5, 500), rec(5, 5.0, None, CUT_OFF), rec(6, 6.0, 16.0, CONN_ERROR)]
    for r in records[1:3]:
        r.headers["retry-after"] = "2"
    records[1].sent_s = 1.01  # time to refusal is from when it was sent: 10 ms
    records[6].error = "ConnectTimeout: timed out"
    s = rep.summarize(records, slo_ms=2000, span_s=7.0)
    # non-200: 503, 429, 503 (no Retry-After), 500; the cut-off and the connect time-out are time-outs
    assert (s["non200"], s["client_timeouts"]) == (4, 2)
    assert s["non200_shed_retry_after_share"] == 0.5
    assert s["refusal_p50_ms"] == pytest.approx(70.0)  # 10, 40, 100, 500 ms
    assert rep.summarize(records[:1], 2000, 1.0)["non200_shed_retry_after_share"] is None
    conn = rec(7, 0.0, 0.1, CONN_ERROR)
    conn.error = "ConnectError: refused"
    assert rep.refusals([conn]) == {"non200": 1, "refusal_p50_ms": None, "non200_shed_retry_after_share": 0.0,
                                    "client_timeouts": 0}


def test_slo_met_again_after_the_step_down() -> None:
    # step down at t = 10: arrivals until 13 wait behind the backlog (5 s), later ones take 1 s
    records = [rec(i, 10 + 0.25 * i, 10 + 0.25 * i + (5.0 if i < 12 else 1.0)) for i in range(40)]
    assert rep.slo_met_again_s(records, 10.0, 2000, end_s=20.0) == 3.0
    # refusals do not count against the SLO; a request that never completed does
    shed = [rec(i, 10 + 0.25 * i, 10 + 0.25 * i + 0.01, 503) for i in range(12)] + records[12:]
    assert rep.slo_met_again_s(shed, 10.0, 2000, end_s=20.0) == 0.0
    cut = [rec(0, 10.5, None, CUT_OFF)] + records[12:]
    assert rep.slo_met_again_s(cut, 10.0, 2000, end_s=20.0) == 1.0
    assert rep.slo_met_again_s(records[:12], 10.0, 2000, end_s=20.0) is None
    assert rep.slo_met_again_s(records, 10.0, 2000, end_s=14.0) is None  # no whole window after it


def test_class_figures_order_and_critical_share() -> None:
    records = ([rec(i, i * 0.1, i * 0.1 + 1.0, crit="critical") for i in range(100)]
               + [rec(100 + i, i * 0.1, i * 0.1 + 0.01, 429 if i < 20 else 200, crit="standard") for i in range(50)]
               + [rec(200 + i, i * 0.1, i * 0.1 + 0.01, 429 if i < 30 else 200, crit="sheddable") for i in range(50)])
    for r in records[100:]:
        if r.status == 200:
            r.done_s = r.scheduled_s + 1.0
    figs = rep.class_figures(rep.per_class(records, 2000, span_s=11.0))
    assert figs is not None
    assert figs["per_class"]["critical"] == {"requests": 100, "good_ratio": 1.0, "shed_ratio": 0.0}
    assert figs["per_class"]["sheddable"]["shed_ratio"] == 0.6 and figs["per_class"]["standard"]["good_ratio"] == 0.6
    assert figs["shed_order_ok"] is True and figs["critical_good_ok"] is True
    records[0].done_s = 5.0  # one critical request late: 99% within the SLO still holds
    records[1].status = 503  # and one shed: 98%, and critical now sheds more than nothing
    figs = rep.class_figures(rep.per_class(records, 2000, span_s=11.0))
    assert figs is not None and figs["critical_good_ok"] is False and figs["shed_order_ok"] is True
    inverted = [rec(0, 0.0, 0.01, 503, crit="critical"), rec(1, 0.0, 1.0, crit="sheddable")]
    figs = rep.class_figures(rep.per_class(inverted, 2000, span_s=1.0))
    assert figs is not None and figs["shed_order_ok"] is False
    assert rep.class_figures({}) is None


def test_reaction_time_and_level_changes() -> None:
    timeline = [(0.0, 0), (5.0, 0), (10.5, 0), (11.0, 1), (12.0, 3), (20.0, 2)]
    assert rep.reaction_s(timeline, 10.0) == 1.0
    assert rep.reaction_s(timeline, 10.0, min_level=3) == 2.0
    assert rep.reaction_s(timeline, 11.5) == 0.0
    assert rep.reaction_s([(0.0, 0), (9.0, 0)], 1.0) is None
    assert rep.level_changes(timeline) == 3


def test_level_timeline_prefers_polls_and_falls_back_to_headers() -> None:
    records = [rec(0, 0.0, 1.0, level=0), rec(1, 1.0, 2.0, level=2)]
    result = RunResult(constant(1.0, 2.0), records, [], 0.0, 1)
    assert rep.level_timeline(result) == [(1.0, 0), (2.0, 2)]
    result.levels.append({"t_s": 0.5, "level": 1})
    assert rep.level_timeline(result) == [(0.5, 1)]


def test_run_report_and_plot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    records = [rec(i, i * 0.5, i * 0.5 + 1.0, crit="standard", level=i % 2, first=i * 0.5 + 0.2) for i in range(20)]
    doc = rep.run_report("demo", RunResult(step(2.0, 2.0, 6.0), records, [], 0.0, 3), 2000.0, system="x")
    assert doc["overall"]["good"] == 20 and doc["load_steps_s"] == [2.0, 8.0] and doc["system"] == "x"
    json.dumps(doc)
    path = tmp_path / "fig.png"
    rep.plot_runs([doc, doc], str(path), "demo", 2000.0,
                  [{"name": "demo", "offered_rps": 2.0, "goodput_rps": 1.5, "p99_ms": 900.0, "shed_ratio": 0.0}])
    assert path.stat().st_size > 10_000


# -- one run against a fake server -------------------------------------------------------------

def sse_handler(seen: list[httpx.Request]):  # type: ignore[no-untyped-def]
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/admin/brownout":
            return httpx.Response(200, json={"level": 1, "policy_level": 1, "signals": {"values": {"queue_length": 3}},
                                             "ingress": {"admission": {"enabled": True, "in_flight": 2,
                                                                       "class_cap": {"critical": 5}, "rate_per_s": 1.5,
                                                                       "admitted": {"critical": 9}}}})
        body = json.loads(request.content)
        if body["messages"][0]["content"].startswith("x"):
            return httpx.Response(503, headers={"Retry-After": "1", "X-Brownout-Level": "1"},
                                  json={"error": {"message": "full"}})
        chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"delta": {"content": "hi"}}]},
                  {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, headers={"X-Brownout-Level": "1", "X-Brownout-Bypassed": "ab_test",
                                            "Content-Type": "text/event-stream"}, content=text.encode())
    return handle


def test_run_load_records_every_request_against_a_fake_server() -> None:
    seen: list[httpx.Request] = []
    result = asyncio.run(run_load("http://127.0.0.1:9", "m", constant(40.0, 0.5), seed=11, mix=DEFAULT_MIX,
                                  max_tokens=4, poll_levels_s=0.1, transport=httpx.MockTransport(sse_handler(seen))))
    chats = [r for r in seen if r.url.path == "/v1/chat/completions"]
    assert len(result.records) == len(chats) == len(schedule(constant(40.0, 0.5), random.Random(11)))
    assert result.levels and result.levels[0]["level"] == 1 and result.levels[0]["queue_length"] == 3
    # the door's state rides along: the polled keys, absent ones as None, nothing else
    assert result.levels[0]["admission"] == {"in_flight": 2, "waiting": None, "queued": None,
                                             "class_cap": {"critical": 5}, "reserved": None, "rate_per_s": 1.5, "base_latency_s": None,
                                             "per_request_s": None, "latency_alone_s": None, "latency_floor_s": None, "wait_smoothing_s": None,
                                             "caps_held_s": None, "level_models_replaced": None, "speed_shifts": None,
                                             "engine_slowdown": None, "slowdown_applied": None,
                                             "latency_tail": None, "tail_limit": None, "tail_holds": None,
                                             "measured_reach": None, "ramp_limit": None, "ramp_pressed": None,
                                             "arrival_rate_per_s": None,
                                             "refused": None}
    doc = rep.run_report("fake", result, 2000.0)
    assert doc["admission"] and doc["admission"][0]["class_cap"] == {"critical": 5} and "t_s" in doc["admission"][0]
    for r, req in zip(result.records, chats, strict=True):
        body = json.loads(req.content)
        assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 4
        assert req.headers[CRITICALITY_HEADER] == r.criticality
        assert r.sent_s is not None and r.done_s is not None and r.done_s >= r.sent_s
        if body["messages"][0]["content"].startswith("x"):
            assert (r.status, r.headers["retry-after"], r.ok) == (503, "1", False)
        else:
            assert r.ok and r.completion_tokens == 4 and r.first_token_s is not None
            assert r.headers == {"x-brownout-level": "1", "x-brownout-bypassed": "ab_test"} and r.level == 1


def test_run_load_sends_a_given_trace_with_fresh_prompts() -> None:
    seen: list[httpx.Request] = []
    arrivals = trace(20.0, 6, 5)
    runs = [asyncio.run(run_load("http://127.0.0.1:9", "m", constant(20.0, arrivals[-1].at_s + 0.01), seed=seed,
                                 arrivals=arrivals, poll_levels_s=None,
                                 transport=httpx.MockTransport(sse_handler(seen)))) for seed in (1, 2)]
    for result in runs:
        assert [r.scheduled_s for r in result.records] == [a.at_s for a in arrivals]
    prompts = [json.loads(r.content)["messages"][0]["content"] for r in seen]
    assert len(prompts) == 12 and len(set(prompts)) == 12


def test_run_load_stops_early_when_asked_and_refuses_other_hosts() -> None:
    result = asyncio.run(run_load("http://127.0.0.1:9", "m", constant(50.0, 30.0), seed=2, poll_levels_s=None,
                                  stop=lambda records, now, n: len(records) >= 5,
                                  transport=httpx.MockTransport(sse_handler([]))))
    assert result.stopped_early and 5 <= len(result.records) < 50
    with pytest.raises(ValueError, match=re.escape("loopback only")):
        asyncio.run(run_load("http://example.com", "m", constant(1.0, 1.0)))


# -- the comparison's figures (bench/overload.py, without a cluster) ----------------------------

def test_ratios_and_table_from_run_reports() -> None:
    from bench import overload

    def run(name: str, p99_good: float, load: str) -> dict:  # type: ignore[type-arg]
        records = [rec(i, i * 0.5, i * 0.5 + p99_good, level=1 if i >= 4 else 0) for i in range(20)]
        profile = step(2.0, 2.0, 6.0) if load == "step" else constant(2.0, 10.0)
        result = RunResult(profile, records, [{"t_s": 3.5, "level": 1}] if load == "step" else [], 0.0, 1)
        return rep.run_report(name, result, 2000.0, load=load)

    runs = [run("adaptive @1.5x", 1.0, "1.5x"), run("pinned0 @1.5x", 4.0, "1.5x"), run("adaptive @3x", 1.0, "3x"),
            run("adaptive step", 1.0, "step"), run("adaptive @1.5x standard", 0.5, "1.5x")]
    capacity = {"C0": {"capacity_rps": 2.0}, "C3": {"capacity_rps": 4.0}, "builtin": {"capacity_rps": 2.0}}
    unloaded = {"brownout level 0": {"unloaded_e2e_ms_p50": 1500.0}, "builtin": {"unloaded_e2e_ms_p50": 1200.0},
                "brownout level 3": {"unloaded_e2e_ms_p50": 800.0}}
    r = overload.ratios(runs, capacity, 2000.0, unloaded)
    # pinned 0's p99 (4 s) over level 3 alone (0.8 s): no adaptive p99 can make the ratio exceed 5
    assert r["pinned0 p99 at 1.5xC0 / level 3 alone (ceiling of pinned0 / adaptive p99)"] == 5.0
    # its 20 requests of 4 s each, sent over 10 s, done by 13.5 s: 1.48 completed per 2 offered
    assert r["pinned0 @1.5x: completed / offered"] == 0.741
    assert r["adaptive: p99 at 1.5xC0 / SLO"] == 0.5 and r["pinned0 p99 / adaptive p99 at 1.5xC0"] == 4.0
    assert r["adaptive: goodput at 3xC0 / C3"] == round(runs[2]["overall"]["goodput_rps"] / 4.0, 3)
    assert r["C3 / built-in capacity"] == 2.0 and r["reaction s (load step -> level >= 1)"] == 1.5
    assert r["reaction s, as polled (load step -> level >= 1)"] == 1.5
    # with the policy actor's history the reaction is when it changed the level, not when a poll saw it
    runs[3]["transitions"] = [{"t_s": 3.2, "from": 0, "to": 2, "signal": "refused_ratio"}]
    r2 = overload.ratios(runs, capacity, 2000.0, unloaded)
    assert r2["reaction s (load step -> level >= 1)"] == 1.2
    assert r2["reaction s, as polled (load step -> level >= 1)"] == 1.5
    runs[3]["transitions"] = [{"t_s": 1.0, "from": 0, "to": 1}, {"t_s": 2.5, "from": 1, "to": 2}]
    assert overload.ratios(runs, capacity, 2000.0, unloaded)["reaction s (load step -> level >= 1)"] == 0.0
    del runs[3]["transitions"]
    assert r["adaptive: within the SLO at 1.5xC0"] == 1.0
    # the 1.5x load with one class, beside the mixed one
    assert r["adaptive, standard only: within the SLO at 1.5xC0"] == 1.0
    assert r["adaptive, standard only: p99 at 1.5xC0 / SLO"] == 0.25
    assert r["pinned0 p99 / adaptive standard-only p99 at 1.5xC0"] == 8.0
    assert r["SLO met again s after the step down"] is None  # 2 s after it: no whole 5 s window
    assert r["one at a time: e2e p50 Brownout level 0 / built-in"] == 1.25
    assert "one at a time: e2e p50 Brownout level 0 after its warm-up / built-in" not in r
    # measured again just before the built-in app: the ratio takes that one, the first beside it
    last = overload.ratios(runs, capacity, 2000.0, {**unloaded, overload.LAST_LEVEL0: {"unloaded_e2e_ms_p50": 1320.0}})
    assert last["one at a time: e2e p50 Brownout level 0 / built-in"] == 1.1
    assert last["one at a time: e2e p50 Brownout level 0 after its warm-up / built-in"] == 1.25
    assert last["one at a time: e2e p50 Brownout level 3 / built-in"] == r["one at a time: e2e p50 Brownout level 3 / built-in"]
    assert r["adaptive @3x: client time-outs"] == 0 and r["adaptive @3x: median time to refusal ms"] is None
    text = overload.table(runs)
    assert text.splitlines()[0].split()[:3] == ["run", "offered", "thru"] and "adaptive @1.5x" in text
    assert "refuse ms" in text.splitlines()[0]


def test_ratios_report_refusals_and_classes_of_the_3x_run() -> None:
    from bench import overload

    records = []
    for i in range(60):
        crit = ("critical", "standard", "sheddable")[i % 3]
        shed = (crit == "sheddable" and i % 2 == 0) or (crit == "standard" and i % 9 == 1)
        r = rec(i, i * 0.2, i * 0.2 + (0.02 if shed else 1.5), 429 if shed else 200, crit=crit)
        if shed:
            r.headers["retry-after"] = "1"
        records.append(r)
    records[-1].status, records[-1].done_s = CUT_OFF, None
    run = rep.run_report("adaptive @3x", RunResult(constant(5.0, 12.0), records, [], 0.0, 1), 2000.0, load="3x")
    r = overload.ratios([run], {}, 2000.0)
    assert r["adaptive @3x: median time to refusal ms"] == pytest.approx(20.0)
    assert r["adaptive @3x: non-200 that are 429/503 with Retry-After"] == 1.0
    assert r["adaptive @3x: client time-outs"] == 1
    assert r["adaptive @3x: within the SLO per class"]["critical"] == 1.0
    shed = r["adaptive @3x: shed rate per class"]
    assert shed["sheddable"] > shed["standard"] > shed["critical"] == 0.0
    assert r["adaptive @3x: shed sheddable >= standard >= critical"] is True
    assert r["adaptive @3x: critical >= 99% within the SLO"] is True
    lines = overload.class_table([run])
    assert "critical 100%/0%" in lines and "shed order ok: yes" in lines


def test_repeat_figures_judge_each_repeat_against_its_own_c3_and_pool_the_classes() -> None:
    from bench import overload

    def run3x(name: str, critical_late: int) -> dict:  # type: ignore[type-arg]
        records = []
        for i in range(60):
            crit = ("critical", "standard", "sheddable")[i % 3]
            shed = crit == "sheddable" or (crit == "standard" and i % 2 == 0)
            late = crit == "critical" and i // 3 < critical_late
            r = rec(i, i * 0.2, i * 0.2 + (0.02 if shed else 2.5 if late else 1.5), 429 if shed else 200, crit=crit)
            records.append(r)
        return rep.run_report(name, RunResult(constant(5.0, 12.0), records, [], 0.0, 1), 2000.0, load="3x")

    def run15(name: str, good_s: float) -> dict:  # type: ignore[type-arg]
        records = [rec(i, i * 0.5, i * 0.5 + good_s) for i in range(20)]
        return rep.run_report(name, RunResult(constant(2.0, 10.0), records, [], 0.0, 1), 2000.0, load="1.5x")

    runs = [run15("adaptive @1.5x", 1.0), run3x("adaptive @3x", 0),
            run15("adaptive @1.5x #2", 1.5), run3x("adaptive @3x #2", 1),
            run15("adaptive @1.5x #3", 3.0), run3x("adaptive @3x #3", 0),
            run15("adaptive @1.5x standard #2", 2.5)]  # without headers: in repeat 2 only
    capacity = {"C0": {"capacity_rps": 2.0},
                "C3": {"capacity_rps": 4.0}, "C3 #2": {"capacity_rps": 2.0}, "C3 #3": {"capacity_rps": 4.0}}
    out = overload.repeat_figures(runs, capacity, 2000.0)
    assert out is not None
    rows = out["per_repeat"]
    assert [r["repeat"] for r in rows] == [1, 2, 3] and [r["C3_rps"] for r in rows] == [4.0, 2.0, 4.0]
    # the 1.5x load (1.5 x C0 = 3 req/s) against each repeat's C3: under it in 1 and 3, over it in 2
    assert [r["1.5xC0 / C3"] for r in rows] == [0.75, 1.5, 0.75]
    g1 = runs[1]["overall"]["goodput_rps"]
    assert rows[0]["goodput at 3xC0 / C3"] == round(g1 / 4.0, 3)  # each against the C3 beside it
    assert rows[1]["goodput at 3xC0 / C3"] == round(runs[3]["overall"]["goodput_rps"] / 2.0, 3)
    assert rows[0]["critical within the SLO at 3xC0"] == 1.0 and rows[1]["critical within the SLO at 3xC0"] == 0.95
    assert [r["within the SLO at 1.5xC0"] for r in rows] == [1.0, 1.0, 0.0]
    assert out["median"]["within the SLO at 1.5xC0"] == 1.0
    assert out["median"]["p99 at 1.5xC0 / SLO"] == rows[1]["p99 at 1.5xC0 / SLO"]
    assert "within the SLO at 1.5xC0, standard only" not in rows[0]
    assert rows[1]["within the SLO at 1.5xC0, standard only"] == 0.0 == out["median"]["within the SLO at 1.5xC0, standard only"]
    # pooled: 60 critical requests, one late; 99% fails on the pool as it does in repeat 2
    crit = out["pooled_3x"]["critical"]
    assert crit["requests"] == 60 and crit["good"] == 59 and crit["good_ratio"] == round(59 / 60, 4)
    assert out["pooled_3x_critical_good_ok"] is False and out["pooled_3x_shed_order_ok"] is True
    # one repeat: nothing to add to the ratios
    assert overload.repeat_figures(runs[:2], capacity, 2000.0) is None


def test_repeat_figures_size_each_repeat_from_its_own_c0_where_it_was_measured_again() -> None:
    """``--c0-each-repeat``: a repeat's 1.5x load is judged against its own C0 (``C0 #k``), and
    the row names it; without one, the first C0 stands (the test above)."""
    from bench import overload

    def run(name: str, load: str) -> dict:  # type: ignore[type-arg]
        records = [rec(i, i * 0.5, i * 0.5 + 1.0) for i in range(20)]
        return rep.run_report(name, RunResult(constant(2.0, 10.0), records, [], 0.0, 1), 2000.0, load=load)

    runs = [run("adaptive @1.5x", "1.5x"), run("adaptive @3x", "3x"),
            run("adaptive @1.5x #2", "1.5x"), run("adaptive @3x #2", "3x")]
    capacity = {"C0": {"capacity_rps": 2.0}, "C0 #2": {"capacity_rps": 1.0},
                "C3": {"capacity_rps": 4.0}, "C3 #2": {"capacity_rps": 3.0}}
    out = overload.repeat_figures(runs, capacity, 2000.0)
    assert out is not None
    rows = out["per_repeat"]
    assert [r["1.5xC0 / C3"] for r in rows] == [0.75, 0.5]  # 1.5 x 2 / 4, then 1.5 x 1 / 3
    assert "C0_rps" not in rows[0] and rows[1]["C0_rps"] == 1.0
    assert "C0_rps" not in out["median"]
    args = overload.build_parser().parse_args(["--adaptive-repeats", "3", "--c0-each-repeat"])
    assert args.c0_each_repeat is True and overload.build_parser().parse_args([]).c0_each_repeat is False


def test_adaptive_repeats_must_be_one_or_more() -> None:
    import argparse

    from bench import overload

    args = argparse.Namespace(quick=True, slo_ms=2000.0, bisect=None, run_s=None, drain_s=None, max_tokens=16,
                              no_mix=False, mix=None, seed=None, no_progress=True, only=None, adaptive_repeats=0)
    with pytest.raises(SystemExit, match="--adaptive-repeats: 0"):
        overload.Plan(args)


@pytest.mark.parametrize("argv, message", [
    (["--c0-each-repeat"], "--c0-each-repeat: .* --adaptive-repeats is 1, give 2 or more"),
    (["--c0-each-repeat", "--adaptive-repeats", "3", "--c0", "8.5"], "--c0-each-repeat with --c0 8.5"),
])
def test_c0_each_repeat_refuses_where_it_could_do_nothing(argv: list[str], message: str) -> None:
    from bench import overload

    with pytest.raises(SystemExit, match=message):
        overload.Plan(overload.build_parser().parse_args(argv))
    overload.Plan(overload.build_parser().parse_args(["--c0-each-repeat", "--adaptive-repeats", "2"]))  # accepted


def test_step_repeats_and_step_only_choose_the_adaptive_runs() -> None:
    from bench import overload

    def names(argv: list[str]) -> list[str]:
        plan = overload.Plan(overload.build_parser().parse_args(argv))
        return [name for name, _, _ in overload.adaptive_runs(plan, 8.0, {"1.5x": 12.0, "3x": 24.0})]

    assert names([]) == ["adaptive @1.5x", "adaptive @1.5x standard", "adaptive @3x", "adaptive step",
                         "adaptive oscillate"]
    assert names(["--step-repeats", "3"]) == ["adaptive @1.5x", "adaptive @1.5x standard", "adaptive @3x",
                                              "adaptive step", "adaptive step #2", "adaptive step #3",
                                              "adaptive oscillate"]
    assert names(["--step-only", "--step-repeats", "2"]) == ["adaptive step", "adaptive step #2"]
    plan = overload.Plan(overload.build_parser().parse_args(["--step-only", "--step-repeats", "2"]))
    runs = overload.adaptive_runs(plan, 8.0, {"1.5x": 12.0, "3x": 24.0})
    assert [extra for _, _, extra in runs] == [{"load": "step"}, {"load": "step", "repeat": 2}]
    for argv, message in ((["--step-repeats", "0"], "--step-repeats: 0"),
                          (["--step-only", "--adaptive-repeats", "2"], "--step-only with --adaptive-repeats 2")):
        with pytest.raises(SystemExit, match=message):
            overload.Plan(overload.build_parser().parse_args(argv))


def test_rel_diff_and_staged_probe_sizes() -> None:
    import argparse

    from bench import overload

    assert overload.rel_diff([0.6, 0.66]) == 0.1 and overload.rel_diff([0.0, 1.0]) is None
    plan = overload.Plan(argparse.Namespace(quick=False, slo_ms=4000.0, run_s=None, drain_s=None, bisect=None,
                                            max_tokens=16, mix=None, no_mix=True, seed=None, no_progress=True,
                                            only=None))  # what other scripts pass (no calibration options)
    assert plan.trace_seed == median_trace_seed(plan.probe_n) and plan.coarse_n < plan.probe_n
    assert overload.probe_size(plan, 0.5, "coarse") == plan.coarse_n
    assert overload.probe_size(plan, 0.5, "fine") == plan.probe_n
    assert overload.probe_size(plan, 0.1, "fine") == plan.coarse_n  # 75 s hold fewer, but never below the prefix
    # a fast server at a high rate: at least probe_s (15 s) and coarse_s (6 s) of arrivals, not a
    # burst of 24 in under a second that the engine's batch absorbs whole
    assert (plan.probe_s, plan.coarse_s) == (15.0, 6.0)
    assert overload.probe_size(plan, 30.0, "fine") == 450 and overload.probe_size(plan, 30.0, "coarse") == 180
    assert overload.probe_size(plan, 1.0, "coarse") == plan.coarse_n  # the prefix already lasts longer
    plan.probe_s = 100.0
    assert overload.probe_size(plan, 0.5, "fine") == 50


def test_only_names_known_runs() -> None:
    from bench import overload

    with pytest.raises(SystemExit, match="unknown run"):
        overload.main(["--only", "pinned9"])


# -- bench/c0_compare.py's pure helpers ----------------------------------------------------------

def test_c0_compare_order_config_and_summary() -> None:
    from bench import c0_compare as cc

    assert cc.run_order(2) == ["before", "after", "before", "after"]

    def config(policy: dict) -> dict:  # type: ignore[type-arg]
        return {"http_options": {"port": 8000}, "applications": [{"args": {"model": {"dtype": "auto"}}, "deployments": [
            {"name": "Ingress", "user_config": {"policy": {"degradation": policy}}}]}]}

    old = config({"level1": {}})
    new, has_admission = cc.patch_config(old, 1234, "data", 4000.0)
    assert not has_admission and old["http_options"]["port"] == 8000  # the input is not changed
    assert new["http_options"]["port"] == 1234 and new["applications"][0]["args"]["model"]["dtype"] == "float32"
    assert new["applications"][0]["args"]["enrichments"]["data_dir"] == "data"
    assert "admission" not in new["applications"][0]["deployments"][0]["user_config"]["policy"]["degradation"]
    new, has_admission = cc.patch_config(config({"slo": {"e2e_p99_ms": 2000}}), 1, "d", 4000.0)
    degradation = new["applications"][0]["deployments"][0]["user_config"]["policy"]["degradation"]
    assert has_admission and degradation["slo"]["e2e_p99_ms"] == 4000.0 and degradation["admission"] == {"enabled": False}

    runs = [{"side": "before", "c0_rps": 0.5, "unloaded": {"unloaded_e2e_ms_p50": 1500.0}},
            {"side": "after", "c0_rps": 0.6, "unloaded": {}}, {"side": "before", "c0_rps": 0.7},
            {"side": "after", "failed": "x"}]
    s = cc.summarize(runs)
    assert s["before"]["median_c0_rps"] == 0.6 and s["after"]["c0_rps"] == [0.6]
    assert s["ratio_after_over_before"] == 1.0 and s["before"]["median_unloaded_e2e_ms_p50"] == 1500.0
    assert cc.summarize([])["ratio_after_over_before"] is None
    assert cc.pair_fits(0.0, [], 10.0) and cc.pair_fits(100.0, [200.0, 300.0], 700.0)
    assert not cc.pair_fits(101.0, [200.0, 300.0], 700.0)


def test_process_group_names_replicas_engine_and_ray_daemons() -> None:
    from bench.c0_compare import process_group

    assert process_group(["ray::ServeReplica:brownout:Ingress"], "python") == "replica:Ingress"
    assert process_group(["ray::ServeReplica:brownout:VLLMModel.generate"], "x") == "replica:VLLMModel.generate"
    assert process_group(["VLLM::EngineCore"], "VLLM::EngineCore") == "vllm_engine_core"
    assert process_group([".../raylet", "--node"], "raylet") == "raylet"
    assert process_group(["ray::ProxyActor"], "x") == "serve_proxy"
    assert process_group([], "mystery") == "other"


def test_cpu_by_group_counts_new_processes_from_zero_and_per_request() -> None:
    from bench.c0_compare import cpu_by_group

    before = {1: ("replica:Ingress", 10.0), 2: ("vllm_engine_core", 100.0)}
    after = {1: ("replica:Ingress", 12.0), 2: ("vllm_engine_core", 130.0), 3: ("raylet", 1.0)}
    out = cpu_by_group(before, after, requests=10)
    assert list(out) == ["vllm_engine_core", "replica:Ingress", "raylet"]
    assert out["vllm_engine_core"] == {"cpu_s": 30.0, "cpu_ms_per_request": 3000.0}
    assert out["replica:Ingress"]["cpu_ms_per_request"] == 200.0
    assert out["raylet"]["cpu_s"] == 1.0
    assert cpu_by_group(before, after, requests=0)["raylet"]["cpu_ms_per_request"] is None


def test_an_adaptive_run_waits_three_arrival_rate_time_constants_at_level_0() -> None:
    from bench.overload import quiet_s

    assert quiet_s({"degradation": {"slo": {"e2e_p99_ms": 2000}}}) == 30.0  # the default 10 s
    assert quiet_s({"degradation": {"admission": {"reserve_window_s": 4}}}) == 12.0


def test_the_one_class_1_5x_run_sends_standard_on_every_request() -> None:
    import argparse

    from bench import overload

    args = argparse.Namespace(quick=True, slo_ms=2000.0, bisect=None, run_s=None, drain_s=None, max_tokens=16,
                              no_mix=False, mix=None, seed=None, no_progress=True, only=None, adaptive_repeats=2)
    plan = overload.Plan(args)
    assert plan.mix  # the 20/50/30 mix by default, for every other run
    name, profile, extra = overload.one_class_run(6.0, plan)
    assert name == "adaptive @1.5x standard" and extra["criticality"] == "standard" and extra["load"] == "1.5x"
    assert dict(extra["mix"]) == {"critical": 0.0, "standard": 1.0, "sheddable": 0.0}
    assert profile.rate_at(1.0) == 6.0
    name, _, extra = overload.one_class_run(6.0, plan, 2)
    assert name == "adaptive @1.5x standard #2" and extra["repeat"] == 2


def test_fixed_runs_are_long_enough_to_judge_a_share_of_critical_requests() -> None:
    import argparse

    from bench import overload
    from bench.loadgen import DEFAULT_MIX

    # a fast machine (C0 6 req/s): 60 s at 3 x C0 already hold 216 critical requests
    assert overload.sized_run_s(60.0, 6.0, DEFAULT_MIX) == 60.0
    # a slow one (C0 1.26): 60 s would hold 45; 100 / (3 * 1.26 * 0.2) = 132.3 s, rounded up to 5 s
    assert overload.sized_run_s(60.0, 1.26, DEFAULT_MIX) == 135.0
    assert overload.sized_run_s(60.0, 1.26, DEFAULT_MIX) * 3 * 1.26 * 0.2 >= overload.MIN_CRITICAL
    # no mix: every request counts; a tiny C0 is capped, a zero one leaves the floor
    assert overload.sized_run_s(60.0, 0.3, None) == 115.0
    assert overload.sized_run_s(60.0, 0.01, DEFAULT_MIX) == overload.MAX_RUN_S
    assert overload.sized_run_s(60.0, 0.0, DEFAULT_MIX) == 60.0
    assert overload.sized_run_s(60.0, 1.0, (("standard", 1.0),)) == 60.0  # no critical work to count

    def plan(**kw: object) -> overload.Plan:
        ns = dict(quick=False, slo_ms=2000.0, run_s=None, drain_s=None, bisect=None, max_tokens=16, mix=None,
                  no_mix=False, seed=None, no_progress=True, only=None)
        return overload.Plan(argparse.Namespace(**{**ns, **kw}))

    assert plan().size_runs(1.26) == 135.0
    assert plan(run_s=45.0).size_runs(1.26) == 45.0  # --run-s is kept whatever C0 is
    assert plan(quick=True).size_runs(1.26) == 15.0


def seeded_plan(seed: int | None, quick: bool = False, no_mix: bool = False) -> Any:
    """The overload benchmark's `Plan` with ``--seed`` (None: none), as its command line makes it."""
    import argparse

    from bench import overload

    return overload.Plan(argparse.Namespace(quick=quick, slo_ms=2000.0, run_s=None, drain_s=None, bisect=None,
                                            max_tokens=16, mix=None, no_mix=no_mix, seed=seed,
                                            no_progress=True, only=None))


def test_a_runs_seed_follows_its_name_not_the_probes_before_it() -> None:
    """With ``--seed`` a named run's schedule is the same whatever the calibration before it
    took; another ``--seed`` gives it another one; a label run again gets a new one (new
    prompts per probe); without ``--seed`` every run is fresh (None)."""
    short, long_ = seeded_plan(207), seeded_plan(207)
    for rate in (1.0, 2.0):
        short.next_seed(f"C3 (level 3) coarse {rate:.3f}/s")
    for rate in (1.0, 2.0, 1.5, 1.75, 1.6):  # the search took more probes
        long_.next_seed(f"C3 (level 3) coarse {rate:.3f}/s")
    first = short.next_seed("adaptive @3x")
    assert first == long_.next_seed("adaptive @3x") and first is not None
    assert seeded_plan(208).next_seed("adaptive @3x") != first
    assert short.next_seed("adaptive @3x") != first  # the same label again: a new schedule
    assert short.next_seed("adaptive @3x #2") not in (None, first)
    assert seeded_plan(None).next_seed("adaptive @3x") is None


def test_runs_of_different_systems_at_one_load_share_its_schedule() -> None:
    """Pinned level 0 and the adaptive policy at 1.5 x are compared by their p99s: they get the
    same requests at the same times (the schedule's seed follows the load and the repeat, not the
    run's name or what ran before), with ``--seed`` and without it; repeats and loads differ."""
    for p in (seeded_plan(207), seeded_plan(None)):
        pinned = p.schedule_seed("1.5x #1")
        p.next_seed("adaptive @3x")  # other runs in between change nothing
        assert p.schedule_seed("1.5x #1") == pinned is not None
        assert len({pinned, p.schedule_seed("1.5x #2"), p.schedule_seed("3x #1")}) == 3
    assert (seeded_plan(207).schedule_seed("1.5x #1") == seeded_plan(207).schedule_seed("1.5x #1")
            != seeded_plan(208).schedule_seed("1.5x #1"))
    drawn = seeded_plan(None), seeded_plan(None)  # without --seed: one base drawn per benchmark
    assert drawn[0].schedule_seed("1.5x #1") != drawn[1].schedule_seed("1.5x #1")


def test_the_benchmark_passes_each_systems_run_at_a_load_the_same_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import overload

    plan = seeded_plan(207, quick=True, no_mix=True)
    prompts: list[int | None] = []

    async def load(base: str, model: str, profile: object, seed: int | None = None, **kw: object) -> RunResult:
        prompts.append(kw.get("prompt_seed"))  # type: ignore[arg-type]
        return RunResult(constant(1.0, 1.0), [rec(0, 0.0, 1.0)], [], 0.0, seed)

    monkeypatch.setattr(overload, "run_load", load)
    got = [overload.run_profile("http://127.0.0.1:1", constant(1.0, 1.0), plan, name, schedule=sched).seed
           for name, sched in (("pinned0 @1.5x", "1.5x #1"), ("adaptive @1.5x", "1.5x #1"),
                               ("adaptive @1.5x #2", "1.5x #2"), ("step", None))]
    assert got[0] == got[1] == plan.schedule_seed("1.5x #1")
    assert got[2] != got[0] and got[3] not in (None, got[0], got[2])
    # but never the same prompts: the semantic cache (on at level 0) would answer the second run
    assert None not in prompts[:3] and len(set(prompts[:3])) == 3 and prompts[3] is None


def test_a_prompt_seed_changes_the_prompts_not_the_schedule() -> None:
    seen: dict[int, list[httpx.Request]] = {1: [], 2: []}
    times = []
    for prompt_seed in (1, 2):
        result = asyncio.run(run_load("http://127.0.0.1:9", "m", constant(20.0, 0.5), seed=5, prompt_seed=prompt_seed,
                                      max_tokens=4, poll_levels_s=None,
                                      transport=httpx.MockTransport(sse_handler(seen[prompt_seed]))))
        assert result.seed == 5
        times.append([r.scheduled_s for r in result.records])
    assert times[0] == times[1]  # the same schedule
    one, two = ([r for r in seen[k] if r.url.path == "/v1/chat/completions"] for k in (1, 2))
    assert len(one) == len(two) > 3
    bodies = [[json.loads(r.content)["messages"] for r in reqs] for reqs in (one, two)]
    assert all(a != b for a, b in zip(*bodies))


def test_warm_up_reports_what_the_requests_not_answered_200_got(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from bench import overload

    plan = overload.Plan(argparse.Namespace(quick=True, slo_ms=2000.0, run_s=None, drain_s=None, bisect=None,
                                            max_tokens=16, mix=None, no_mix=True, seed=None, no_progress=True,
                                            only=None))
    burst = [rec(0, 0.0, 1.0), rec(1, 0.5, 1.5), rec(2, 1.0, 1.01, status=503), rec(3, 1.5, None, status=None)]
    calls: list[int | None] = []

    def load(base: str, profile: object, plan_: object, label: str, **kw: object) -> RunResult:
        calls.append(kw.get("max_requests"))  # type: ignore[arg-type]
        records = burst if kw.get("max_requests") is None else [rec(0, 0.0, 1.2, first=0.4)]
        return RunResult(constant(1.0, 1.0), records, [], 0.0, 1)

    monkeypatch.setattr(overload, "run_profile", load)
    monkeypatch.setattr(overload, "wait_idle", lambda base, brownout: None)
    doc = overload.warm_up("http://127.0.0.1:1", plan, True, "test")
    assert calls == [None] + [1] * overload.UNLOADED_N
    assert doc["warm_up_ok"] == 2 and doc["warm_up_requests"] == 4
    assert doc["warm_up_status"] == {"200": 2, "503": 1, "conn_error": 1}
    assert doc["unloaded_requests"] == doc["unloaded_ok"] == overload.UNLOADED_N
    assert doc["unloaded_e2e_ms_p50"] == 1200.0

    # once more at level 0 before the built-in app: pinned, idle, the same ten requests, no warm-up
    pins: list[int | None] = []
    calls.clear()
    monkeypatch.setattr(overload, "pin_level", lambda base, level: pins.append(level))
    monkeypatch.setattr(overload, "wait_idle", lambda base, brownout, timeout_s=30: None)
    last = overload.one_at_a_time_last("http://127.0.0.1:1", plan)
    assert pins == [0] and calls == [1] * overload.UNLOADED_N
    assert last == {"unloaded_e2e_ms_p50": 1200.0, "unloaded_ttft_ms_p50": 400.0,
                    "unloaded_requests": overload.UNLOADED_N, "unloaded_ok": overload.UNLOADED_N}


# -- a noisy neighbour (bench/overload.py --neighbour) ------------------------------------------

@pytest.mark.parametrize("spec", ["10", "10,5", "-1,5", "1,5,0", "1,5,1.5", "a,b", "1,2,3,4"])
def test_a_bad_neighbour_is_refused_with_the_flag_named(spec: str) -> None:
    from bench import overload

    with pytest.raises(SystemExit, match="--neighbour"):
        overload.Neighbour(spec)
    with pytest.raises(SystemExit, match="--neighbour"):  # from the command line, before any run
        overload.main(["--url", "http://127.0.0.1:9", f"--neighbour={spec}"])


def test_a_neighbour_without_a_running_server_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import overload

    with pytest.raises(SystemExit):
        overload.main(["--neighbour", "20,50"])  # the comparison deploys its own apps: not beside them
    assert "--neighbour 20,50: needs --url" in capsys.readouterr().err


def test_a_neighbour_runs_its_processes_for_its_phase_and_reports_what_came_after() -> None:
    import os
    import time

    from bench import overload

    n = overload.Neighbour("0.1,0.6,2")
    assert (n.from_s, n.to_s, n.procs) == (0.1, 0.6, 2) and overload.Neighbour("1,2").procs == (os.cpu_count() or 1)
    n.start()
    n.stop()  # ended early: no process left behind, and the phase says when it ended
    n = overload.Neighbour("0,0.3,2")
    n.start()
    time.sleep(0.8)
    n.stop()
    assert len(n.ran) == 2 and n.ran[0] < 0.3 <= n.ran[1] < 0.8
    records = [rec(0, 0.1, 3.0, crit="critical"), rec(1, 0.4, 0.9, crit="critical"), rec(2, 0.5, 3.0, crit="standard"),
               rec(3, 0.6, 0.7, status=429, crit="standard")]
    doc = n.report(records, 2000.0)
    assert doc["after"]["requests"] == 3 and doc["after"]["good"] == 1  # sent from 0.3 s: one served within 2 s
    assert doc["after_by_class"]["critical"]["good_ratio"] == 1.0 and doc["after_by_class"]["standard"]["good"] == 0


SINGLE = ["--url", "http://127.0.0.1:9", "--profile", "fixed", "--rate", "1", "--run-s", "1", "--no-progress"]


def offline_single(monkeypatch: pytest.MonkeyPatch, records: list[Any], admin_status: int) -> Any:
    """`overload.main` with ``--url`` and nothing on the network: the run's records given, the
    admin API answering ``admin_status`` (200: a Brownout), no figure drawn."""
    from bench import overload

    monkeypatch.setattr(overload, "wait_healthy", lambda *a, **kw: None)
    monkeypatch.setattr(overload.httpx, "get", lambda *a, **kw: httpx.Response(admin_status))
    monkeypatch.setattr(overload, "run_profile",
                        lambda *a, **kw: RunResult(constant(1.0, 1.0), records, [{"t_s": 0.5, "level": 0}], 0.0, 1))
    monkeypatch.setattr(overload, "wait_idle", lambda base, brownout: None)
    monkeypatch.setattr(overload.rep, "plot_runs", lambda *a, **kw: None)
    return overload


def test_raw_records_are_written_against_a_running_server_too(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """``--raw`` with ``--url``: every request record of the run as JSON lines, as in the
    comparison (it was written only there)."""
    overload = offline_single(monkeypatch, [rec(0, 0.0, 1.0), rec(1, 0.5, 1.1, status=429, crit="sheddable")], 404)
    raw = tmp_path / "raw.jsonl"
    assert overload.main([*SINGLE, "--out-dir", str(tmp_path), "--name", "x", "--raw", str(raw)]) == 0
    (line,) = raw.read_text().splitlines()
    doc = json.loads(line)
    assert doc["name"] == "fixed" and doc["levels"] == [{"t_s": 0.5, "level": 0}]
    assert [r["status"] for r in doc["records"]] == [200, 429]
    assert json.loads((tmp_path / "x.json").read_text())["runs"][0]["overall"]["requests"] == 2


def test_a_run_against_a_running_brownout_records_the_policy_transitions(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """With ``--url`` at a Brownout (its admin API answers), the run keeps the level changes and
    the signal that caused each, as the comparison's adaptive runs do; at another server, none."""
    seen: list[tuple[str, float, float]] = []

    def history(base: str, wall0: float, origin: float) -> list[dict[str, Any]]:
        seen.append((base, wall0, origin))
        return [{"t_s": 1.5, "from": 0, "to": 2, "kind": "trigger", "signal": "refused_ratio"}]

    for status, expected in ((200, [{"t_s": 1.5, "from": 0, "to": 2, "kind": "trigger", "signal": "refused_ratio"}]),
                             (404, None)):
        overload = offline_single(monkeypatch, [rec(0, 0.0, 1.0)], status)
        monkeypatch.setattr(overload, "transitions_since", history)
        assert overload.main([*SINGLE, "--out-dir", str(tmp_path), "--name", f"s{status}"]) == 0
        run_doc = json.loads((tmp_path / f"s{status}.json").read_text())["runs"][0]
        assert run_doc.get("transitions") == expected
    assert [base for base, _, _ in seen] == ["http://127.0.0.1:9"]


def test_onset_shares_split_the_engines_cpus_between_the_engine_and_the_rest() -> None:
    from bench.onset import CpuSample, shares

    prev = CpuSample(t=10.0, engine_on_s=100.0, engine_wait_s=5.0, cpus_busy_s=120.0)
    now = CpuSample(t=10.5, engine_on_s=100.45, engine_wait_s=5.05, cpus_busy_s=120.49)
    assert shares(prev, now) == {"engine_cores": 0.9, "engine_runq_wait_s_per_s": 0.1, "others_cores": 0.08}
    # the engine's own counter may run ahead of the CPU's ticks: others never below 0
    ahead = CpuSample(t=11.0, engine_on_s=100.95, engine_wait_s=5.05, cpus_busy_s=120.9)
    assert shares(now, ahead)["others_cores"] == 0.0
    with pytest.raises(ValueError, match="out of order"):
        shares(now, prev)


def test_onset_summary_splits_the_onset_from_the_rest() -> None:
    from bench.onset import summary

    polls = [{"t_s": 0.5, "engine_slowdown": 1.0}, {"t_s": 1.1, "engine_slowdown": 2.4},
             {"t_s": 3.2, "engine_slowdown": 0.9}, {"t_s": 5.0, "engine_slowdown": 1.1}]
    cpu = [{"t_s": 1.0, "engine_cores": 0.9, "engine_runq_wait_s_per_s": 0.1, "others_cores": 0.1},
           {"t_s": 2.0, "engine_cores": 0.7, "engine_runq_wait_s_per_s": 0.3, "others_cores": 0.3},
           {"t_s": 4.0, "engine_cores": 0.95, "engine_runq_wait_s_per_s": 0.05, "others_cores": 0.0}]
    s = summary(polls, cpu, 3.0)
    assert s["first_3_s"] == {"max_reading": 2.4, "min_reading": 1.0, "engine_cores": 0.8,
                              "engine_runq_wait_s_per_s": 0.2, "others_cores": 0.2}
    assert s["after"] == {"max_reading": 1.1, "min_reading": 0.9, "engine_cores": 0.95,
                          "engine_runq_wait_s_per_s": 0.05, "others_cores": 0.0}
    assert summary([], [], 3.0)["after"]["max_reading"] is None


def test_onset_refuses_an_unknown_mode_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.onset import main

    with pytest.raises(SystemExit):
        main(["--rate", "5", "--onsets", "auto,pin9"])
    assert "--onsets 'auto,pin9'" in capsys.readouterr().err


# -- bench/stream_shaping.py: the pure parts --------------------------------------------------------

def test_stream_shaping_arms_differ_only_in_the_stream_interval() -> None:
    from bench import stream_shaping as ss
    from policies.config import load_policy

    shipped = {"degradation": load_policy(ss.ROOT / "configs" / "degradation.yaml").model_dump(mode="json", exclude_none=True)}
    plain = ss.without_stream_interval(shipped)
    assert ss.expected_header(shipped) == "stream_interval=1->8" and ss.expected_header(plain) is None
    assert ss.expected_header(shipped, level=2) == "stream_interval=1->4"
    assert plain["degradation"]["level3"]["shape"] == {"max_tokens": 64, "refuse": ["n", "logprobs"]}
    assert shipped["degradation"]["level3"]["shape"]["stream_interval"] == 8  # the input is not changed
    plain["degradation"]["level2"]["shape"]["stream_interval"] = 4
    plain["degradation"]["level3"]["shape"]["stream_interval"] = 8
    assert plain == shipped


def test_stream_shaping_counts_cpu_per_kind_and_per_request() -> None:
    from bench import stream_shaping as ss

    assert [ss.kind_of(c) for c in ("ray::ProxyActor", "ray::ServeReplica:brownout:Ingress",
                                    "ray::ServeReplica:brownout:VLLMModel", "VLLM::EngineCore", "raylet")] == [
        "proxy", "ingress", "model replica", "engine core", "other"]
    before = {1: ("proxy", 1.0), 2: ("ingress", 2.0), 3: ("other", 0.5)}
    after = {1: ("proxy", 1.5), 2: ("ingress", 3.0), 3: ("other", 0.75), 4: ("other", 9.0)}  # 4: new, left out
    used = ss.cpu_used(before, after)
    assert used == {"ingress": 1.0, "other": 0.25, "proxy": 0.5}
    assert ss.per_request_ms(used, 100) == {"ingress": 10.0, "other": 2.5, "proxy": 5.0, "all": 17.5}
    assert ss.per_request_ms(used, 0)["all"] is None


def test_stream_shaping_summary_is_the_median_per_arm_and_the_ratio() -> None:
    from bench import stream_shaping as ss

    def run(arm: str, repeat: int, p50: float, cpu: float) -> dict:
        return {"arm": arm, "rate_rps": 12.0, "repeat": repeat, "throughput_rps": 12.0,
                "e2e_ms": {"p50": p50, "p99": 2 * p50}, "ttft_ms": {"p50": 100.0, "p99": 200.0},
                "cpu_ms_per_request": {"ingress": cpu, "all": 4 * cpu}}

    runs = [run("increments", 1, 600, 10), run("token by token", 1, 800, 16),
            run("token by token", 2, 700, 14), run("increments", 2, 500, 8)]
    row = ss.summarise(runs)["12 req/s"]
    assert row["increments"]["e2e p50 ms"] == 550 and row["token by token"]["e2e p50 ms"] == 750
    ratio = row["increments / token by token"]
    assert ratio["e2e p50 ms"] == round(550 / 750, 3) and ratio["ttft p50 ms"] == 1.0
    assert ratio["cpu ms per request"] == {"all": 0.6, "ingress": 0.6}
    assert ss.parse_rates("12, 15") == [12.0, 15.0]
    with pytest.raises(SystemExit, match="--rates 'a'"):
        ss.parse_rates("a")
    with pytest.raises(SystemExit, match="must be > 0"):
        ss.parse_rates("12,0")


# -- bench/overhead.py: the pure parts ---------------------------------------------------------------

def test_overhead_rounds_rotate_who_goes_first() -> None:
    from bench import overhead as oh

    orders = [oh.rotation(i) for i in range(4)]
    assert [o[0] for o in orders] == ["builtin", "core", "full", "builtin"]
    assert all(sorted(o) == sorted(oh.APPS) for o in orders)


def test_overhead_summary_gives_both_ratios_and_judges_both_paths() -> None:
    from bench import overhead as oh

    def samples(ms: list[float], ttft: float | None = 10.0) -> list[Any]:
        return [oh.Sample(m, ttft, 16) for m in ms]

    builtin = [500.0, 520.0, 480.0, 510.0]  # median 505
    doc = oh.summarise({"builtin": samples(builtin), "core": samples([450.0, 470.0, 440.0, 460.0]),
                        "full": samples([550.0, 560.0, 540.0, 600.0])})
    assert doc["median_ms"] == {"builtin": 505.0, "core": 455.0, "full": 555.0}
    assert doc["ratio_core_over_builtin"] == pytest.approx(455 / 505, abs=1e-4)
    assert doc["ratio_full_over_builtin"] == pytest.approx(555 / 505, abs=1e-4)  # 1.099: within
    rounds = sorted(f / b for f, b in zip([550.0, 560.0, 540.0, 600.0], builtin, strict=True))
    assert doc["median_round_ratio_full_over_builtin"] == pytest.approx((rounds[1] + rounds[2]) / 2, abs=1e-4)
    assert doc["ttft_median_ms"] == {"builtin": 10.0, "core": 10.0, "full": 10.0}
    assert doc["meets_target"] is True
    # one path past the target fails it, whichever it is; whole answers have no TTFT
    slow = oh.summarise({"builtin": samples(builtin, None), "core": samples([450.0] * 4, None),
                         "full": samples([560.0] * 4, None)})
    assert slow["ratio_full_over_builtin"] > 1.10 and slow["meets_target"] is False
    assert "ttft_median_ms" not in slow
