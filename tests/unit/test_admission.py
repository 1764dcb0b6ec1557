"""Deadline-aware admission: table tests with explicit times, and hypothesis invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.admission import (
    CRITICALITY_HEADER,
    AdmissionController,
    Criticality,
    RateEstimator,
    classify,
    default_prior_rate,
    queue_caps,
    should_drop,
)
from policies.config import AdmissionConfig, SloConfig, parse_policy

C, S, D = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE

# Clear numbers: e2e 2100 ms - overhead 100 ms = a 2 s budget; 10 completions/s.
# Little's law: at most 10 * 2 = 20 in flight; caps critical 20, standard 16, sheddable 12.
SLO = SloConfig(e2e_p99_ms=2100)
SETTINGS = AdmissionConfig(overhead_ms=100, prior_rate_per_s=10, min_retry_after_s=1, max_retry_after_s=30)


def controller(slo: SloConfig = SLO, settings_: AdmissionConfig = SETTINGS, slots: int = 8) -> AdmissionController:
    return AdmissionController(slo, settings_, slots)


def test_caps_are_littles_law_times_the_class_share() -> None:
    ctl = controller()
    assert ctl.budget_s == pytest.approx(2.0)
    assert [ctl.max_admitted(k) for k in (C, S, D)] == [20, 16, 12]


@pytest.mark.parametrize(
    "name, klass, ahead, expected",
    [
        ("empty queue admits critical", C, 0, (True, "admitted", 200)),
        ("empty queue admits sheddable", D, 0, (True, "admitted", 200)),
        ("sheddable fits below its cap", D, 11, (True, "admitted", 200)),
        ("sheddable over its share: 429", D, 12, (False, "class_share_exhausted", 429)),
        ("standard still fits where sheddable does not", S, 12, (True, "admitted", 200)),
        ("standard over its share: 429", S, 16, (False, "class_share_exhausted", 429)),
        ("critical fits while any room remains", C, 19, (True, "admitted", 200)),
        ("predicted e2e over the whole budget: critical refused, 503", C, 20, (False, "saturated", 503)),
        ("when critical is refused everyone gets 503", D, 20, (False, "saturated", 503)),
        ("far over budget", S, 500, (False, "saturated", 503)),
    ],
)
def test_decide_table(name: str, klass: Criticality, ahead: int, expected: tuple) -> None:
    d = controller().decide(klass, ahead, now=100.0)
    assert (d.admitted, d.reason, d.status) == expected, name
    assert d.predicted_e2e_s == pytest.approx(0.1 + (ahead + 1) / 10)
    if d.admitted:
        assert d.retry_after_s is None and d.deadline_at == pytest.approx(102.1)
    else:
        assert isinstance(d.retry_after_s, int) and d.retry_after_s >= 1 and d.deadline_at is None


def test_predicted_wait_over_budget_refuses_and_within_admits() -> None:
    ctl = controller()
    # admitted exactly while overhead + (ahead + 1) / rate fits the class's share of the budget
    for klass, share in ((C, 1.0), (S, 0.8), (D, 0.6)):
        for ahead in range(0, 40):
            fits = 0.1 + (ahead + 1) / 10 <= 0.1 + share * 2.0 + 1e-9
            assert ctl.decide(klass, ahead, 0.0).admitted == (fits or ahead == 0), (klass, ahead)


def test_larger_budget_admitted_where_smaller_refused() -> None:
    ctl = controller()
    at = 14  # over sheddable's 12, under standard's 16
    assert not ctl.decide(D, at, 0.0).admitted
    assert ctl.decide(S, at, 0.0).admitted and ctl.decide(C, at, 0.0).admitted


def test_empty_queue_admits_even_when_one_request_cannot_meet_the_slo() -> None:
    slow = AdmissionConfig(overhead_ms=100, prior_rate_per_s=0.1)  # 10 s per request
    ctl = controller(settings_=slow)
    assert [ctl.max_admitted(k) for k in (C, S, D)] == [1, 1, 1]
    assert ctl.decide(D, 0, 0.0).admitted
    assert ctl.decide(C, 1, 0.0).status == 503


@pytest.mark.parametrize(
    "klass, ahead, expected_s",
    [
        (D, 12, 1),  # one completion (0.1 s) frees room: rounded up to the 1 s floor
        (D, 31, 2),  # (31 + 1 - 12) / 10 = 2.0 s
        (D, 52, 5),  # 4.1 s -> 5
        (C, 50, 4),  # (51 - 20) / 10 = 3.1 -> 4
        (S, 10_000, 30),  # clamped to max_retry_after_s
    ],
)
def test_retry_after_is_the_drain_time_to_the_class_cap(klass: Criticality, ahead: int, expected_s: int) -> None:
    assert controller().decide(klass, ahead, 0.0).retry_after_s == expected_s


def test_retry_after_grows_with_the_backlog() -> None:
    ctl = controller()
    values = [ctl.decide(S, ahead, 0.0).retry_after_s for ahead in range(16, 400, 7)]
    assert values == sorted(values)
    assert values[0] == 1 and values[-1] == 30 and len(set(values)) > 10


@pytest.mark.parametrize(
    "base, header, expected",
    [
        (C, None, C),
        (C, "", C),
        (C, "standard", S),
        (C, " Sheddable ", D),
        (S, "sheddable", D),
        (S, "critical", S),  # never raised
        (D, "critical", D),
        (D, "standard", D),
        ("standard", "standard", S),
    ],
)
def test_header_lowers_but_never_raises_the_class(base, header, expected) -> None:  # type: ignore[no-untyped-def]
    assert classify(base, header) is expected


def test_unknown_header_value_names_it_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"X-Brownout-Criticality: unknown class 'urgent'; "
                                         r"valid: critical, standard, sheddable"):
        classify(S, "urgent")
    assert CRITICALITY_HEADER == "X-Brownout-Criticality"


@pytest.mark.parametrize(
    "deadline_at, now, min_service_s, drop",
    [
        (10.0, 9.0, 0.0, False),  # still time
        (10.0, 10.0, 0.0, False),  # exactly at the deadline: it may still just make it
        (10.0, 10.5, 0.0, True),  # waited past its deadline: drop, don't compute
        (10.0, 9.5, 1.0, True),  # cannot finish in the least time the engine needs
        (10.0, 8.5, 1.0, False),
        (None, 1e9, 0.0, False),  # admission off: no deadline, never dropped
    ],
)
def test_stale_deadline_drop(deadline_at, now, min_service_s, drop) -> None:  # type: ignore[no-untyped-def]
    assert should_drop(deadline_at, now, min_service_s) is drop


def test_admitted_request_deadline_is_the_slo_from_admission() -> None:
    d = controller().decide(S, 3, now=50.0)
    assert not should_drop(d.deadline_at, 52.0)
    assert should_drop(d.deadline_at, 52.2)


# -- the rate estimator --------------------------------------------------------------------------


def feed(est: RateEstimator, rate: float, seconds: float, in_flight: int, busy_at: int, t0: float = 0.0) -> float:
    """Completions evenly spaced at ``rate`` per second for ``seconds``; returns the end time."""
    n = int(rate * seconds)
    for i in range(1, n + 1):
        est.observe(t0 + i / rate, in_flight, busy_at)
    return t0 + n / rate


@pytest.mark.parametrize("prior, true_rate", [(50.0, 8.0), (2.0, 8.0), (8.0, 8.0), (1.0, 120.0)])
def test_rate_estimator_converges_from_any_prior_on_busy_windows(prior: float, true_rate: float) -> None:
    est = RateEstimator(prior, window_s=1.0, alpha=0.3)
    feed(est, true_rate, seconds=20, in_flight=10, busy_at=8)
    assert est.rate_per_s == pytest.approx(true_rate, rel=0.02)


def test_rate_estimator_idle_windows_only_raise_it() -> None:
    est = RateEstimator(10.0, window_s=1.0, alpha=0.5)
    end = feed(est, 2.0, seconds=10, in_flight=1, busy_at=8)  # demand-limited: says nothing
    assert est.rate_per_s == 10.0
    feed(est, 20.0, seconds=10, in_flight=2, busy_at=8, t0=end)  # even unsaturated, 20/s was done
    assert est.rate_per_s == pytest.approx(20.0, rel=0.02)


def test_rate_estimator_one_window_at_a_time() -> None:
    est = RateEstimator(10.0, window_s=1.0, alpha=0.5)
    assert est.observe(0.0, 9, 8) is False  # opens the first window
    assert est.observe(0.5, 9, 8) is False
    assert est.observe(1.0, 9, 8) is True  # 2 completions in 1 s: 10 + 0.5 * (2 - 10) = 6
    assert est.rate_per_s == pytest.approx(6.0)
    assert est.observe(1.5, 3, 8) is False  # not busy: this window is a lower bound only
    assert est.observe(2.0, 9, 8) is True  # sample 2/s < 6: not lowered
    assert est.rate_per_s == pytest.approx(6.0)


def test_rate_estimator_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"prior_rate_per_s > 0.*got 0"):
        RateEstimator(0)


def test_measured_rate_moves_the_caps() -> None:
    ctl = controller()  # prior 10/s: caps 20/16/12
    t = 0.0
    for _ in range(400):  # 20 completions/s with the admission limit full
        t += 0.05
        ctl.observe_completion(t, in_flight=20)
    assert ctl.rate_per_s == pytest.approx(20.0, rel=0.02)
    # the EWMA approaches 20 from below: the caps are just under 40/32/24
    assert [ctl.max_admitted(k) for k in (C, S, D)] in ([40, 32, 24], [39, 31, 23])
    assert ctl.decide(C, 30, t).admitted


def test_signals_for_the_policy_actor() -> None:
    ctl = controller(slots=8)
    assert ctl.signals(0) == {"predicted_wait_ms": 0.0, "model_queued": 0.0}  # idle: levels can recover
    assert ctl.signals(12) == {"predicted_wait_ms": 1200.0, "model_queued": 4.0}


# -- construction from the policy ----------------------------------------------------------------


def test_from_config() -> None:
    assert AdmissionController.from_config(parse_policy({}), 16) is None
    off = parse_policy({"slo": {"e2e_p99_ms": 2000}, "admission": {"enabled": False}})
    assert AdmissionController.from_config(off, 16) is None
    ctl = AdmissionController.from_config(parse_policy({"slo": {"e2e_p99_ms": 2000}}), 16)
    assert ctl is not None and ctl.slots == 16
    # default prior: a full batch of 16 in half the SLO -> 16 / 1 s
    assert ctl.rate_per_s == pytest.approx(default_prior_rate(SloConfig(e2e_p99_ms=2000), 16)) == 16.0
    half = AdmissionController.from_config(parse_policy({"slo": {"e2e_p99_ms": 2000}}), 16, share=0.5)
    assert half is not None and half.slots == 8


def test_queue_caps_keep_every_admitted_request_within_the_slo() -> None:
    caps = queue_caps(SLO, SETTINGS, max_num_seqs=8)
    assert caps == {"max_in_flight": 20, "max_waiting": 12}
    ctl = controller()
    assert ctl.predicted_e2e_s(caps["max_in_flight"] - 1) <= SLO.e2e_p99_ms / 1000 + 1e-9
    assert queue_caps(SLO, SETTINGS, max_num_seqs=8, rate_per_s=3) == {"max_in_flight": 6, "max_waiting": 0}


def test_overhead_must_leave_a_budget() -> None:
    with pytest.raises(ValueError, match=r"overhead_ms: 2100 leaves no budget within slo\.e2e_p99_ms: 2100"):
        AdmissionController(SLO, AdmissionConfig(overhead_ms=2100), 8)
    with pytest.raises(ValueError, match=r"slots must be >= 1"):
        AdmissionController(SLO, SETTINGS, 0)


# -- invariants ----------------------------------------------------------------------------------


@st.composite
def controllers(draw):  # type: ignore[no-untyped-def]
    crit = draw(st.floats(0.05, 1.0))
    std = draw(st.floats(0.05, 1.0)) * crit
    shed = draw(st.floats(0.05, 1.0)) * std
    e2e = draw(st.floats(200, 20_000))
    slo = SloConfig(e2e_p99_ms=e2e, class_share={"critical": crit, "standard": std, "sheddable": shed})
    lo = draw(st.integers(1, 10))
    settings_ = AdmissionConfig(
        overhead_ms=draw(st.floats(0, 0.5)) * e2e,
        prior_rate_per_s=draw(st.floats(0.05, 500)),
        min_retry_after_s=lo,
        max_retry_after_s=lo + draw(st.integers(0, 100)),
    )
    return AdmissionController(slo, settings_, draw(st.integers(1, 64)))


@settings(max_examples=500, deadline=None)
@given(ctl=controllers(), ahead=st.integers(0, 5000), now=st.floats(0, 1e6))
def test_admitting_a_class_admits_every_more_critical_class(ctl, ahead, now) -> None:  # type: ignore[no-untyped-def]
    decisions = [ctl.decide(k, ahead, now) for k in (C, S, D)]  # most critical first
    for more, less in zip(decisions, decisions[1:]):
        assert more.admitted or not less.admitted
    # 503 exactly when even critical is refused; 429 otherwise
    for d in decisions:
        if not d.admitted:
            assert d.status == (503 if not decisions[0].admitted else 429)
            assert ctl.settings.min_retry_after_s <= d.retry_after_s <= ctl.settings.max_retry_after_s


@settings(max_examples=500, deadline=None)
@given(ctl=controllers(), ahead=st.integers(0, 5000), klass=st.sampled_from(list(Criticality)))
def test_admitted_iff_below_the_cap_and_the_cap_meets_the_class_budget(ctl, ahead, klass) -> None:  # type: ignore[no-untyped-def]
    d = ctl.decide(klass, ahead, 0.0)
    cap = ctl.max_admitted(klass)
    assert d.admitted == (ahead < cap)
    assert ctl.decide(klass, 0, 0.0).admitted  # an empty queue always admits
    share = getattr(ctl.slo.class_share, klass.value)
    if cap > 1:  # the last request admitted under the cap finishes within its share of the budget
        assert ctl.predicted_e2e_s(cap - 1) <= ctl.overhead_s + share * ctl.budget_s + 1e-6


@settings(max_examples=300, deadline=None)
@given(ctl=controllers(), a=st.integers(0, 5000), b=st.integers(0, 5000), klass=st.sampled_from(list(Criticality)))
def test_retry_after_is_monotone_in_the_backlog(ctl, a, b, klass) -> None:  # type: ignore[no-untyped-def]
    lo, hi = sorted((a, b))
    r_lo, r_hi = ctl.decide(klass, lo, 0.0).retry_after_s, ctl.decide(klass, hi, 0.0).retry_after_s
    if r_lo is not None:
        assert r_hi is not None and r_hi >= r_lo


@settings(max_examples=200, deadline=None)
@given(base=st.sampled_from(list(Criticality)), header=st.sampled_from([None, "", *[c.value for c in Criticality]]))
def test_classify_never_raises_a_class(base, header) -> None:  # type: ignore[no-untyped-def]
    assert classify(base, header).rank >= base.rank


@settings(max_examples=200, deadline=None)
@given(prior=st.floats(0.1, 1000), true_rate=st.floats(1, 200))
def test_rate_estimator_converges(prior, true_rate) -> None:  # type: ignore[no-untyped-def]
    est = RateEstimator(prior, window_s=1.0, alpha=0.3)
    feed(est, true_rate, seconds=60, in_flight=64, busy_at=16)
    assert est.rate_per_s == pytest.approx(true_rate, rel=0.05)


def test_update_keeps_the_measured_rate() -> None:
    ctl = controller()
    t = 0.0
    for _ in range(400):
        t += 0.05
        ctl.observe_completion(t, in_flight=20)
    measured = ctl.rate_per_s
    tighter = SloConfig(e2e_p99_ms=1100)  # budget 1 s: caps halve, the rate stays
    ctl.update(tighter, SETTINGS)
    assert ctl.rate_per_s == measured and ctl.budget_s == pytest.approx(1.0)
    assert ctl.max_admitted(C) == int(measured * 1.0)


def test_classes_map_to_vllm_priority_critical_first() -> None:
    assert [k.vllm_priority for k in (C, S, D)] == [0, 1, 2]


def test_capacity_drop_is_seen_under_standard_load_alone() -> None:
    """Standard work fills its own cap (16 here), never critical's (20): those windows still
    measure capacity, so a slower model (5/s instead of 10/s) lowers the caps."""
    ctl = controller(slots=32)
    t = 0.0
    for _ in range(200):  # 5 completions/s with 13 still in flight: past sheddable's cap of 12
        t += 0.2
        ctl.observe_completion(t, in_flight=13)
    assert ctl.rate_per_s == pytest.approx(5.0, rel=0.05)
    assert [ctl.max_admitted(k) for k in (C, S, D)] in ([10, 8, 6], [9, 7, 5], [10, 8, 5])


def test_light_load_below_every_cap_does_not_lower_the_rate() -> None:
    ctl = controller(slots=32)
    t = 0.0
    for _ in range(100):  # 2 completions/s, 3 in flight: demand-limited
        t += 0.5
        ctl.observe_completion(t, in_flight=3)
    assert ctl.rate_per_s == 10


@pytest.mark.parametrize(("latency_s", "ahead", "rate_after"), [
    (1.5, 9, 10.0),   # within the 2 s budget: no evidence against the rate
    (4.0, 9, 2.5),    # 10 requests (9 ahead + itself) in 4 s: 2.5/s at best
    (20.0, 23, 1.2),  # a machine far slower than the prior: one completion corrects it
    (4.0, 99, 10.0),  # slow, but with 100 in front it was served faster than the estimate
])
def test_a_completion_past_the_budget_caps_the_rate_at_once(latency_s: float, ahead: int, rate_after: float) -> None:
    ctl = controller()  # 10/s prior, 2 s budget
    ctl.observe_completion(100.0, in_flight=0, latency_s=latency_s, ahead_at_admission=ahead)
    assert ctl.rate_per_s == pytest.approx(rate_after)
    assert ctl.max_admitted(C) == max(1, int(rate_after * 2.0 + 1e-9))


def test_update_with_a_new_explicit_prior_restarts_the_estimate() -> None:
    ctl = controller()
    ctl.observe_completion(1.0, in_flight=0, latency_s=10.0, ahead_at_admission=0)  # 0.1/s
    ctl.update(SLO, SETTINGS)  # same prior: the measured rate stays
    assert ctl.rate_per_s == pytest.approx(0.1)
    ctl.update(SLO, SETTINGS.model_copy(update={"prior_rate_per_s": 4.0}))
    assert ctl.rate_per_s == 4.0 and ctl.max_admitted(C) == 8
