"""Deadline-aware admission: table tests with explicit times, and hypothesis invariants."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.admission import (
    CRITICALITY_HEADER,
    AdmissionController,
    Criticality,
    RefusalWindow,
    ServiceModel,
    ShareClock,
    SlowedModel,
    SpeedClock,
    TAIL_MIN,
    classify,
    default_prior_rate,
    queue_caps,
    should_drop,
)
from bench.door_sim import engine_latency
from policies.config import AdmissionConfig, SloConfig, parse_policy

C, S, D = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE

# Clear numbers: e2e 2100 ms - overhead 100 ms = a 2 s budget; 10 completions/s.
# Little's law: at most 10 * 2 = 20 in flight; caps critical 20, standard 16, sheddable 12.
# Three distinct shares, so that each class's cap shows in the tables (the default is 1.0 / 0.9 / 0.9).
SPREAD = {"critical": 1.0, "standard": 0.8, "sheddable": 0.6}
SLO = SloConfig(e2e_p99_ms=2100, class_share=SPREAD)
# The share tables below hold with no room reserved for more critical classes (reserve_quantile 0);
# the reservation has its own tests (RESERVING).
SETTINGS = AdmissionConfig(overhead_ms=100, prior_rate_per_s=10, min_retry_after_s=1, max_retry_after_s=30,
                           reserve_quantile=0.0)
# Without the ramp (`AdmissionController.ramp_limit`, its own tests: RAMPING), which with nothing
# served yet holds the classes below critical to 4 in flight while critical work arrives.
RESERVING = SETTINGS.model_copy(update={"reserve_quantile": 0.99, "reserve_window_s": 10.0, "ramp_step": 0})
RAMPING = RESERVING.model_copy(update={"ramp_step": 3})


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
        assert d.retry_after_s is None and d.deadline_at == pytest.approx(102.1) and d.limited_by is None
    else:
        assert isinstance(d.retry_after_s, int) and d.retry_after_s >= 1 and d.deadline_at is None
        # without a reservation a 429 comes from the class's own share of the budget
        assert d.limited_by == {429: "share", 503: "saturated"}[d.status], name


def test_predicted_wait_over_budget_refuses_and_within_admits() -> None:
    # admitted exactly while overhead + (ahead + 1) / rate fits the class's share of the budget
    for klass, share in ((C, 1.0), (S, 0.8), (D, 0.6)):
        ctl = controller()  # each class alone: 40 decisions at one instant are a burst of its own demand
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


# -- the service model ---------------------------------------------------------------------------


def test_share_clock_gives_each_request_its_share_of_the_server() -> None:
    clock = ShareClock()
    a = clock.mark(0.0, 1)  # A admitted alone
    b = clock.mark(1.0, 2)  # B joins after 1 s: from now on they share
    a_end = clock.mark(3.0, 1)  # A done: 1 s alone + 2 s shared = 2 s of service
    b_end = clock.mark(4.0, 0)  # B done: 2 s shared + 1 s alone = 2 s of service
    assert (a_end - a, b_end - b) == (pytest.approx(2.0), pytest.approx(2.0))
    assert clock.mark(10.0, 1) == pytest.approx(b_end)  # idle time is nobody's service


def served_at(model: ServiceModel | AdmissionController, n: int, base: float, per: float, seconds: float,
              t0: float = 0.0) -> float:
    """Completions of requests that each shared the server with ``n`` (themselves included) on a
    server whose true latency line is ``base + per * (n - 1)``, one every ``per`` seconds
    (saturation) or every latency (alone); returns the end time."""
    latency = base + per * (n - 1)
    gap = latency if n == 1 else per
    t = t0
    while t < t0 + seconds:
        t += gap
        if isinstance(model, ServiceModel):
            model.observe(t, latency, latency / n)
        else:
            model.observe_completion(t, latency, latency / n)
    return t


@pytest.mark.parametrize("prior_rate", [50.0, 2.0, 0.3])
def test_service_model_learns_the_line_from_any_prior(prior_rate: float) -> None:
    model = ServiceModel.from_rate(prior_rate)  # an operator's rate: moved window by window
    end = served_at(model, 1, base=1.5, per=0.8, seconds=120)  # light load: the unloaded latency
    assert model.base_s == pytest.approx(1.5)
    served_at(model, 4, base=1.5, per=0.8, seconds=60, t0=end)  # loaded: the slope
    assert model.per_request_s == pytest.approx(0.8, rel=0.02)
    assert model.latency_s(4) == pytest.approx(1.5 + 3 * 0.8, rel=0.02)


def test_service_model_a_guess_gives_way_to_the_first_measurement_then_windows() -> None:
    model = ServiceModel(1.0, 0.1, window_s=1.0, alpha=0.5)  # a built-in guess
    assert model.observe(0.0, 3.0, 1.0) is True  # shared with 3: the guess's line moves through (2, 3.0)
    # one point says nothing of the slope: it stays, the line passes through the point
    assert (model.base_s, model.per_request_s) == (pytest.approx(2.8), 0.1)
    assert model.observe(1.0, 5.0, 1.0) is False  # measured now: a 1 s window opens
    assert model.observe(2.0, 2.0, 2.0) is True  # alone, and closes the window
    # points (2, 3) faded to 0.5, (4, 5) and (0, 2): least squares with the ridge towards 0.1
    n, sx, sy, sxx, sxy = 2.5, 5.0, 8.5, 18.0, 23.0
    cxx, cxy = sxx - sx * sx / n, sxy - sx * sy / n
    slope = (cxy + ServiceModel.RIDGE * 0.1) / (cxx + ServiceModel.RIDGE)
    assert model.per_request_s == pytest.approx(slope) and model.base_s == pytest.approx(sy / n - slope * sx / n)
    assert model.observe(3.0, 3.0, 3.0) is False
    assert model.observe(3.5, 3.0, 3.0) is False
    assert model.observe(4.0, 3.0, 3.0) is True  # windows of 1 s from now on


def test_an_operator_rate_is_moved_by_windows_not_replaced() -> None:
    model = ServiceModel.from_rate(10.0, window_s=1.0, alpha=0.5)  # one point (0, 0.1)
    assert model.observe(0.0, 3.0, 1.0) is False  # opens the window
    assert model.observe(1.0, 3.0, 1.0) is True
    # the prior's point, faded to 0.5, still pulls the line: it is not replaced by (2, 3.0)
    assert 0.1 < model.base_s < 2.0 and 0.1 < model.per_request_s < 1.45
    assert model.latency_s(3) == pytest.approx(model.base_s + 2 * model.per_request_s)


def test_service_model_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"prior_rate_per_s > 0, got 0"):
        ServiceModel.from_rate(0)
    with pytest.raises(ValueError, match=r"need base_s > 0"):
        ServiceModel(0, 1)
    with pytest.raises(ValueError, match=r"need slots >= 1"):
        ServiceModel(1, 1, slots=0)


@pytest.mark.parametrize("n, latency", [
    (1, 1.0), (0, 1.0),  # alone: the intercept
    (5, 1.2),  # within the batch: the line, 1 + 0.05 * 4
    (8, 1.35),  # the full batch
    (16, 2.7),  # past it: a slot frees every 1.35 / 8 s, Little's law: 1.35 * 16 / 8
    (12, 2.025),
])
def test_latency_is_a_line_within_the_batch_and_queueing_past_it(n: int, latency: float) -> None:
    model = ServiceModel(1.0, 0.05, slots=8)
    assert model.latency_s(n) == pytest.approx(latency)
    assert model.rate_per_s == pytest.approx(8 / 1.35)  # saturation: a full batch's rate
    assert ServiceModel(1.0, 0.05).latency_s(16) == pytest.approx(1.75)  # no batch bound: the line


@pytest.mark.parametrize("limit_s, n", [
    (0.5, 1),  # not even one fits: at least 1
    (1.0, 1),
    (1.2, 5),  # within the batch
    (1.35, 8),
    (2.0, 11),  # past it: 1.35 * 11 / 8 = 1.86 <= 2.0 < 1.35 * 12 / 8
    (2.7, 16),
])
def test_max_within_is_the_most_in_flight_whose_latency_fits(limit_s: float, n: int) -> None:
    model = ServiceModel(1.0, 0.05, slots=8)
    assert model.max_within(limit_s) == n
    assert model.latency_s(n) <= limit_s + 1e-9 or n == 1
    assert model.latency_s(n + 1) > limit_s


def test_measured_model_moves_the_caps_both_ways() -> None:
    ctl = controller()  # prior 10/s: caps 20/16/12
    served_at(ctl, 4, base=0.5, per=0.25, seconds=15)
    end = served_at(ctl, 6, base=0.5, per=0.25, seconds=15, t0=15.0)
    served_at(ctl, 5, base=0.5, per=0.25, seconds=15, t0=end)
    # admitted iff 0.5 + 0.25 * ahead <= share * 2 (within the batch of 8): critical ahead <= 6,
    # standard 4, sheddable 2, to within rounding
    caps = [ctl.max_admitted(k) for k in (C, S, D)]
    assert caps in ([7, 5, 3], [6, 5, 3], [7, 4, 3], [6, 4, 2])
    assert ctl.model.per_request_s == pytest.approx(0.25, rel=0.05)
    assert ctl.rate_per_s == pytest.approx(8 / (0.5 + 0.25 * 7), rel=0.05)
    # a faster model: caps grow (at 6 in flight, 0.43 of the line: read as a faster machine, the
    # whole line scaled by it, `ServiceModel.shift`; the slope alone fell, which points at one
    # concurrency cannot tell)
    served_at(ctl, 6, base=0.5, per=0.05, seconds=20, t0=100.0)
    assert ctl.max_admitted(C) >= 2 * caps[0]


def test_the_fit_is_least_squares_so_barely_shared_requests_weigh_little() -> None:
    model = ServiceModel(1.5, 0.6, window_s=1.0, alpha=1.0, trusted=True)
    model.observe(0.0, 1.5 + 0.6 * 3, (1.5 + 0.6 * 3) / 4)  # shared with 4: on the line
    model.observe(0.5, 1.5 + 0.6 * 3, (1.5 + 0.6 * 3) / 4)
    model.observe(1.0, 1.5 + 0.6 * 0.5, (1.5 + 0.6 * 0.5) / 1.5)  # shared with 1.5: on the line
    model.observe(1.5, 1.5 + 0.6 * 0.5, (1.5 + 0.6 * 0.5) / 1.5)
    model.observe(2.0, 2.7, 2.7 / 1.5)  # shared with 1.5 and 0.9 s slow: its own slope is 2.4
    # one slow request among five moves the fitted line, not to its own slope (a mean of the
    # points' slopes would say (0.6 * 4 + 2.4) / 5 = 0.96)
    assert 0.4 < model.per_request_s < 0.7
    assert model.latency_s(4) == pytest.approx(1.5 + 0.6 * 3, abs=0.2)


def test_light_load_does_not_hide_the_capacity_at_full_load() -> None:
    """The old windowed rate measured demand at light load; one request at a time only moves the
    line through its point, the slope measured under load stays."""
    ctl = controller()
    end = served_at(ctl, 3, base=0.5, per=0.25, seconds=10)
    end = served_at(ctl, 7, base=0.5, per=0.25, seconds=10, t0=end)
    assert ctl.model.per_request_s == pytest.approx(0.25, rel=0.01)
    caps = [ctl.max_admitted(k) for k in (C, S, D)]
    served_at(ctl, 1, base=0.5, per=0.25, seconds=60, t0=end)  # one at a time, for a minute
    assert ctl.model.per_request_s == pytest.approx(0.25, rel=0.01) and ctl.model.base_s == pytest.approx(0.5)
    assert [ctl.max_admitted(k) for k in (C, S, D)] == caps


def completions(model: ServiceModel, n: int, latency: float, seconds: float, t0: float) -> float:
    """Completions of requests that each shared the server with ``n`` and took ``latency``, ``n``
    of them every ``latency`` seconds (Little's law); returns the end time."""
    t, gap = t0, latency / n
    while t < t0 + seconds:
        t += gap
        model.observe(t, latency, latency / n)
    return t


def knee_then_lull(model: ServiceModel, burst: bool = True) -> float:
    """Load on a server whose latency is ``0.7 + 0.1 * (n - 1)`` up to 9 in flight and 2.3 s at
    11 (the EPYC's knee): 20 s at 4 in flight, a burst of 6 s at 11 (or more of the 4), then a
    lull of 30 s at 1-3 in flight that reads a flatter slope there (0.78, 0.82 and 0.86 s), as
    lulls did on the EPYC."""
    t = completions(model, 4, 1.0, 20.0, 0.0)
    t = completions(model, 11, 2.3, 6.0, t) if burst else completions(model, 4, 1.0, 6.0, t)
    for _ in range(10):
        t = completions(model, 1, 0.78, 1.0, t)
        t = completions(model, 2, 0.82, 1.0, t)
        t = completions(model, 3, 0.86, 1.0, t)
    return t


def test_a_concurrency_measured_slow_holds_the_caps_after_the_line_forgot_it() -> None:
    """The line fades within a few windows: after the lull it is fitted at 1-2 in flight and
    admits past the knee; the bucket of 11 remembers 2.3 s there, so the cap for a 1.9 s limit
    stays below 11 (without the burst, nothing is remembered and the line rules)."""
    model = ServiceModel(0.7, 0.1, slots=16)
    knee_then_lull(model)
    assert model.floor() == {4: pytest.approx(1.0), 11: pytest.approx(2.3)}  # above the lull's 1-3
    assert model.base_s + model.per_request_s * 10 < 1.9  # the line alone would admit 11
    assert model.max_within(1.9) == 10 and model.latency_s(11) == pytest.approx(2.3)
    assert model.latency_s(3) == pytest.approx(model.base_s + model.per_request_s * 2)  # where fresh: the line
    plain = ServiceModel(0.7, 0.1, slots=16)
    knee_then_lull(plain, burst=False)
    assert plain.floor() == {4: pytest.approx(1.0)} and plain.max_within(1.9) >= 12


def test_the_floor_gives_way_to_fresh_points_and_fades() -> None:
    # fresh points at 12 in flight, on the line: the line is measured there, the bucket of 11 no longer rules
    model = ServiceModel(0.7, 0.1, slots=16)
    t = knee_then_lull(model)
    completions(model, 12, 0.7 + 0.1 * 11, 3.0, t)
    assert model.floor() == {} and model.max_within(1.9) >= 12
    # a long lull: the bucket's weight (the burst's 27 completions) fades below FLOOR_MIN_WEIGHT
    # within FLOOR_TAU_S * ln(27 / 3), about two minutes after the burst
    model = ServiceModel(0.7, 0.1, slots=16)
    t = knee_then_lull(model)
    t = completions(model, 1, 0.7, 60.0, t)
    assert 11 in model.floor()
    completions(model, 1, 0.7, 60.0, t)
    assert 11 not in model.floor()


def knee_line(model_type: type[ServiceModel] = ServiceModel) -> tuple[ServiceModel, float]:
    """A model fitted on ``0.62 + 0.11 * (n - 1)`` (the EPYC below its knee) at 1-4 in flight
    for 40 s; with the time of its last completion."""
    model, t = model_type(0.7, 0.1, slots=16), 0.0
    for _ in range(10):
        for n in (1, 2, 3, 4):
            t = completions(model, n, 0.62 + 0.11 * (n - 1), 1.0, t)
    assert (model.base_s, model.per_request_s) == (pytest.approx(0.62), pytest.approx(0.11))
    return model, t


@pytest.mark.parametrize(("measured", "predicted", "count", "shift"), [
    (3.0, 3.0, 4, 1.0),  # on the line
    (1.45, 1.0, 4, 1.0), (1.0, 1.45, 4, 1.0),  # within SHIFT_RATIO either way, for SHIFT_COUNT: noise
    (1.55, 1.0, 4, 1.55), (1.0, 1.55, 4, 1 / 1.55),  # past it: the machine's speed changed by that
    (3.0, 1.0, 4, 3.0), (1.0, 3.0, 4, 1 / 3),
    (2.2, 1.0, 1, 1.0), (2.3, 1.0, 1, 2.3),  # one completion: 1.5 ** 2 = 2.25 times off
    (1.3, 1.0, 9, 1.0), (1.32, 1.0, 9, 1.32),  # nine: 1.5 ** (2 / 3) = 1.31 times
    (10.0, 1.0, 4, 4.0), (1.0, 10.0, 4, 0.25),  # at most SHIFT_MAX a window: a larger change in steps
    (0.0, 1.0, 4, 1.0), (1.0, 0.0, 4, 1.0), (1.0, 3.0, 0, 1.0),  # nothing to compare
])
def test_completions_far_off_the_line_say_how_much_the_machine_changed(measured: float, predicted: float,
                                                                      count: int, shift: float) -> None:
    assert ServiceModel.shift(measured, predicted, count) == pytest.approx(shift)


@pytest.mark.parametrize(("n", "ratio", "shifted"), [
    (3, 1.4, False), (3, 1 / 1.4, False),  # noise
    (3, 3.0, True), (3, 1 / 3, True),  # within SHIFT_SPAN of where the line was measured (its points' mean: 2.85 in flight)
    (4, 1 / 3, False), (5, 3.0, False), (12, 2.0, False),  # further up: the curve may bend there (a knee)
    (2, 3.0, False), (1, 1 / 3, False),  # further down (a lull)
])
def test_only_completions_where_the_line_was_measured_say_the_machine_changed(n: int, ratio: float,
                                                                             shifted: bool) -> None:
    model, t = knee_line()
    assert model._sums[1] / model._sums[0] == pytest.approx(1.85, abs=0.05)  # nearer the latest, 4 in flight
    before, latency = model.latency_s(n), ratio * (0.62 + 0.11 * (n - 1))
    while not model.observe(t := t + latency / n, latency, latency / n):  # until the first window closes
        pass
    assert (model.shifts > 0) == shifted
    if shifted:
        assert model.latency_s(n) == pytest.approx(ratio * before, rel=0.05)


def test_a_line_pivoted_through_the_origin_reads_no_changed_machine() -> None:
    """Measured (12-04, four busy processes beside the server on 2 cores for 30 s): requests
    took 11-27 s at 7-9 in flight, and with the first completions alone after it the line ran
    through about the origin (`_fit`'s pivot: base 1-4 ms, 1.6 s per request); a request alone
    at 0.7 s was then read as a machine a hundred times slower, and the line rescaled to 223 s
    per request. A line that steep (pivoted, or fitted across two speeds of the machine) is not
    trusted near its points either (`_near_fitted`): no shift, the line moves as before."""
    model = ServiceModel(0.7, 0.1, slots=16)
    model.observe(0.0, 0.7, 0.7)  # measured: windows from now on
    model._sums = [5.0, 2.5, 4.0, 5.0, 10.0]  # its points' mean: 1.5 in flight, 0.8 s
    model.base_s, model.per_request_s = ServiceModel.PIVOT_S, 1.6
    completions(model, 1, 0.7, 10.0, 1.0)  # alone, within SHIFT_SPAN of the points' mean
    assert model.shifts == 0 and 0.5 < model.base_s < 0.8  # fitted through the fast points, as before
    assert ServiceModel.shift(4 * 0.7, 4 * (ServiceModel.PIVOT_S + 1.6 * 0.0), 4) == ServiceModel.SHIFT_MAX  # else


def test_when_the_machine_speeds_up_again_the_line_and_the_floor_follow_where_the_points_do_not_spread() -> None:
    """Measured (12-04, 2-core AVX-512 EPYC, 2 s SLO, 1.5 x C0): the machine ran three times
    slower for 30 s, the door followed it down to one or two in flight, and when it came back
    the fitted slope stayed at 0.45-0.63 s per request for 40 s: the slow points at two in
    flight and the fast ones after them at one read a steep slope, and where the points do not
    spread the ridge keeps it. Here, before: in the first 4 s fast again the slope rose from
    0.28 to 1.06 s and the cap for 1.9 s stayed at 1; now 14 from the second window."""
    model, t = knee_line()
    for _ in range(10):  # three times slower, one or two in flight
        for n in (1, 2):
            t = completions(model, n, 3 * (0.62 + 0.11 * (n - 1)), 2.0, t)
    assert model.base_s == pytest.approx(3 * 0.62, rel=0.05) and model.max_within(1.9) == 1
    assert model.per_request_s == pytest.approx(3 * 0.11, rel=0.2)  # the slope scaled with it
    assert model.floor()  # 3 and 4 in flight, measured fast a minute ago (below the slow line: no bound)
    t = completions(model, 1, 0.62, 3.0, t)  # fast again, one at a time
    assert model.base_s == pytest.approx(0.62, rel=0.02)
    assert model.per_request_s == pytest.approx(0.11, rel=0.2)  # not the two speeds' slope
    assert all(v < model.latency_s(k) for k, v in model.floor().items())  # the buckets rescaled with it
    assert model.max_within(1.9) in (11, 12, 13, 14)  # the fast machine's 12, give or take the slope


def test_a_machine_slowing_down_is_followed_at_once() -> None:
    """The door at 1-4 in flight when the machine slows threefold and it stays at 3: before,
    the slow points at 3 in flight among the fast ones at 4 read a falling line (the slope fell
    from 0.11 to 0.046 s, then to its floor, 0.001 s) and the cap for 1.9 s rose from 13 to
    16-19 over 5 s. Now the first window rescales the line (from its completions at 3 in
    flight; it also holds fast ones at 4, from before the change)."""
    model, t = knee_line()
    while not model.observe(t := t + 0.84, 3 * 0.84, 0.84):  # until the first window closes
        pass
    assert model.shifts == 1
    assert model.latency_s(3) == pytest.approx(3 * 0.84, rel=0.02)
    assert model.per_request_s == pytest.approx(3 * 0.11, rel=0.02)  # the slope scaled with it
    assert model.max_within(1.9) == 1
    completions(model, 3, 3 * 0.84, 5.0, t)  # it stays slow: read once
    assert model.latency_s(3) == pytest.approx(3 * 0.84, rel=0.02) and model.max_within(1.9) == 1
    assert model.shifts == 1


def steep_after_a_starvation() -> tuple[ServiceModel, float]:
    """A line read across a starved engine (measured 12-04, two busy processes beside the server
    on 2 cores): completions at 5-7 in flight took 10-15 s, and the fast ones alone after them
    left a line of 0.7 s alone and 2 s more per request; a bucket at 2 in flight remembers 2.1 s."""
    model = ServiceModel(0.7, 2.0, slots=16, trusted=True)  # measured: windows from now on
    model._buckets[2] = [10.0, 21.0, -30.0]  # measured half a minute before
    model._refloor(0.0)
    return model, 0.0


def test_a_request_alone_just_measured_bounds_what_more_requests_take() -> None:
    """A work-conserving server serves ``n`` requests in at most ``n`` times what one takes
    alone (one after another would), so a line or a remembered floor that says more is not the
    machine as it runs now. Before, the door stayed at one in flight for a minute and more
    (`ServiceModel.alone_s`; in the door's model 32% of the requests sent after a phase ten
    times slower were within the SLO, 62% with the bound, 68% with the line pivoted through
    it too)."""
    model, t = steep_after_a_starvation()
    assert model.alone_s is None and model.max_within(1.9) == 1 and model.latency_s(2) == pytest.approx(2.7)
    for latency in (0.8, 0.7, 0.6):  # alone, fast again
        t += 1.0
        model.observe(t, latency, latency)
    assert model.alone_s == pytest.approx(0.7)  # the median of the latest three
    assert model.latency_s(2) == pytest.approx(1.4) and model.latency_s(3) == pytest.approx(2.1)
    assert model.latency_s(1) == pytest.approx(model.base_s)  # alone the line (fitted on many) rules
    assert model.latency_s(1.5) == pytest.approx(model.base_s + 0.5 * model.per_request_s)
    assert model.per_request_s > 1.0  # the line itself is unchanged: the bound is on what it predicts
    assert model.max_within(1.9) == 2 and model.max_within(1.3) == 1  # the bound admits at least 2, or nothing
    assert model.floor() == {2: pytest.approx(2.1)}  # still remembered, bounded too
    for _ in range(6):  # then only at 3 in flight for longer than FLOOR_FRESH_S: the bound lapses
        t += 1.0
        model.observe(t, 6.0, 2.0)
    assert model.alone_s is None and model.latency_s(2) >= 2.1 and model.max_within(1.9) == 1


def test_a_line_far_below_a_request_alone_pivots_through_it() -> None:
    """Measured beside a real neighbour (12-05, three busy processes on 2 cores): after the
    starvation the line ran through about the origin (base 1 ms, 1.5-2 s per request) while
    requests alone took 0.5 s; the latency's spread measured against it read 2.0-2.4 and held
    standard work at one in flight. A fit whose intercept falls more than `PIVOT_RATIO` below
    the latency alone measured just now pivots on its points' mean through that latency
    instead; without one measured, as before (through about the origin, or where it fell)."""

    class NoneAlone(ServiceModel):
        def _realone(self, now: float) -> None:
            self._alone_s = None

    def fitted(model_type: type[ServiceModel]) -> ServiceModel:
        model = model_type(ServiceModel.PIVOT_S, 3.0, slots=16, trusted=True)
        model._sums = [5.0, 20.0, 40.0, 80.0, 160.0]  # at 5 in flight, 8 s each (the starved completions)
        model.observe(1.0, 0.6, 0.6)
        assert model.observe(2.0, 0.6, 0.6)  # alone, fast again: the window closes
        return model

    pivoted, plain = fitted(ServiceModel), fitted(NoneAlone)
    assert plain.base_s == pytest.approx(0.338, abs=0.01)  # below 0.6 / 1.5: the fit's own intercept
    assert pivoted.base_s == pytest.approx(0.6)
    mx, my = pivoted._sums[1] / pivoted._sums[0], pivoted._sums[2] / pivoted._sums[0]
    assert pivoted.base_s + pivoted.per_request_s * mx == pytest.approx(my)  # the line through their mean
    assert pivoted.latency_s(1.5) > plain.latency_s(1.5)


def test_the_bound_alone_leaves_a_line_the_machine_keeps_as_it_was() -> None:
    """Within the bound (a batching engine serves a few requests in far less than a few times
    one alone), nothing moves: the caps and predictions of the EPYC's line measured one at a
    time are those of a model that measures nothing alone."""

    class NoneAlone(ServiceModel):
        def _realone(self, now: float) -> None:
            self._alone_s = None

    (model, t), (plain, _) = knee_line(), knee_line(NoneAlone)
    assert model.alone_s == pytest.approx(0.62) and plain.alone_s is None
    for n in (1, 1.5, 2, 4, 9, 16, 40):
        assert model.latency_s(n) == pytest.approx(plain.latency_s(n))
    for limit in (0.5, 1.0, 1.9, 5.0):
        assert model.max_within(limit) == plain.max_within(limit)


def test_a_changed_machine_forgets_the_latencies_alone_measured_before_it() -> None:
    """They may be of either speed: a bound from the fast machine's latency alone would admit
    twice what the slower one serves within the SLO."""
    model, t = knee_line()
    t = completions(model, 1, 0.62, 2.0, t)
    assert model.alone_s == pytest.approx(0.62)
    while not model.observe(t := t + 0.84, 3 * 0.84, 0.84):  # three times slower at 3 in flight
        pass
    assert model.shifts == 1 and model.alone_s is None and model.max_within(1.9) == 1


def test_a_changed_machine_starts_the_spread_again() -> None:
    """The measured spread of the latency over the prediction (`LatencyTail`) was measured
    around a line the machine left: in the door's model, after a phase ten times slower it read
    2.0-2.2, and critical's tail limit held the door at one or two in flight after the line had
    come back. A shift starts it again; noise around an unchanged line keeps it."""
    ctl = controller(slots=16)
    model, t = knee_line()
    ctl._models[0] = model
    for i in range(TAIL_MIN + 10):  # noise at 3 in flight, where the line was measured
        t += 0.3
        latency = 0.84 * (1.3 if i % 2 else 0.8)
        ctl.observe_completion(t, latency, latency / 3)
    assert len(ctl._tail) == TAIL_MIN + 10 and ctl.speed_shifts == 0
    while ctl.speed_shifts == 0:  # three times slower at 3 in flight
        t += 0.84
        ctl.observe_completion(t, 3 * 0.84, 0.84)
    assert len(ctl._tail) < TAIL_MIN and ctl.tail_factor == 1.0


class NeverShifts(ServiceModel):
    SHIFT_RATIO = math.inf  # no window is ever far enough off the line


class Anywhere(ServiceModel):
    SHIFT_SPAN = SHIFT_SLOPE_SHARE = math.inf  # every completion counts as near the fitted points


def test_a_lull_and_a_knee_are_not_a_changed_machine() -> None:
    """Away from the points the line was fitted on, the curve itself is off the line: the
    windows there move it as before (no rescaling)."""
    (a, t), (b, _) = knee_line(), knee_line(NeverShifts)
    # past the knee (twice the line there), then a lull at half of it: off enough for a shift,
    # were they near the fitted points (`Anywhere` reads one)
    for n, latency in ((11, 3.5), (8, 2.4), (1, 0.3)):
        completions(b, n, latency, 3.0, t)
        t = completions(a, n, latency, 3.0, t)
        assert (a.base_s, a.per_request_s) == (pytest.approx(b.base_s), pytest.approx(b.per_request_s))
    assert a.shifts == 0
    anywhere, t = knee_line(Anywhere)
    for n, latency in ((11, 3.5), (1, 0.3)):
        t = completions(anywhere, n, latency, 3.0, t)
    assert anywhere.shifts >= 1


def test_a_level_starts_without_the_floor() -> None:
    ctl = controller(slots=16)
    knee_then_lull(ctl.model)
    ctl._recompute()
    assert ctl.model.floor() and ctl.max_admitted(C) <= 10
    ctl.set_level(2)
    assert ctl.model.floor() == {}  # another level runs at another speed: the line is copied, not the buckets


def concave(n: float) -> float:
    """A batching engine's latency (the shape measured on 2 cores): 0.78 s alone, a steep rise to
    about 1.3 s at 4 in flight, then nearly flat to the batch of 16, queueing past it. The door
    simulator's engine (`bench.door_sim.engine_latency`), so the two cannot drift apart."""
    return engine_latency(n, "concave")


def overload_at_the_door(ctl: AdmissionController, rate: float, seconds: float, seed: int,
                         mix: tuple[float, float, float] = (0.2, 0.5, 0.3), dt: float = 0.01) -> dict:
    """Poisson arrivals of the mix at ``rate`` per second through ``ctl``'s door into an engine
    that shares itself among the requests in flight (processor sharing): with ``n`` in flight each
    progresses at ``1 / concave(n)`` of its work per second. A pure, seeded simulation of the
    overload benchmark's 3 x C0 phase; returns the median in flight, the goodput (served within
    2 s) and each class's refused share, over all but the first 10 s."""
    rng, share, t = random.Random(seed), ShareClock(), 0.0
    while t < 20.0:  # a calm before: one request at a time
        t += concave(1) + 0.5
        ctl.observe_completion(t, concave(1), concave(1))
    start, end, arrive = t + 10.0, t + 10.0 + seconds, t + rng.expovariate(rate)
    running: list[list[float]] = []  # admitted at, work done, share mark
    good, in_flight = 0, []
    offered, refused = dict.fromkeys(Criticality, 0), dict.fromkeys(Criticality, 0)
    while t < end:
        t += dt
        if running:
            step = dt / concave(len(running))
            for r in [r for r in running if r[1] + step >= 1.0]:
                running.remove(r)
                mark = share.mark(t, len(running))
                ctl.observe_completion(t, t - r[0], mark - r[2])
                good += t >= start and t - r[0] <= 2.0
            for r in running:
                r[1] += step
        while arrive <= t:
            klass = rng.choices(list(Criticality), weights=mix)[0]
            admitted = ctl.decide(klass, len(running), arrive).admitted
            if arrive >= start:
                offered[klass] += 1
                refused[klass] += not admitted
            if admitted:
                running.append([arrive, 0.0, share.mark(arrive, len(running) + 1)])
            arrive += rng.expovariate(rate)
        if t >= start:
            in_flight.append(len(running))
    return {"in_flight": statistics.median(in_flight), "goodput": good / seconds,
            "refused": {k: refused[k] / max(1, offered[k]) for k in Criticality}}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_under_overload_the_door_settles_where_the_engine_holds_the_slo_not_below(seed: int) -> None:
    """The bistable door (measured on 2 cores: 3 x C0 goodput 7.07 req/s at 11 in flight in one
    run, 3.34 at 4 in another, same code): a line anchored at the latency alone and fitted at 4
    in flight read 0.13-0.15 s per request, a low saturation rate; Erlang's reservation for
    critical work on that rate held standard work to 2-3 in flight, and nothing measured the flat
    part above. Fitted where the service runs, with the batch's knee, the door holds what the
    engine serves within the shares (this simulation of that run: 4 in flight, 3.3 req/s with
    the anchored line). Sheddable is still shed first, critical barely at all."""
    slo = SloConfig(e2e_p99_ms=2000, class_share={"critical": 1.0, "standard": 0.9, "sheddable": 0.9})
    # the line's fit alone: the ramp (`ramp_limit`) starts the door low, where this engine's
    # curve is steep, and in this model the door then took longer to climb (below)
    ctl = AdmissionController(slo, AdmissionConfig(overhead_ms=100, ramp_step=0), slots=16)
    run = overload_at_the_door(ctl, rate=17.7, seconds=60.0, seed=seed)
    best = max(n for n in range(1, 40) if concave(n) <= 0.9 * 1.9)  # standard's share: 16
    capacity = 16 / concave(16)  # 9.5 req/s
    assert run["in_flight"] >= best - 3
    assert run["goodput"] >= 0.8 * capacity
    refused = run["refused"]
    assert refused[D] >= refused[S] >= refused[C] and refused[C] <= 0.03


def test_past_the_batch_littles_law_bounds_the_cap_however_flat_the_line() -> None:
    model = ServiceModel(1.3, ServiceModel.MIN_SLOPE, slots=16)  # a flat line within the batch
    assert model.max_within(1.9) == math.floor(1.9 * 16 / model.latency_s(16))  # 23, not hundreds
    for t in range(20):  # flat points, falling a little with the load: noise
        model.observe(float(t), 1.3 - 0.001 * t, (1.3 - 0.001 * t) / (8 + t % 5))
    assert model.per_request_s >= ServiceModel.MIN_SLOPE and model.max_within(1.9) <= 24


def test_bursty_completions_do_not_drift_the_estimate_up() -> None:
    """A batch finishes together: four completions within 10 ms every 4 s. Counted over 1 s
    windows that read as 400/s; per request it is what it is: 4 sharing, 4 s each."""
    ctl = controller()
    t = 0.0
    for _ in range(30):
        t += 4.0
        for i in range(4):
            ctl.observe_completion(t + 0.0025 * i, 4.0, 1.0)
    assert ctl.rate_per_s < 2.0 and ctl.max_admitted(C) <= 2


def test_signals_for_the_policy_actor() -> None:
    # prior: 0.1 s alone and per request, in a 2.1 s SLO; the instant count (no smoothing)
    ctl = controller(settings_=SETTINGS.model_copy(update={"wait_smoothing_s": 0.0}), slots=8)
    idle = {"predicted_wait_ms": 0.0, "model_queued": 0.0, "refused_ratio": 0.0}
    assert ctl.signals(0, 0.0) == idle  # idle: levels can recover
    # 12 ahead wait 1.2 s; the SLO over the room the unloaded latency leaves: 2.1 / 2.0
    assert ctl.signals(12, 0.0) == {"predicted_wait_ms": 1260.0, "model_queued": 4.0, "refused_ratio": 0.0}


@pytest.mark.parametrize("model, ingress, slots, queued", [
    (1, 1, 8, 12.0),  # one engine's batch of 8: 12 of 20 wait
    (2, 1, 16, 2.0),  # two engines: 16 run, 4 wait, 2 per engine
    (3, 1, 24, 0.0),  # three engines: all 20 run
    (1, 2, 4, 16.0),  # two ingress replicas share one engine: this one's half of the batch
    (2, 4, 4, 8.0),   # and summed over the 4 ingress replicas: what waits per engine
    (0, 1, 8, 12.0),  # no model replica reporting yet: the share stays as it was
])
def test_the_share_of_the_batches_follows_the_replicas(model: int, ingress: int, slots: int, queued: float) -> None:
    ctl = controller(slots=8)
    changed = ctl.set_replicas(model, ingress)
    assert changed == ((slots, max(model, 1)) != (8, 1))
    assert ctl.slots == slots and ctl.signals(20, 0.0)["model_queued"] == queued
    assert not ctl.set_replicas(model, ingress)  # the same counts again: nothing changes


@pytest.mark.parametrize(
    "name, events, now, expected",
    [
        ("nothing decided: 0, so a level can recover", [], 10.0, 0.0),
        ("every request admitted", [(1.0, False), (2.0, False)], 3.0, 0.0),
        ("one refused of four: one request's evidence, at most 1/20", [(1.0, False), (1.1, True), (1.2, False),
                                                                        (1.3, False)], 2.0, 0.05),
        ("one refused of forty", [(1.0 + i / 100, i == 7) for i in range(40)], 2.0, 0.025),
        ("ten refused of forty", [(1.0 + i / 100, i % 4 == 0) for i in range(40)], 2.0, 0.25),
        ("a refusal older than the window is forgotten", [(1.0, True), (6.0, False)], 6.5, 0.0),
        ("refusals, then no traffic: 0 once the window has passed", [(1.0, True), (1.1, True)], 6.6, 0.0),
        ("refusals, then no traffic: still counted inside the window", [(1.0, True), (1.1, True)], 5.0, 0.1),
        ("all refused", [(i / 100, True) for i in range(30)], 0.4, 1.0),
    ],
)
def test_refusal_window(name: str, events: list[tuple[float, bool]], now: float, expected: float) -> None:
    w = RefusalWindow(5.0)
    for at, refused in events:
        w.add(at, refused)
    assert w.ratio(now) == pytest.approx(expected), name


def test_refusal_window_memory_is_bounded_whatever_the_rate() -> None:
    w = RefusalWindow(5.0)
    for i in range(100_000):
        w.add(i * 0.001, refused=i % 10 == 0)  # 1,000 decisions/s for 100 s, 10% refused
    assert len(w._bins) <= RefusalWindow.BINS + 1
    decided, refused = w.counts(100.0)
    assert 5000 <= decided <= 5250 and refused == pytest.approx(decided / 10, abs=1)
    with pytest.raises(ValueError, match="window_s"):
        RefusalWindow(0.0)


def test_refusals_at_the_door_raise_the_refused_ratio_and_admissions_lower_it() -> None:
    ctl = controller(slots=8)
    cap = ctl.max_admitted(C)
    assert all(ctl.decide(C, ahead=i, now=1.0).admitted for i in range(cap))
    assert ctl.signals(cap, 1.0)["refused_ratio"] == 0.0  # full, nothing refused yet: no signal
    assert not ctl.decide(C, ahead=cap, now=1.5).admitted  # demand past what this level serves
    assert ctl.signals(cap, 1.5)["refused_ratio"] == pytest.approx(1 / max(cap + 1, 20), abs=1e-4)
    assert ctl.signals(0, 7.0)["refused_ratio"] == 0.0  # the window has passed: the level may recover


def test_a_reloaded_policy_applies_a_new_refusal_window() -> None:
    ctl = controller()
    ctl.update(SLO, SETTINGS.model_copy(update={"refusal_window_s": 1.0}))
    for i in range(20):
        assert not ctl.decide(C, ahead=10_000, now=i / 100).admitted
    assert ctl.signals(0, 0.5)["refused_ratio"] == 1.0 and ctl.signals(0, 1.5)["refused_ratio"] == 0.0


@pytest.mark.parametrize(("in_flight", "wait_ms"), [
    (0, 0.0),
    (1, 1280.0),  # 0.8 s of queueing in the 2.5 s room: 32% of it, on the SLO's 4 s scale
    (2, 2560.0),
    (3, 3840.0),  # a request arriving now would finish at 1.5 + 3 * 0.8 = 3.9 s: about the SLO
])
def test_predicted_wait_is_on_the_slo_scale_when_one_request_alone_takes_much_of_it(
        in_flight: int, wait_ms: float) -> None:
    ctl = controller(SloConfig(e2e_p99_ms=4000, class_share=SPREAD), AdmissionConfig(overhead_ms=100))
    served_at(ctl, 1, base=1.5, per=0.8, seconds=10)
    served_at(ctl, 3, base=1.5, per=0.8, seconds=10, t0=20.0)
    assert ctl.signals(in_flight, 40.0)["predicted_wait_ms"] == pytest.approx(wait_ms, rel=0.01)
    assert ctl.predicted_e2e_s(3) == pytest.approx(0.1 + 1.5 + 3 * 0.8, rel=0.01)
    # 0.1 + 1.5 + 0.8 * ahead <= 0.1 + share * 3.9: critical ahead <= 3, standard 2, sheddable 1
    assert [ctl.max_admitted(k) for k in (C, S, D)] == [4, 3, 2]


def test_each_level_keeps_its_own_model() -> None:
    ctl = controller()
    served_at(ctl, 5, base=0.5, per=0.4, seconds=20)  # level 0: slow
    level0_caps = [ctl.max_admitted(k) for k in (C, S, D)]
    assert ctl.set_level(3) and not ctl.set_level(3)
    assert [ctl.max_admitted(k) for k in (C, S, D)] == level0_caps  # seeded from level 0
    served_at(ctl, 5, base=0.5, per=0.2, seconds=20, t0=100.0)  # level 3: twice as fast
    level3_caps = [ctl.max_admitted(k) for k in (C, S, D)]
    assert level3_caps[0] > level0_caps[0]
    ctl.set_level(0)  # back: level 0's own measurements apply at once, not level 3's
    assert [ctl.max_admitted(k) for k in (C, S, D)] == level0_caps
    ctl.set_level(3)
    assert [ctl.max_admitted(k) for k in (C, S, D)] == level3_caps


@pytest.mark.parametrize("name, in_flight, ends, expected", [
    ("held while the requests of the level left run", 4, None, "level0"),
    ("the last of them left: the new level's caps", 4, "end_hold", "level3"),
    ("one SLO after the change, none can be on time: released", 4, "slo", "level3"),
    ("just before that: still held", 4, "before_slo", "level0"),
    ("nothing in flight at the change: at once", 0, None, "level3"),
])
def test_a_level_change_holds_the_caps_it_left_while_its_requests_run(
        name: str, in_flight: int, ends: str | None, expected: str) -> None:
    ctl = controller()
    served_at(ctl, 5, base=0.5, per=0.4, seconds=20)  # level 0: slow
    caps = {"level0": [ctl.max_admitted(k) for k in (C, S, D)]}
    ctl.set_level(3)
    served_at(ctl, 5, base=0.5, per=0.2, seconds=20, t0=100.0)  # level 3: twice as fast
    caps["level3"] = [ctl.max_admitted(k) for k in (C, S, D)]
    assert caps["level3"][0] > caps["level0"][0]
    ctl.set_level(0)
    assert ctl.set_level(3, now=200.0, in_flight=in_flight)
    now = {"slo": 200.0 + ctl.e2e_s, "before_slo": 200.0 + ctl.e2e_s - 0.01}.get(ends or "", 200.0)
    if ends == "end_hold":
        assert ctl.end_hold()
    # critical work alone arrives (none at all here): its cap is held with the rest
    assert ctl.class_cap(C, now) == caps[expected][0]  # critical keeps its whole cap: nothing above it
    assert ctl.critical_cap(now) == caps[expected][0]
    assert [ctl.max_admitted(k) for k in (C, S, D)] == caps[expected], name
    assert (ctl.held_until is not None) == (expected == "level0" and in_flight > 0)


def test_critical_work_is_not_held_behind_the_classes_below_it() -> None:
    """While a class below critical arrives, the hold of a level change bounds that class only:
    held too, critical requests wait behind the work admitted before the change (measured
    12-07: the door stood at critical's held cap of 7 for 2 s where the new level's was 10, and a
    critical request was refused after its whole wait). Where critical work alone arrives, it is
    held like any class (`test_a_level_change_holds_the_caps_it_left_while_its_requests_run`)."""
    ctl = controller()
    served_at(ctl, 5, base=0.5, per=0.4, seconds=20)  # level 0: slow
    level0 = [ctl.max_admitted(k) for k in (C, S, D)]
    ctl.set_level(3)
    end = served_at(ctl, 5, base=0.5, per=0.2, seconds=20, t0=100.0)  # level 3: twice as fast
    level3 = [ctl.max_admitted(k) for k in (C, S, D)]
    assert level3[0] > level0[0] and level3[1] > level0[1]
    ctl.set_level(0)
    now = end + 60.0
    for k in range(10):  # standard work arrives, one a second
        ctl.decide(S, 0, now + k)
    now += 10.0
    assert ctl.set_level(3, now=now, in_flight=4)
    # critical: the new level's cap, admitted above the held one, and saturated only there
    assert ctl.class_cap(C, now) == ctl.critical_cap(now) == level3[0]
    assert ctl.decide(C, level0[0], now).admitted
    refused = ctl.decide(C, level3[0], now)
    assert not refused.admitted and refused.reason == "saturated"
    # the classes below: held at level 0's caps
    assert ctl.class_cap(S, now) <= level0[1]
    standard = ctl.decide(S, level0[1], now)
    assert not standard.admitted and standard.reason == "class_share_exhausted"
    assert ctl.max_admitted(C) == level0[0]  # as held: where only critical work arrives
    # the hold ends: the new level's caps for all
    assert ctl.end_hold()
    assert ctl.critical_cap(now) == ctl.max_admitted(C) == level3[0]
    assert ctl.class_cap(S, now) > level0[1]


def test_the_hold_reads_the_level_it_left_at_the_speed_in_force_not_as_it_stood() -> None:
    ctl = controller()
    served_at(ctl, 5, base=0.5, per=0.4, seconds=20)  # level 0: slow
    level0 = [ctl.max_admitted(k) for k in (C, S, D)]
    ctl.set_level(3)
    served_at(ctl, 5, base=0.5, per=0.2, seconds=20, t0=100.0)  # level 3: twice as fast
    level3 = [ctl.max_admitted(k) for k in (C, S, D)]
    ctl.set_level(0)
    assert ctl.set_speed(6.0, 199.0)  # a reading of 6 x (4.8 applied) while level 0 is in force
    slowed = [ctl.max_admitted(k) for k in (C, S, D)]
    assert slowed[0] < level0[0] < level3[0]
    assert ctl.set_level(3, now=200.0, in_flight=4)  # the level rises with the reading in force
    assert [ctl.max_admitted(k) for k in (C, S, D)] == slowed
    assert ctl.set_speed(1.0, 200.5)  # the reading ends while level 0's requests still run
    assert ctl.held_until == pytest.approx(200.0 + ctl.e2e_s)
    assert [ctl.max_admitted(k) for k in (C, S, D)] == level0  # the level left, at the usual speed
    assert ctl.end_hold()
    assert [ctl.max_admitted(k) for k in (C, S, D)] == level3


def test_a_change_to_a_slower_level_is_not_delayed_and_holds_chain() -> None:
    ctl = controller()
    ctl.set_level(1)
    served_at(ctl, 5, base=0.5, per=0.2, seconds=20)  # level 1: fast
    fast = [ctl.max_admitted(k) for k in (C, S, D)]
    ctl.set_level(0)
    served_at(ctl, 5, base=0.5, per=0.4, seconds=20, t0=100.0)  # level 0: slow
    slow = [ctl.max_admitted(k) for k in (C, S, D)]
    ctl.set_level(1)
    assert [ctl.max_admitted(k) for k in (C, S, D)] == fast
    assert ctl.set_level(0, now=200.0, in_flight=3)  # to the slower level: its caps, at once
    assert [ctl.max_admitted(k) for k in (C, S, D)] == slow
    assert ctl.set_level(1, now=201.0, in_flight=3)  # back while they run: still the lower caps
    assert [ctl.max_admitted(k) for k in (C, S, D)] == slow
    assert ctl.held_until == pytest.approx(201.0 + ctl.e2e_s)
    ctl.class_cap(C, 201.0 + ctl.e2e_s)  # the next decision one SLO after the change ends the hold
    assert [ctl.max_admitted(k) for k in (C, S, D)] == fast and ctl.held_until is None


@pytest.mark.parametrize("name, up, per_other, change_after_s, in_flight, expected", [
    ("up to a level measured slower, in an earlier phase, than the level in force just now: "
     "it starts from the model in force", True, 0.4, 0.5, 0, "in_force"),
    ("up to a level measured slower, nothing fresh in force: compared where the door is, "
     "alone (1.6 x): the model in force", True, 0.4, 60.0, 0, "in_force"),
    ("the same with 5 in flight, compared at 5 (1.6 x): the model in force", True, 0.4, 60.0, 5, "in_force"),
    ("up to a level measured slower within the margin (noise): kept", True, 0.24, 0.5, 0, "own"),
    ("the same with nothing fresh, compared at the 5 in flight (1.12 x): kept", True, 0.24, 60.0, 5, "own"),
    ("up to a level measured faster: kept", True, 0.1, 0.5, 0, "own"),
    ("down to a level measured faster, in an earlier phase: its own (the hold bounds it while "
     "requests of the level left run)", False, 0.1, 0.5, 0, "own"),
])
def test_a_higher_level_is_never_predicted_slower_than_the_level_in_force_just_measured(
        name: str, up: bool, per_other: float, change_after_s: float, in_flight: int, expected: str) -> None:
    """Levels are ordered by cost (a higher level does less): a higher level's model that
    predicts more than `STALE_RATIO` x the latency of the model in force, where that one was
    just measured (or, with nothing measured just now, at the concurrency in flight), comes
    from a slower phase of the machine (`AdmissionController.set_level`). With requests in
    flight the hold bounds the caps by the level left, which is faster here: the own model's
    caps are the lower ones either way."""
    in_force, other = (2, 3) if up else (3, 2)
    ctl = controller()
    ctl.set_level(other)
    served_at(ctl, 5, base=0.5, per=per_other, seconds=20)  # the other level, a minute before
    caps = {"own": [ctl.max_admitted(k) for k in (C, S, D)]}
    ctl.set_level(in_force)
    end = served_at(ctl, 5, base=0.5, per=0.2, seconds=20, t0=100.0)  # the level in force, up to now
    caps["in_force"] = [ctl.max_admitted(k) for k in (C, S, D)]
    assert caps["own"] != caps["in_force"]
    assert ctl.model.fresh_reach(end + change_after_s) == (5 if change_after_s < 5 else 0)
    assert ctl.set_level(other, now=end + change_after_s, in_flight=in_flight)
    assert [ctl.max_admitted(k) for k in (C, S, D)] == caps[expected], name
    assert ctl.models_replaced == (expected == "in_force")


def test_a_stale_level_model_is_caught_through_a_level_never_measured() -> None:
    """At the onset of load the levels often rise two steps in a row, the first to a level never
    measured, which starts from a copy of the model in force (no completion of its own yet). That
    copy still carries what its origin measured (`ServiceModel.learned`), so the next step up is
    checked against it: a model measured in a slower phase is replaced there too (seen 12-07 on
    the AVX2 EPYC: level 3's model from the pinned, unbounded 3 x run set every cap to 1)."""
    ctl = controller()
    ctl.set_level(3)
    served_at(ctl, 5, base=0.5, per=0.4, seconds=20)  # level 3, in a slow phase
    slow = [ctl.max_admitted(k) for k in (C, S, D)]
    ctl.set_level(0)
    end = served_at(ctl, 5, base=0.5, per=0.2, seconds=20, t0=100.0)  # level 0, faster
    fast = [ctl.max_admitted(k) for k in (C, S, D)]
    assert slow != fast
    at = end + 60.0  # a calm: nothing fresh
    assert ctl.set_level(2, now=at, in_flight=5)  # never measured: a copy of level 0's model
    assert ctl.model.learned and ctl.model.fresh_reach() == 0
    assert ctl.set_level(3, now=at + 0.5, in_flight=5, left_in_flight=False)
    assert ctl.models_replaced == 1 and [ctl.max_admitted(k) for k in (C, S, D)] == fast
    assert not ServiceModel(1.0, 0.1).learned  # a prior has learned nothing


# -- construction from the policy ----------------------------------------------------------------


def test_from_config() -> None:
    assert AdmissionController.from_config(parse_policy({}), 16) is None
    off = parse_policy({"slo": {"e2e_p99_ms": 2000}, "admission": {"enabled": False}})
    assert AdmissionController.from_config(off, 16) is None
    ctl = AdmissionController.from_config(parse_policy({"slo": {"e2e_p99_ms": 2000}}), 16)
    assert ctl is not None and ctl.slots == 16
    # default prior: alone half the SLO, a full batch of 16 the whole SLO -> 16 / 2 s
    assert ctl.rate_per_s == pytest.approx(default_prior_rate(SloConfig(e2e_p99_ms=2000), 16)) == pytest.approx(8.0)
    # 1 + ahead / 15 <= 1.9 for ahead <= 13: about one batch
    assert ctl.model.base_s == 1.0 and ctl.max_admitted(C) == 14
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


def test_classes_map_to_vllm_priority_critical_first() -> None:
    assert [k.vllm_priority for k in (C, S, D)] == [0, 1, 2]


def test_update_keeps_the_measured_model() -> None:
    ctl = controller()
    served_at(ctl, 5, base=0.5, per=0.25, seconds=20)
    measured = ctl.rate_per_s
    tighter = SloConfig(e2e_p99_ms=1100, class_share=SPREAD)  # budget 1 s: caps shrink, the model stays
    ctl.update(tighter, SETTINGS)
    assert ctl.rate_per_s == measured and ctl.budget_s == pytest.approx(1.0)
    assert ctl.max_admitted(C) == 3  # 0.5 + 0.25 * ahead <= 1: ahead <= 2


def test_update_with_a_new_explicit_prior_restarts_the_estimate() -> None:
    guess = SETTINGS.model_copy(update={"prior_rate_per_s": None})
    ctl = controller(settings_=guess)
    served_at(ctl, 1, base=10.0, per=10.0, seconds=30)  # 10 s alone
    ctl.update(SLO, guess)  # no new prior: the measured model stays
    assert ctl.model.base_s == pytest.approx(10.0)
    ctl.update(SLO, SETTINGS.model_copy(update={"prior_rate_per_s": 4.0}))
    assert ctl.rate_per_s == 4.0 and ctl.max_admitted(C) == 8


# -- room kept for more critical classes (trunk reservation) -------------------------------------

def test_loss_chain_is_erlangs_loss_system_for_one_class_at_a_constant_latency() -> None:
    from policies.admission import loss_chain, refused_share

    # a = rate * latency = 1, two slots: p proportional to 1, 1, 1/2; Erlang B(1, 2) = 0.2
    p = loss_chain([1.0], [2], lambda n: 1.0)
    assert p == pytest.approx([0.4, 0.4, 0.2])
    assert refused_share(p, 2) == pytest.approx(0.2)
    assert refused_share(p, 0) == pytest.approx(1.0)


def test_loss_chain_admits_each_class_below_its_own_limit_and_slows_with_the_load() -> None:
    from policies.admission import loss_chain

    # below 1 both arrive (2/s), from 1 to 3 only the first (1/s); n in flight take 1 + (n - 1) s each
    p = loss_chain([1.0, 1.0], [3, 1], lambda n: float(n))
    # p[n+1] / p[n] = lambda(n) * L(n + 1) / (n + 1) = lambda(n): 2, then 1, 1
    assert p == pytest.approx([x / 7.0 for x in (1.0, 2.0, 2.0, 2.0)])
    # a long chain at a high load stays finite (rescaled as it goes)
    big = loss_chain([1000.0], [400], lambda n: 1.0)
    assert math.isfinite(sum(big)) and sum(big) == pytest.approx(1.0) and big[-1] > 0.5


def _costs(rates: list[float], limits: list[int], latency) -> list[float]:  # type: ignore[no-untyped-def]
    """What the last class's limit costs each class above it: its refused share with the last
    class admitted below its limit, less without the last class."""
    from policies.admission import loss_chain, refused_share

    k = len(limits) - 1
    with_it = loss_chain(rates[: k + 1], limits, latency)
    without = loss_chain(rates[:k], limits[:k], latency)
    return [refused_share(with_it, lim) - refused_share(without, lim) for lim in limits[:k]]


LINE = staticmethod(lambda n: 1.3 + 0.5 * (n - 1))  # 2 cores: 1.3 s alone, 0.5 s per request more


@pytest.mark.parametrize("name, rates, caps, expected", [
    ("nothing arrives: every class its cap", [0.0, 0.0, 0.0], [6, 5, 4], (6, 5, 4)),
    ("nothing above: the class below keeps its cap", [0.0, 2.0, 0.0], [6, 5, 4], (6, 5, 4)),
    ("a class that does not arrive costs nothing", [0.3, 0.0, 0.0], [6, 5, 4], (6, 5, 4)),
    ("nor is it protected: sheddable alone keeps its cap", [0.0, 0.0, 5.0], [6, 5, 4], (6, 5, 4)),
    ("1.5 x C0 on 2 cores: most of the caps kept", [0.156, 0.39, 0.234], [6, 5, 4], (6, 5, 3)),
    ("3 x C0: standard keeps room for critical, sheddable only an idle server", [0.31, 0.78, 0.47], [6, 5, 4],
     (6, 4, 1)),
    ("critical near the server's rate: the floor of 1", [1.0, 1.0, 1.0], [6, 5, 4], (6, 1, 1)),
    # past the server's rate the classes above are refused anyway and their share barely moves:
    # the limit rises again; the shut-out rule (AdmissionController.class_cap) covers that regime
    ("critical far over the server", [5.0, 1.0, 1.0], [6, 5, 4], (6, 4, 4)),
    ("never above the class above's limit", [0.31, 0.78, 0.0], [6, 2, 6], (6, 2, 2)),
])
def test_reserved_limits(name: str, rates: list[float], caps: list[int], expected: tuple[int, ...]) -> None:
    from policies.admission import reserved_limits

    limits = reserved_limits(rates, caps, LINE, 0.01)
    assert limits == expected, name
    # the defining property: each limit costs the classes above at most the tolerance, and one
    # more would cost more (where it could go higher: below its cap and the limit above it)
    for k in range(1, len(limits)):
        if limits[k] > 1:  # the floor of 1 may cost more (the shut-out rule's regime)
            assert all(c <= 0.01 + 1e-12 for c in _costs(rates, list(limits[: k + 1]), LINE)), name
        if 1 <= limits[k] < min(caps[k], limits[k - 1]):
            assert max(_costs(rates, [*limits[:k], limits[k] + 1], LINE)) > 0.01, name


def test_reserved_limits_fall_as_the_classes_above_arrive_faster() -> None:
    from policies.admission import reserved_limits

    # up to the server's rate (8 in flight complete at 8 / 4.8 s = 1.67/s)
    seen = [reserved_limits([lam, 0.5, 0.3], [8, 8, 8], LINE, 0.01) for lam in (0.0, 0.1, 0.3, 0.6, 1.0, 1.3)]
    assert [s[1] for s in seen] == [8, 8, 8, 6, 3, 2]
    assert [s[2] for s in seen] == [8, 8, 5, 2, 1, 1]
    # a looser tolerance keeps more for the class below
    assert reserved_limits([0.3, 0.5, 0.3], [8, 8, 8], LINE, 0.05)[1] >= reserved_limits(
        [0.3, 0.5, 0.3], [8, 8, 8], LINE, 0.01)[1]


def test_arrival_rate_decays_with_its_time_constant() -> None:
    from policies.admission import ArrivalRate

    r = ArrivalRate(tau_s=10.0)
    assert r.rate(0.0) == 0.0
    for i in range(10):
        r.add(float(i))  # one per second
    at9 = r.rate(9.0)
    assert 0.5 < at9 < 1.0  # approaches 1/s from below
    assert r.rate(39.0) == pytest.approx(at9 * math.exp(-3), rel=1e-9)


def test_fast_estimate_sees_a_step_up_within_seconds_and_peak_falls_with_the_long_one() -> None:
    from policies.admission import FAST_FRACTION, ArrivalRate

    r = ArrivalRate(tau_s=10.0)
    assert r.fast_tau_s == pytest.approx(10.0 * FAST_FRACTION) == 2.0
    for i in range(20):  # 10/s for 2 s, from nothing
        r.add(i / 10)
    assert r.fast_rate(2.0) == pytest.approx(10.0 * (1 - math.exp(-1.0)), rel=0.1)  # 63% of it
    assert r.rate(2.0) == pytest.approx(10.0 * (1 - math.exp(-0.2)), rel=0.1)  # 18% of it
    assert r.peak(2.0) == r.fast_rate(2.0)
    # once arrivals stop the fast one falls first; the peak keeps the long one
    assert r.fast_rate(12.0) < r.rate(12.0) == r.peak(12.0)


def test_a_new_time_constant_keeps_both_estimates() -> None:
    from policies.admission import ArrivalRate

    r = ArrivalRate(tau_s=60.0)
    for i in range(22):  # 22 arrivals in 2 s, counted over a minute (its fast estimate: 12 s)
        r.add(i / 11)
    long_rate, fast_rate, weight = r.rate(2.0), r.fast_rate(2.0), r.weight(2.0)
    r.retune(10.0)
    assert r.tau_s == 10.0 and r.fast_tau_s == pytest.approx(2.0)
    assert r.rate(2.0) == pytest.approx(long_rate) and r.fast_rate(2.0) == pytest.approx(fast_rate)
    assert r.weight(2.0) == pytest.approx(weight / 6)  # the same rate, over a sixth of the time
    assert r.fast_rate(4.0) == pytest.approx(fast_rate * math.exp(-1.0))  # and fades at the new one
    r.retune(10.0)  # the same constant: nothing changes
    assert r.rate(4.0) == pytest.approx(long_rate * math.exp(-0.2))


def test_a_reloaded_reserve_window_reads_no_arrivals_that_did_not_come() -> None:
    """Critical work that came at 2/s over a 60 s window is still 2/s over a 10 s window after a
    reload: the server completing 10/s is not saturated by it (the counts kept as they were
    read six-fold, and the full door refused critical work at once instead of letting it wait)."""
    wide = RESERVING.model_copy(update={"reserve_window_s": 60.0})
    ctl = controller(settings_=wide)  # the server completes 10/s
    _offer(ctl, {C: 2.0}, 200.0)
    long_rate, fast_rate = ctl.arrival_rates(200.0)["critical"]
    assert long_rate == pytest.approx(2.0, rel=0.05) and fast_rate == pytest.approx(2.0, rel=0.1)
    assert not ctl.saturated_by(C, 200.0)
    ctl.update(SLO, RESERVING)  # reserve_window_s 60 -> 10
    assert ctl.arrival_rates(200.0)["critical"] == pytest.approx((long_rate, fast_rate))
    assert not ctl.saturated_by(C, 200.0)


def test_a_step_up_in_the_demand_above_shuts_a_class_out_within_seconds() -> None:
    ctl = controller(settings_=RESERVING)  # the server completes 10/s
    _offer(ctl, {C: 1.0, S: 2.0}, 30.0)  # calm
    assert ctl.class_cap(S, 30.0) >= 1
    _offer(ctl, {C: 25.0, S: 2.0}, 32.0, start=30.0)  # critical steps to 2.5 x the server
    # 2 s later the long estimate alone says about 5.5/s (under the server); the fast one shuts standard out
    assert ctl._arrivals[0].rate(32.0) < ctl.rate_per_s
    assert ctl.class_cap(S, 32.0) == 0 and ctl.class_cap(D, 32.0) == 0
    assert ctl.decide(C, 0, 32.0).admitted


def _offer(ctl: AdmissionController, rates: dict[Criticality, float], until: float, start: float = 0.0) -> None:
    """Each class's arrivals at its rate per second from ``start`` to ``until``, merged in time
    order (the fast estimates decay between them as on a real clock), each with an idle server
    (so each is admitted and only its arrival counts)."""
    times = sorted((start + i / rate, k) for k, rate in rates.items() for i in range(int((until - start) * rate)))
    for t, klass in times:
        ctl.decide(klass, 0, t)


# A batch above every cap (20, 16, 12): nothing waits for a slot, so nothing overtakes a request
# (`overtaken_caps`), and the room kept is reservation's alone; the same line, so the same caps.
WIDE = 32


def test_no_critical_traffic_reserves_nothing() -> None:
    ctl = controller(settings_=RESERVING, slots=WIDE)
    _offer(ctl, {S: 5.0}, 30.0)
    assert ctl.reserve(S, 30.0) == 0 and ctl.class_cap(S, 30.0) == 16  # the share's cap, as without it
    assert ctl.decide(S, 16, 30.0).limited_by == "share"  # refused by its share, kept for no one
    assert ctl.reserve(D, 30.0) == 0  # sheddable does not arrive: it costs standard nothing
    _offer(ctl, {S: 5.0, D: 8.0}, 60.0, start=30.0)  # now it does, and standard's own demand is kept from it
    assert ctl.reserve(D, 60.0) > 0 and ctl.class_cap(D, 60.0) < 12


def test_measured_critical_demand_keeps_room_below_critical_cap() -> None:
    from policies.admission import reserved_limits

    ctl = controller(settings_=RESERVING, slots=WIDE)
    _offer(ctl, {C: 8.0, S: 3.0}, 60.0)  # 8 critical/s and 3 standard/s, the server completes 10/s
    at = 60.5  # past the last computation's refresh
    rates = [a.peak(at) for a in ctl._arrivals]  # the larger of the long and the fast estimate
    assert rates[0] == pytest.approx(8.0, rel=0.2)
    limit = reserved_limits(rates, [20, 16, 12], ctl.model.latency_s, 0.01)[1]
    assert ctl.class_cap(S, at) == limit < 16 and ctl.reserve(S, at) == 16 - limit
    # standard refused where its share alone would still admit it; critical admitted there
    refused = ctl.decide(S, limit, at)
    assert not refused.admitted and refused.limited_by == "reserve"
    assert ctl.decide(S, 16, at).limited_by == "share"  # at its share's cap, the share alone refuses it
    assert ctl.decide(C, limit, at).admitted


def test_reserved_limits_are_recomputed_as_time_moves_not_on_every_decision() -> None:
    from policies.admission import RESERVE_REFRESH_S

    ctl = controller(settings_=RESERVING)
    _offer(ctl, {C: 8.0, S: 3.0}, 30.0)
    cap = ctl.class_cap(S, 30.0)
    assert cap < 16
    ctl._arrivals[0]._count = ctl._arrivals[0]._fast = 0.0  # critical demand gone at once (a probe)
    assert ctl.class_cap(S, 30.0 + RESERVE_REFRESH_S / 2) == cap  # within the refresh: as computed
    assert ctl.class_cap(S, 30.0 + RESERVE_REFRESH_S) == 16  # then from the rates as they are
    ctl._arrivals[0]._count = ctl._arrivals[0]._fast = 100.0
    ctl.set_level(1)  # a new service model recomputes at once
    assert ctl.class_cap(S, 30.0 + RESERVE_REFRESH_S) < 16


def test_reservation_fades_when_critical_demand_stops() -> None:
    ctl = controller(settings_=RESERVING)
    _offer(ctl, {C: 8.0, S: 3.0}, 30.0)
    assert ctl.class_cap(S, 30.0) < 16
    assert ctl.class_cap(S, 30.0 + 10 * 10.0) == 16  # ten time constants later


def test_room_kept_for_a_class_ends_once_its_arrivals_have_faded() -> None:
    """Where standard's cap equals critical's (here every share is 1), any critical rate above 0
    costs critical a share of its requests whatever standard does, so room is kept for it; the
    estimate never reaches 0, and without `ABSENT_WEIGHT` one slot stayed kept long after the
    last critical request (measured: 32 s of a standard-only run, 7 of its 16 refusals). Slow
    critical work (one request each 10 s) so that the weight, not the gap, ends it."""
    from policies.admission import ABSENT_WEIGHT

    equal = SloConfig(e2e_p99_ms=2100, class_share={"critical": 1.0, "standard": 1.0, "sheddable": 1.0})
    ctl = controller(slo=equal, settings_=RESERVING)
    assert ctl.max_admitted(S) == ctl.max_admitted(C) == 20
    _offer(ctl, {C: 0.1, S: 12.0}, 30.0)  # a little critical work (at 0, 10, 20 s) beside more standard than the server completes
    assert ctl.class_cap(S, 30.0) < 20  # room kept for it
    _offer(ctl, {S: 12.0}, 40.0, start=30.0)  # then standard alone: critical's weight 1.5 -> 0.2
    weight = ctl._arrivals[0].weight(40.0)
    assert ABSENT_WEIGHT < weight < 1.0 and ctl._arrivals[0].present(40.0)
    assert ctl.class_cap(S, 40.0) < 20  # faded, not yet gone: kept
    _offer(ctl, {S: 12.0}, 60.0, start=40.0)  # 20 s more: about 0.03 of a request, 4 of its gaps
    assert ctl._arrivals[0].weight(60.0) < ABSENT_WEIGHT and not ctl._arrivals[0].present(60.0)
    assert ctl.class_cap(S, 60.0) == 20 and ctl.reserve(S, 60.0) == 0  # its share's cap again
    ctl.decide(C, 0, 60.0)  # one critical request comes: room is kept again at once
    assert ctl.class_cap(S, 60.0 + 0.3) < 20


def test_a_class_that_arrived_fast_and_stopped_is_gone_after_ten_of_its_gaps() -> None:
    """Measured (12-06, AVX-512 Xeon): after the 1.5 x C0 mix (2.9 critical/s) critical's weight
    kept the ramp armed for 27 s of the standard-only run after it, and 57 of its 59 refusals
    fell there. The weight (about 29 at 3/s) takes a minute to fade; ten mean gaps at the rate
    measured at the last arrival end it in about 3.5 s, and the next critical request brings
    room and the ramp back at once."""
    from policies.admission import ABSENT_GAPS, ABSENT_WEIGHT

    equal = SloConfig(e2e_p99_ms=2100, class_share={"critical": 1.0, "standard": 1.0, "sheddable": 1.0})
    ctl = controller(slo=equal, settings_=RAMPING)
    _offer(ctl, {C: 3.0, S: 12.0}, 30.0)  # the last critical request at 29.67 s
    last = 29.0 + 2 / 3
    rate = min(ctl._arrivals[0].rate(last), ctl._arrivals[0].fast_rate(last))
    assert rate == pytest.approx(3.0, rel=0.1)
    gone = last + ABSENT_GAPS / rate
    assert ctl.ramp_limit(30.0) is not None and ctl.class_cap(S, 30.0) < 20  # room and the ramp while it arrives
    _offer(ctl, {S: 12.0}, gone - 0.2, start=30.0)
    assert ctl._arrivals[0].present(gone - 0.2) and ctl.ramp_limit(gone - 0.2) is not None
    _offer(ctl, {S: 12.0}, gone + 0.4, start=gone - 0.2)
    assert ctl._arrivals[0].weight(gone + 0.4) > 100 * ABSENT_WEIGHT  # the weight alone would keep it a minute more
    assert not ctl._arrivals[0].present(gone + 0.4)
    assert ctl.ramp_limit(gone + 0.4) is None and ctl.class_cap(S, gone + 0.4) == 20 and ctl.reserve(S, gone + 0.4) == 0
    ctl.decide(C, 0, gone + 0.4)  # it comes back: kept again at once
    assert ctl.ramp_limit(gone + 0.4) is not None and ctl.class_cap(S, gone + 0.7) < 20


@pytest.mark.parametrize(
    "arrivals, at, present",
    [
        ([], 0.0, False),  # never arrived
        ([0.0], 29.0, True),  # a lone arrival: weight 0.055, gap 29 s x 0.1/s = 2.9 gaps
        ([0.0], 31.0, False),  # its weight below 0.05 (about three time constants)
        ([i / 10 for i in range(100)], 10.8, True),  # 10/s for 10 s (lesser estimate 6.3/s): 1.5 s is 9.5 gaps
        ([i / 10 for i in range(100)], 11.6, False),  # 2.3 s: 14 gaps, the weight still 5
        # 10/s then 1/s for 10 s: the lesser (fast) estimate has followed it down, so a gap of
        # 3 s (a Poisson gap at 1/s exceeds it 5% of the time) is not taken for an end
        ([i / 10 for i in range(100)] + [10.0 + i for i in range(10)], 22.0, True),
    ],
)
def test_arrival_rate_present(arrivals: list[float], at: float, present: bool) -> None:
    from policies.admission import ArrivalRate

    r = ArrivalRate(tau_s=10.0)
    for t in arrivals:
        r.add(t)
    assert r.present(at) is present


def test_critical_demand_that_fills_the_server_shuts_the_others_out() -> None:
    ctl = controller(settings_=RESERVING)
    _offer(ctl, {C: 20.0}, 30.0)  # twice what the server completes
    assert ctl._arrivals[0].rate(30.0) >= ctl.rate_per_s
    assert ctl.class_cap(S, 30.0) == 0 and ctl.class_cap(D, 30.0) == 0
    refused = ctl.decide(S, 0, 30.0)  # even with nothing ahead: critical will take the slot
    assert not refused.admitted and refused.status == 429 and refused.retry_after_s >= 1
    assert refused.limited_by == "shut_out"
    assert ctl.decide(C, 0, 30.0).admitted


@pytest.mark.parametrize("with_reservation", [False, True])
def test_sheddable_is_shut_out_while_the_classes_above_alone_fill_the_server(with_reservation: bool) -> None:
    """Where caps are small, standard and sheddable both sit at the floor of 1 under overload and
    would be shed alike; while critical + standard alone arrive as fast as the server completes,
    sheddable gets nothing, and standard still gets an idle server."""
    ctl = controller(settings_=RESERVING if with_reservation else SETTINGS)
    rate = ctl.rate_per_s
    _offer(ctl, {C: 0.3 * rate, S: 0.9 * rate}, 30.0)  # together 1.2x the server
    assert ctl.class_cap(D, 30.0) == 0 and ctl.class_cap(S, 30.0) >= 1
    assert not ctl.decide(D, 0, 30.0).admitted and ctl.decide(S, 0, 30.0).admitted
    # once the classes above slow down (their rates decay), sheddable is admitted again
    assert ctl.class_cap(D, 30.0 + 5 * 10.0) >= 1


@pytest.mark.parametrize("rate, tau_s, sigmas, expected", [
    (0.0, 10.0, 1.0, 0.0),
    (0.5, 10.0, 1.0, 0.5 - math.sqrt(0.5 / 20.0)),  # a third of the estimate is noise
    (100.0, 10.0, 1.0, 100.0 - math.sqrt(100.0 / 20.0)),  # at high rates, little of it
    (0.5, 10.0, 0.0, 0.5),
    (0.01, 10.0, 1.0, 0.0),  # never below zero
])
def test_rate_lower_bound(rate: float, tau_s: float, sigmas: float, expected: float) -> None:
    from policies.admission import rate_lower_bound

    assert rate_lower_bound(rate, tau_s, sigmas) == pytest.approx(expected)


@pytest.mark.parametrize("over, shut", [(1.1, False), (1.2, False), (2.0, True), (3.0, True)])
def test_a_shut_out_needs_demand_over_the_server_beyond_the_noise_of_its_estimate(over: float, shut: bool) -> None:
    """At half a request a second (this machine's scale) the classes above arriving 10-20% faster
    than the server completes is within one standard deviation of their estimate: the class
    below keeps its floor; at twice the server it is shut out."""
    ctl = controller(settings_=RESERVING.model_copy(update={"prior_rate_per_s": 0.5}))
    rate = ctl.rate_per_s
    assert rate == pytest.approx(0.5)
    _offer(ctl, {C: over * rate}, 120.0)
    assert ctl._arrivals[0].rate(120.0) >= rate  # the plain estimate is over the server in every case
    assert (ctl.class_cap(S, 120.0) == 0) is shut
    assert (ctl.class_cap(D, 120.0) == 0) is shut


def test_shed_order_holds_with_reservation() -> None:
    ctl = controller(settings_=RESERVING)
    _offer(ctl, {C: 1.0, S: 3.0}, 20.0)
    caps = [ctl.class_cap(k, 20.0) for k in (C, S, D)]
    assert caps[0] >= caps[1] >= caps[2] >= 1


def _wait_ms(ctl: AdmissionController, counts: list[tuple[float, int]]) -> list[float]:
    return [ctl.signals(n, t)["predicted_wait_ms"] for t, n in counts]


def test_predicted_wait_averages_the_requests_in_flight_over_the_smoothing_time() -> None:
    ctl = controller(settings_=SETTINGS.model_copy(update={"wait_smoothing_s": 4.0}), slots=8)
    per_in_flight = 105.0  # 0.1 s per request ahead, on the 2.1 / 2.0 scale: the instant figure of one
    waits = _wait_ms(ctl, [(0.0, 0), (0.25, 2), (2.0, 2), (2.25, 0)])
    assert waits[0] == 0.0
    # two requests for a moment: far below the instant 210 ms
    assert waits[1] == pytest.approx(2 * (1 - math.exp(-0.25 / 4)) * per_in_flight, abs=0.1)
    assert waits[1] < waits[2] < 2 * per_in_flight
    assert waits[3] < waits[2]  # falls once they are gone
    # sustained, it reaches the instant figure
    t = 2.25
    while t < 40:
        t += 0.25
        ctl.signals(3, t)
    assert ctl.signals(3, t + 0.25)["predicted_wait_ms"] == pytest.approx(3 * per_in_flight, rel=0.01)


def test_unset_smoothing_is_twice_the_latency_alone_and_follows_the_model() -> None:
    slow = AdmissionConfig(overhead_ms=100, prior_rate_per_s=1.0, reserve_quantile=0.0)  # 1 s alone
    ctl = controller(settings_=slow, slots=8)
    assert slow.wait_smoothing_s is None
    assert ctl.wait_smoothing_s == pytest.approx(2 * ctl.model.latency_s(1)) == pytest.approx(2.0)
    t = 0.0
    for _ in range(20):  # served one at a time at 0.5 s: the model moves, and the time constant with it
        t += 1.0
        ctl.observe_completion(t, 0.5, 0.5)
    assert ctl.model.latency_s(1) == pytest.approx(0.5, rel=0.05)
    assert ctl.wait_smoothing_s == pytest.approx(2 * ctl.model.latency_s(1))
    assert controller(settings_=slow.model_copy(update={"wait_smoothing_s": 4.0})).wait_smoothing_s == 4.0
    assert controller(settings_=slow.model_copy(update={"wait_smoothing_s": 0.0})).wait_smoothing_s == 0.0


def test_unset_smoothing_tells_a_clump_from_a_step() -> None:
    """One request alone takes 1 s of a 4 s SLO; level 1's trigger is 35% of the SLO."""
    slo = SloConfig(e2e_p99_ms=4000, class_share=SPREAD)
    trigger_ms = 0.35 * slo.e2e_p99_ms

    def first_over(tau: float | None, counts: list[tuple[float, int]]) -> float | None:
        ctl = AdmissionController(slo, AdmissionConfig(overhead_ms=100, prior_rate_per_s=1.0, reserve_quantile=0.0,
                                                       wait_smoothing_s=tau), 8)
        times = [(t + dt, n) for t, n in counts for dt in (0.0, 0.25)]
        return next((t for (t, _), w in zip(times, _wait_ms(ctl, times)) if w >= trigger_ms), None)

    clump = [(0.0, 0), (0.5, 1), (1.0, 2), (2.0, 1), (3.0, 0)]  # two in flight for one latency alone
    step = [(0.0, 0), (0.5, 2), (1.0, 4), (1.5, 5), (2.0, 6), (2.5, 6)]  # overload
    assert first_over(0.0, clump) is not None  # the instant count would switch features off
    assert first_over(None, clump) is None  # two latencies alone: it does not
    assert first_over(None, step) == pytest.approx(1.25)
    assert first_over(4.0, step) == pytest.approx(1.75)  # the fixed 4 s before: half a second later


def test_predicted_wait_is_exactly_zero_soon_after_the_load_is_gone() -> None:
    ctl = controller()
    t = 0.0
    for _ in range(40):
        t += 0.25
        ctl.signals(5, t)
    zero_at = None
    while zero_at is None and t < 60:
        t += 0.25
        if ctl.signals(0, t)["predicted_wait_ms"] == 0.0:
            zero_at = t
    assert zero_at is not None and zero_at - 10.0 < 4.0 * math.log(5 / 0.01) + 0.5  # a few time constants


def test_the_first_report_and_a_repeated_instant_take_the_count_as_it_is() -> None:
    ctl = controller(settings_=SETTINGS.model_copy(update={"wait_smoothing_s": 4.0}), slots=8)
    assert ctl.signals(4, 10.0)["predicted_wait_ms"] == pytest.approx(4 * 105.0)
    assert ctl.signals(0, 10.0)["predicted_wait_ms"] == pytest.approx(4 * 105.0)  # no time passed: unchanged


# -- preemption of waiting work of lower classes (caps: critical 20, standard 16, sheddable 12) --

@pytest.mark.parametrize(
    "name, klass, ahead, preemptible, expected",
    [
        ("room at the door: nothing is preempted", C, 5, 3, (True, 0)),
        ("critical at the full door takes the place of one waiting request below it", C, 20, 1, (True, 1)),
        ("two over the cap: the fewest that make room, two", C, 21, 5, (True, 2)),
        ("nothing waiting below it: refused", C, 20, 0, (False, 0)),
        ("too few waiting below it to make room: refused, nobody is preempted", C, 22, 2, (False, 0)),
        ("standard at its share's cap takes a waiting sheddable request's place", S, 16, 1, (True, 1)),
        ("standard past the whole budget: still only the fewest", S, 20, 5, (True, 5)),
    ],
)
def test_preemption_table(name: str, klass: Criticality, ahead: int, preemptible: int, expected: tuple) -> None:
    d = controller().decide(klass, ahead, now=100.0, preemptible=preemptible)
    assert (d.admitted, d.preempt) == expected, name
    if d.preempt:  # admitted at the cap once the displaced requests are gone: within the budget
        assert d.predicted_e2e_s == pytest.approx(0.1 + d.max_admitted / 10)
        assert d.predicted_e2e_s <= 2.1 and d.deadline_at == pytest.approx(102.1)
    if not d.admitted:
        assert d.status in (429, 503) and d.retry_after_s >= 1


def test_preemption_can_be_switched_off() -> None:
    ctl = controller(settings_=SETTINGS.model_copy(update={"preempt_waiting": False}))
    d = ctl.decide(C, 20, now=1.0, preemptible=5)
    assert (d.admitted, d.reason, d.preempt) == (False, "saturated", 0)


def test_a_shut_out_class_preempts_nobody() -> None:
    ctl = controller(settings_=RESERVING)  # the server completes 10/s
    _offer(ctl, {C: 25.0}, 10.0)  # critical alone arrives at 2.5 x the server: standard is shut out
    assert ctl.class_cap(S, 10.0) == 0
    for ahead in (1, 4):  # even with every request ahead of it waiting and below it
        d = ctl.decide(S, ahead, 10.0, preemptible=ahead)
        assert not d.admitted and d.preempt == 0


def test_each_displaced_request_counts_as_a_refusal_for_the_level() -> None:
    ctl = controller()
    assert ctl.decide(C, 21, now=1.0, preemptible=2).preempt == 2
    # one admission, two refusals: the demand is past what this level serves
    assert ctl.signals(20, 1.0)["refused_ratio"] == pytest.approx(2 / 20)


@pytest.mark.parametrize("value", [-0.1, 1.1, "soon"])
def test_critical_wait_share_is_validated_naming_the_key(value: object) -> None:
    with pytest.raises(ValueError, match="critical_wait_share"):
        parse_policy({"slo": {"e2e_p99_ms": 2000}, "admission": {"critical_wait_share": value}})


@pytest.mark.parametrize("share, expected_s", [
    (0.5, 1.05),  # half the 2.1 s objective
    (1.0, 1.9),  # bounded where even an idle server (0.2 s predicted) would finish it late
    (0.0, 0.0),  # refused at once
])
def test_a_critical_request_waits_at_most_its_share_and_never_past_what_an_idle_server_could_still_finish(
        share: float, expected_s: float) -> None:
    ctl = controller(settings_=SETTINGS.model_copy(update={"critical_wait_share": share}))
    assert ctl.critical_wait_s() == pytest.approx(expected_s)


def test_a_slowdown_read_for_a_moment_is_waited_out_not_refused_at_once() -> None:
    ctl = controller()
    assert ctl.set_speed(8.0, 1.0)  # 6.4 applied: alone 0.74 s predicted, 0.1 s at the usual speed
    assert ctl.slowdown == pytest.approx(6.4)
    # the wait is bounded by the engine's usual speed (an idle server would finish it in time) ...
    assert ctl.critical_wait_s() == pytest.approx(1.05)
    # ... and a freed slot goes only to a request in time at the speed in force
    assert ctl.in_time_after(0.5, 1) and not ctl.in_time_after(0.5, 2)
    assert ctl.set_speed(1.0, 1.5) and ctl.in_time_after(0.5, 13)


@pytest.mark.parametrize("waited_s, ahead, in_time", [
    (0.0, 19, True),  # 2.1 s predicted: exactly the limit
    (0.05, 19, False),  # the same slot, after a wait: late
    (0.05, 18, True),  # one more freed: 0.05 + 2.0 s
    (1.0, 9, True),  # 1.0 + 1.1 s
    (1.0, 10, False),
    (1.9, 0, True),  # alone, at the end of the longest wait
    (1.95, 0, False),
])
def test_a_waiting_critical_request_takes_a_freed_slot_only_where_it_still_finishes_in_time(
        waited_s: float, ahead: int, in_time: bool) -> None:
    assert controller().in_time_after(waited_s, ahead) is in_time


def drained_fifo(model: ServiceModel, use_ahead: bool, held: int = 96, rate: float = 17.3,
                 seconds: float = 60.0, seed: int = 1) -> float:
    """A batching engine behind no door: 16 slots served first come first served, each request
    taking ``0.6 + 0.47 ln(b)`` s with ``b`` running (a full batch 1.9 s: 8.4 req/s), Poisson
    arrivals at ``rate`` while fewer than ``held`` are in flight, then the queue drains. Every
    completion goes to ``model`` (`ShareClock` shares; ``ahead`` when ``use_ahead``). Returns
    the true full-batch rate."""
    rng, share, slots, dt = random.Random(seed), ShareClock(), 16, 0.005

    def batch_latency(b: int) -> float:
        return 0.6 + 0.47 * math.log(max(1, b))

    t, arrive, n = 0.0, rng.expovariate(rate), 0
    queue: list[list[float]] = []  # [admitted, share mark, ahead, work done]
    running: list[list[float]] = []
    while t < seconds or queue or running:
        t += dt
        while arrive <= t and arrive < seconds:
            if n < held:
                n += 1
                queue.append([arrive, share.mark(arrive, n), n - 1, 0.0])
            arrive += rng.expovariate(rate)
        while queue and len(running) < slots:
            running.append(queue.pop(0))
        step = dt / batch_latency(len(running))
        for r in running:
            r[3] += step
        for r in [r for r in running if r[3] >= 1.0]:
            running.remove(r)
            n -= 1
            mark = share.mark(t, n)
            model.observe(t, t - r[0], mark - r[1], int(r[2]) if use_ahead else 0)
    return slots / batch_latency(slots)


def test_a_drained_queue_past_the_batch_does_not_read_as_a_slow_server() -> None:
    # Admission off under 2 x overload, then the load stops: the requests left in the last
    # seconds of the drain waited behind ~96, yet shared the server with few at the end
    with_ahead, without = ServiceModel(0.7, 0.06, slots=16), ServiceModel(0.7, 0.06, slots=16)
    true_rate = drained_fifo(with_ahead, use_ahead=True)
    drained_fifo(without, use_ahead=False)
    assert with_ahead.rate_per_s == pytest.approx(true_rate, rel=0.05)
    assert without.rate_per_s < 0.8 * true_rate  # the time average alone: a third too slow


def test_ahead_counts_only_past_the_batch() -> None:
    a, b = ServiceModel(1.0, 0.1, slots=16), ServiceModel(1.0, 0.1, slots=16)
    for t in range(5):  # within the batch the time average decides, whatever was ahead
        a.observe(float(t), 2.0, 0.5, ahead=15)
        b.observe(float(t), 2.0, 0.5, ahead=0)
    assert (a.base_s, a.per_request_s) == (b.base_s, b.per_request_s)
    c, d = ServiceModel(1.0, 0.1, slots=16), ServiceModel(1.0, 0.1, slots=16)
    c.observe(0.0, 6.0, 0.5, ahead=47)  # past it: shared with at least 48, a full batch in 2 s
    d.observe(0.0, 6.0, 0.5, ahead=0)  # shared with 12 on average: 6 s within the batch
    assert c.latency_s(16) == pytest.approx(2.0) and d.latency_s(12) == pytest.approx(6.0)


def test_latency_tail_is_the_lognormal_quantile_of_latency_over_its_prediction() -> None:
    from policies.admission import TAIL_MIN, TAIL_WINDOW, TAIL_Z, LatencyTail

    rng = random.Random(5)
    tail = LatencyTail()
    for _ in range(TAIL_MIN - 1):
        tail.add(math.exp(rng.gauss(0.0, 0.2)))
    assert tail.factor() == 1.0  # too few to measure a spread: no margin
    for _ in range(TAIL_WINDOW):
        tail.add(math.exp(rng.gauss(0.0, 0.2)))
    assert len(tail) == TAIL_WINDOW  # the window: older completions leave
    assert tail.factor() == pytest.approx(math.exp(TAIL_Z * 0.2), rel=0.1)  # 1.59
    for bad in (0.0, -1.0, math.inf, math.nan):
        tail.add(bad)  # ignored
    assert len(tail) == TAIL_WINDOW and tail.factor() == pytest.approx(math.exp(TAIL_Z * 0.2), rel=0.1)
    for _ in range(TAIL_WINDOW):  # the model is right every time now: no spread, no margin
        tail.add(1.0)
    assert tail.factor() == 1.0
    for _ in range(TAIL_WINDOW):  # a model that over-predicts gives no margin below 1
        tail.add(0.8)
    assert tail.factor() == 1.0


def test_latency_tail_is_robust_to_the_few_ratios_of_a_model_lagging_a_change_of_load() -> None:
    """Ten completions measured while the model still held the calm before an overload read 6 x
    its prediction: the model's error for a moment, not the engine's spread. A plain standard
    deviation would read a factor of about 3 from them for the whole window."""
    from policies.admission import TAIL_WINDOW, TAIL_Z, LatencyTail

    rng = random.Random(6)
    ratios = [6.0] * 10 + [math.exp(rng.gauss(0.0, 0.2)) for _ in range(TAIL_WINDOW - 10)]
    tail = LatencyTail()
    for r in ratios:
        tail.add(r)
    logs = [math.log(r) for r in ratios]
    plain = math.exp(statistics.mean(logs) + TAIL_Z * statistics.stdev(logs))
    assert plain > 2.5 and tail.factor() < 1.8


def _spread_completions(ctl: AdmissionController, sigma: float, until: float, seed: int = 7) -> None:
    """Served completions every 0.1 s up to ``until`` of a line 0.5 s alone, 0.1 s per request more,
    at 1-8 in flight, each latency off the line by a lognormal factor of log deviation ``sigma``."""
    rng, t, k = random.Random(seed), 0.0, 0
    while t < until:
        t, k = t + 0.1, k + 1
        m = 1 + k % 8
        latency = (0.5 + 0.1 * (m - 1)) * math.exp(rng.gauss(0.0, sigma))
        ctl.observe_completion(t, latency, latency / m)


def test_while_critical_work_arrives_the_classes_below_leave_it_room_at_its_tail() -> None:
    """Critical work is to be 99% within the SLO, the model predicts a mean, and on 2 cores a
    request's latency spreads to 1.6 x the median at its concurrency (12-04, AVX-512 EPYC): held
    to standard's cap at the mean, critical requests ran 2.01-2.35 s against a 2 s SLO. While
    critical work arrives, the classes below it are held to the concurrency at which the
    prediction times the measured 0.99 quantile meets critical's budget, while they all arrive
    fast enough to refill the door at that limit; with no critical work, the spread changes
    nothing."""
    ctl = controller(settings_=RESERVING, slots=WIDE)  # nothing waits for a slot: the tail's limit alone
    _spread_completions(ctl, 0.2, 30.0)
    factor = ctl.tail_factor
    assert 1.4 < factor < 1.8
    limit = ctl.tail_limit
    assert limit == ctl.model.max_within(ctl.budget_s / factor)
    assert 1 <= limit < ctl.max_admitted(S)
    refill = limit / ctl.model.latency_s(limit)  # completions per second with the door at the limit
    _offer(ctl, {S: 1.5 * refill}, 60.0, start=30.0)  # standard alone: its share's cap, the spread notwithstanding
    assert ctl.class_cap(S, 60.0) == ctl.max_admitted(S) and ctl.reserve(S, 60.0) == 0
    # critical work arrives, and sheddable: all together twice as fast as the door at the limit drains
    _offer(ctl, {C: 0.4 * refill, S: refill, D: 0.6 * refill}, 90.0, start=60.0)
    assert ctl.class_cap(S, 90.0) <= limit
    assert ctl.class_cap(D, 90.0) < ctl.class_cap(S, 90.0)  # room kept for standard within the limit: order holds
    assert ctl.overtaken_cap(S, 90.0) == ctl.max_admitted(S) and ctl.reserve(S, 90.0) >= ctl.max_admitted(S) - limit
    assert ctl.class_cap(C, 90.0) == ctl.max_admitted(C)  # critical's own cap is its share's
    refused = ctl.decide(S, limit, 90.0)
    assert not refused.admitted and refused.status == 429 and refused.limited_by == "reserve"
    assert ctl.decide(C, limit, 90.0).admitted


def test_the_tail_limit_holds_only_while_arrivals_refill_the_door_at_it() -> None:
    """Below the rate at which the door drains at the tail limit (``limit / latency_s(limit)``),
    it reaches the limit only in a clump of arrivals that drains before it is refilled, and a
    critical request does not run its life there: the classes below keep their caps (held to
    the limit at any load, sheddable work at 1.5 x C0 was 43-51% within the SLO against 76-94%
    without it, critical work 100% in both: 12-04, AVX-512 EPYC). The same mix arriving faster
    than that is held to it, and when it slows again the caps come back."""
    ctl = controller(settings_=RESERVING)
    _spread_completions(ctl, 0.2, 30.0)
    limit = ctl.tail_limit
    assert limit is not None and limit < ctl.max_admitted(S)
    refill = limit / ctl.model.latency_s(limit)
    mix = {C: 0.2, S: 0.5, D: 0.3}
    _offer(ctl, {k: 0.4 * refill * w for k, w in mix.items()}, 90.0, start=30.0)  # 0.4 x: clumps only
    calm = ctl.class_cap(S, 90.0)
    assert calm > limit and not ctl.tail_holds(90.0)
    assert ctl.decide(S, limit, 90.0).admitted  # one over the limit: standard still admitted
    _offer(ctl, {k: 2.5 * refill * w for k, w in mix.items()}, 150.0, start=90.0)  # 2.5 x: refilled
    assert ctl.tail_holds(150.0) and ctl.class_cap(S, 150.0) <= limit and ctl.class_cap(D, 150.0) <= limit
    assert ctl.decide(C, limit, 150.0).admitted  # critical's own cap is its share's
    _offer(ctl, {k: 0.4 * refill * w for k, w in mix.items()}, 300.0, start=150.0)  # slow again
    assert ctl.class_cap(S, 300.0) == calm


def test_no_spread_and_no_room_kept_leave_no_tail_limit() -> None:
    exact = controller(settings_=RESERVING)
    _spread_completions(exact, 0.0, 30.0)  # every latency on the line: (about) no margin
    assert exact.tail_factor == pytest.approx(1.0, abs=1e-3)
    assert exact.tail_limit == exact.max_admitted(C) >= exact.max_admitted(S)  # binds no class
    few = controller(settings_=RESERVING)
    _spread_completions(few, 0.2, 2.0)  # 20 completions measure no spread yet
    assert few.tail_limit is None and few.tail_factor == 1.0
    off = controller()  # reserve_quantile 0: no room kept for anyone, this limit included
    _spread_completions(off, 0.2, 30.0)
    _offer(off, {C: 1.0, S: 3.0}, 60.0, start=30.0)
    # only what overtakes standard past the batch lowers its cap (`overtaken_caps`), not the tail
    assert off.tail_limit is not None and off.class_cap(S, 60.0) == off.overtaken_cap(S, 60.0) > off.tail_limit


def test_within_the_tail_limit_standard_keeps_room_from_sheddable_where_their_shares_are_equal() -> None:
    """The shipped shares give standard and sheddable one cap (0.9 each); their order comes from
    the room standard keeps from sheddable. Sized after the tail limit cut both to it, both sat at
    the limit and were shed alike (measured once under oscillation: standard 21% shed, sheddable
    17%); sized within the limit, sheddable stays below standard."""
    shipped = SloConfig(e2e_p99_ms=2100, class_share={"critical": 1.0, "standard": 0.9, "sheddable": 0.9})
    ctl = controller(slo=shipped, settings_=RESERVING)
    _spread_completions(ctl, 0.2, 30.0)
    assert ctl.max_admitted(S) == ctl.max_admitted(D) > ctl.tail_limit
    refill = ctl.tail_limit / ctl.model.latency_s(ctl.tail_limit)  # arrivals refill the door at the limit
    _offer(ctl, {C: refill / 2, S: refill / 2, D: 1.5 * refill}, 60.0, start=30.0)
    assert ctl.class_cap(S, 60.0) == ctl.tail_limit
    assert ctl.class_cap(D, 60.0) < ctl.class_cap(S, 60.0)


def test_the_ramp_holds_the_classes_below_critical_to_a_step_above_the_concurrency_measured_lately() -> None:
    """Additive increase into concurrency the latency model has not measured lately
    (`ramp_limit`): while critical work arrives, standard and sheddable work are admitted to at
    most ``ramp_step`` (3) requests above the highest concurrency a served request ran at within
    the last `RAMP_WINDOW_S` (at least `RAMP_MIN`); critical work is never held to it; each
    completion higher up opens the next step; a lull as long as the window starts it again."""
    from policies.admission import RAMP_MIN, RAMP_WINDOW_S

    ctl = controller(settings_=RAMPING, slots=16)
    assert ctl.ramp_limit(0.0) is None and ctl.class_cap(S, 0.0) == 16  # no critical work: no ramp
    ctl.decide(C, 0, 0.0)
    assert ctl.measured_reach(0.0) == 0 and ctl.ramp_limit(0.0) == RAMP_MIN == ctl.class_cap(S, 0.0)
    for k in range(4):  # served at 3 in flight: 0.6 s of latency, 0.2 s of it its own share
        ctl.observe_completion(1.0 + 0.1 * k, 0.6, 0.2)
    at = 1.5
    assert ctl.measured_reach(at) == 3 and ctl.ramp_limit(at) == 6
    assert ctl.class_cap(S, at) == 6 < ctl.max_admitted(S) and ctl.class_cap(D, at) <= 6
    refused = ctl.decide(S, 6, at)
    assert not refused.admitted and refused.status == 429 and refused.limited_by == "ramp"
    assert refused.retry_after_s >= 1
    assert ctl.decide(S, 5, at).admitted
    assert ctl.decide(C, 6, at).admitted  # critical work goes past it
    ctl.observe_completion(2.0, 1.4, 0.2)  # one served at 7 in flight: 3 more, not twice as many
    assert ctl.ramp_limit(2.0) == 10
    later = 2.0 + RAMP_WINDOW_S + 0.5
    ctl.decide(C, 0, later)
    assert ctl.measured_reach(later) == 0 and ctl.ramp_limit(later) == RAMP_MIN  # a lull: start again
    assert controller(settings_=RESERVING).ramp_limit(later) is None  # ramp_step 0: none
    one = controller(settings_=RAMPING.model_copy(update={"ramp_step": 1}), slots=16)
    one.decide(C, 0, 0.0)
    one.observe_completion(1.0, 1.4, 0.2)  # served at 7 in flight
    assert one.ramp_limit(1.0) == 8
    off = controller(settings_=RAMPING.model_copy(update={"reserve_quantile": 0.0}))
    off.decide(C, 0, 0.0)
    assert off.ramp_limit(0.0) is None  # no room kept for critical work at all: nor this


def _ramped_to_six() -> tuple[AdmissionController, float, int]:
    """A door that served 3 in flight after critical work arrived: the ramp admits the classes
    below critical to 6 (the controller, the time, that cap)."""
    ctl = controller(settings_=RAMPING, slots=16)
    ctl.decide(C, 0, 0.0)
    for k in range(4):
        ctl.observe_completion(1.0 + 0.1 * k, 0.6, 0.2)
    at = 1.5
    cap = ctl.ramp_limit(at)
    assert cap == 6 and ctl.class_cap(S, at) == cap
    return ctl, at, cap


def test_a_ramp_refusal_counts_for_the_level_only_while_arrivals_press_the_ramp() -> None:
    """`ramp_pressed`: a clump that reaches the ramp at a few requests a second refuses its last
    arrival, but the refusal does not raise ``refused_ratio`` (measured: one such refusal raised
    level 2 at half the capacity); once all classes together arrive at least as fast as the
    door drains at the ramp's cap, its refusals count as any other. Other refusals count
    whatever the arrivals."""
    ctl, at, cap = _ramped_to_six()
    drain = cap / ctl.predictor.latency_s(cap)
    assert sum(a.fast_rate(at) for a in ctl._arrivals) < drain and not ctl.ramp_pressed(cap, at)
    clump = ctl.decide(S, cap, at)
    assert not clump.admitted and clump.limited_by == "ramp"
    assert ctl.signals(cap, at)["refused_ratio"] == 0.0  # a decision, not a refusal, for the level
    # demand that lasts: arrivals at twice that drain rate for two seconds (each admitted here)
    _offer(ctl, {C: 0.4 * drain, S: 1.6 * drain}, at + 3.0, start=at + 1.0)
    now = at + 3.0
    assert ctl.ramp_limit(now) == cap and ctl.ramp_pressed(cap, now)
    pressed = ctl.decide(S, cap, now)
    assert not pressed.admitted and pressed.limited_by == "ramp"
    decided = sum(b[1] for b in ctl._refusals._bins)
    assert ctl.signals(cap, now)["refused_ratio"] == pytest.approx(1 / max(decided, 20), abs=1e-4)
    # a refusal of the share counts at any rate of arrivals
    quiet = controller(slots=8)
    full = quiet.max_admitted(S)
    assert quiet.decide(S, full, 1.0).limited_by == "share"
    assert quiet.signals(full, 1.0)["refused_ratio"] == pytest.approx(1 / 20)


def test_a_request_displaced_where_the_ramp_filled_the_door_counts_only_while_arrivals_press_it() -> None:
    """Preemption at a door the ramp filled: a standard request takes the place of a waiting
    sheddable one (which is refused, 429 ``preempted``). Measured on 12-06: at half the capacity
    two such displacements read as refusals raised the level in the step profile's 0.5 x phase.
    Like the ramp's own refusals they count for the level only while arrivals press the ramp;
    a displacement where the class's share filled the door counts at any rate."""
    ctl, at, cap = _ramped_to_six()
    assert not ctl.ramp_pressed(cap, at)
    clump = ctl.decide(S, cap, at, preemptible=1)
    assert clump.admitted and clump.preempt == 1
    assert ctl.signals(cap, at)["refused_ratio"] == 0.0
    _offer(ctl, {C: 0.4 * cap / ctl.predictor.latency_s(cap), S: 1.6 * cap / ctl.predictor.latency_s(cap)},
           at + 3.0, start=at + 1.0)
    now = at + 3.0
    assert ctl.ramp_limit(now) == cap and ctl.ramp_pressed(cap, now)
    pressed = ctl.decide(S, cap, now, preemptible=1)
    assert pressed.admitted and pressed.preempt == 1
    decided = sum(b[1] for b in ctl._refusals._bins)
    assert ctl.signals(cap, now)["refused_ratio"] == pytest.approx(1 / max(decided, 20), abs=1e-4)
    # at the class's share (no ramp), a displacement counts whatever the arrivals
    quiet = controller(slots=8)
    full = quiet.max_admitted(S)
    assert quiet.decide(S, full, 1.0, preemptible=1).preempt == 1
    assert quiet.signals(full, 1.0)["refused_ratio"] == pytest.approx(1 / 20)


@pytest.mark.parametrize(("slots", "step"), [(1, 1), (4, 1), (16, 3), (64, 13), (256, 51)])
def test_unset_the_ramps_step_is_a_fifth_of_the_batch(slots: int, step: int) -> None:
    """Where the policy leaves ``admission.ramp_step`` unset, the step scales with this replica's
    batch (`RAMP_STEP_SHARE`, at least 1): 3 for the 16 sequences it was measured on, 51 for a
    GPU engine of 256, which then climbs from calm to its batch in about as many completions."""
    ctl = controller(settings_=RAMPING.model_copy(update={"ramp_step": None}), slots=slots)
    assert ctl.ramp_step == step
    ctl.decide(C, 0, 0.0)
    ctl.observe_completion(1.0, 1.4, 0.2)  # served at 7 in flight
    assert ctl.ramp_limit(1.0) == max(4, 7 + step)
    assert AdmissionConfig().ramp_step is None  # unset by default
    assert controller(settings_=RAMPING.model_copy(update={"ramp_step": 0}), slots=slots).ramp_step == 0


def test_in_a_knee_shaped_engine_the_ramp_keeps_critical_work_within_the_slo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The door's model (`bench/door_sim.py`) of the 2-core EPYC, whose latency grows by 0.11 s per
    request to 9 in flight and 0.41 s past it, at 7 req/s after a calm, 20% noise, eight seeds
    pooled: from a calm the door admitted standard and sheddable work up to the caps its line
    extrapolated (13-14 in flight in the first seconds) and critical requests ran late; with the
    ramp, fewer are late, and no fewer requests are served within the SLO. Adding 3 requests a
    step leaves fewer late than doubling (the ramp's first version), which takes the door past
    the knee within a completion or two, and serves no fewer (27 critical requests late and
    3.59 req/s within the SLO without a ramp, 13 and 3.80 doubling, 8 and 4.05 adding 3)."""
    from bench import door_sim
    from policies.admission import RAMP_MIN, AdmissionController

    def pooled(step: int) -> dict:
        setting = door_sim.Setting(shares=(1.0, 0.9, 0.9), ramp_step=step)
        return door_sim.summarize([door_sim.simulate(setting, 7.0, seed, shape="knee", noise=0.2, calm_s=60.0)
                                   for seed in range(1, 9)])

    without, ramp = pooled(0), pooled(3)
    assert ramp["critical_late"] < without["critical_late"], (ramp, without)
    assert ramp["goodput_rps"] >= without["goodput_rps"], (ramp, without)

    additive = AdmissionController.ramp_limit

    def doubling(self: AdmissionController, now: float) -> int | None:
        return None if additive(self, now) is None else max(RAMP_MIN, 2 * self.measured_reach(now))

    monkeypatch.setattr(AdmissionController, "ramp_limit", doubling)
    doubled = pooled(3)
    assert ramp["critical_late"] < doubled["critical_late"], (ramp, doubled)
    assert ramp["goodput_rps"] >= doubled["goodput_rps"], (ramp, doubled)


def test_in_the_doors_model_the_door_recovers_from_a_slow_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """The door's model of the 2-core EPYC at 2.3 req/s (1.5 x C0 there), the engine three
    times slower from 10 to 40 s into the load, eight seeds pooled: the requests sent after
    the slow phase are more often within the SLO where the model reads a changed machine
    (`ServiceModel.shift`) than where it does not (the line then kept a slope of both speeds
    and the door stayed low)."""
    from bench import door_sim

    def after(seed: int, slow: tuple[float, float, float] | None = (10.0, 40.0, 3.0)) -> dict:
        return door_sim.simulate(door_sim.Setting(shares=(1.0, 0.9, 0.9)), 2.3, seed, shape="knee", noise=0.2,
                                 calm_s=60.0, seconds=120.0, slow=slow)

    def within(runs: list[dict]) -> float:
        return door_sim.summarize(runs)["after_slow_within"]

    shifted = within([after(seed) for seed in range(1, 9)])
    monkeypatch.setattr(ServiceModel, "SHIFT_RATIO", math.inf)  # never a changed machine
    kept = within([after(seed) for seed in range(1, 9)])
    assert shifted >= kept + 0.05, (shifted, kept)
    # the simulator: a slow phase of factor 1 changes nothing
    plain, slow1 = after(1, None), after(1, (10.0, 40.0, 1.0))
    assert plain["counts"] == slow1["counts"] and plain["after_slow"]["offered"] == 0 < slow1["after_slow"]["offered"]
    with pytest.raises(SystemExit):
        door_sim.main(["--slow", "1,2"])


def test_in_the_doors_model_the_door_recovers_from_a_phase_ten_times_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, the engine ten times slower from 20 to 50 s (about what two busy processes
    beside the server did on 2 cores: no completion for half a minute, requests taking 10-30
    s): the line read across it stays steep, and only the bound of a request alone
    (`ServiceModel.alone_s`) lets the door climb from one in flight again."""
    from bench import door_sim

    def within() -> float:
        return door_sim.summarize([
            door_sim.simulate(door_sim.Setting(shares=(1.0, 0.9, 0.9)), 2.3, seed, shape="knee", noise=0.2,
                              calm_s=60.0, seconds=120.0, slow=(20.0, 50.0, 10.0))
            for seed in range(1, 9)])["after_slow_within"]

    bounded = within()
    monkeypatch.setattr(ServiceModel, "_realone", lambda self, now: setattr(self, "_alone_s", None))
    unbounded = within()
    assert bounded >= unbounded + 0.15, (bounded, unbounded)


# -- the engine's speed (`AdmissionController.set_speed`, `policies.engine_speed`) ------------


def served_slowed(ctl: AdmissionController, n: int, base: float, per: float, seconds: float, t0: float,
                  slowdown: float) -> float:
    """`served_at` on an engine ``slowdown`` times slower, each request's whole life within it."""
    latency = slowdown * (base + per * (n - 1))
    t = t0 + latency  # the first completion of requests admitted at t0
    while t < t0 + latency + seconds:
        ctl.observe_completion(t, latency, latency / n)
        t += slowdown * per
    return t


def test_speed_clock_gives_the_mean_slowdown_over_a_span() -> None:
    clock = SpeedClock()
    assert clock.value == 1.0 and clock.mean(0.0, 5.0) == 1.0  # 1 before any is set
    clock.set(10.0, 3.0)
    clock.set(20.0, 1.0)
    assert clock.value == 1.0
    assert clock.mean(9.0, 11.0) == pytest.approx(2.0)  # 1 s at 1, 1 s at 3
    assert clock.mean(12.0, 18.0) == pytest.approx(3.0)
    assert clock.mean(9.0, 21.0) == pytest.approx(32.0 / 12.0)
    assert clock.mean(15.0, 15.0) == 3.0  # an empty span: the value then
    assert (clock.value_at(5.0), clock.value_at(10.0), clock.value_at(25.0)) == (1.0, 3.0, 1.0)
    short = SpeedClock(keep_s=5.0)
    short.set(0.0, 2.0)
    short.set(10.0, 4.0)
    short.set(20.0, 1.0)  # the first breakpoint is forgotten: before the oldest kept, its value (2) holds
    assert short.mean(8.0, 9.0) == pytest.approx(2.0) and short.mean(12.0, 14.0) == pytest.approx(4.0)


@pytest.mark.parametrize("reading, slowdown", [
    (1.0, 1.0), (1.2, 1.0), (0.85, 1.0),  # within the margin (1.25): as usual
    (2.5, 2.0), (5.0, 4.0), (12.5, 10.0), (0.4, 0.5),  # past it: the reading less the margin
])
def test_a_slower_engine_lowers_the_caps_as_a_budget_that_much_smaller(reading: float, slowdown: float) -> None:
    ctl = controller()
    served_at(ctl, 4, base=0.3, per=0.1, seconds=15)
    ctl.set_speed(reading, 20.0)
    assert ctl.measured_slowdown == reading
    model = ctl.model
    for k in (C, S, D):
        assert ctl.max_admitted(k) == model.max_within(ctl.share(k) * ctl.budget_s / slowdown)
    assert ctl.predicted_e2e_s(3) == pytest.approx(0.1 + slowdown * model.latency_s(4))
    assert ctl.rate_per_s == pytest.approx(model.rate_per_s / slowdown)
    assert ctl.slowdown == pytest.approx(slowdown)


def test_a_slowdown_within_the_step_is_noise_and_changes_nothing() -> None:
    ctl = controller()
    assert not ctl.set_speed(1.2, 1.0) and ctl.slowdown == 1.0
    assert ctl.set_speed(1.5, 2.0) and ctl.slowdown == pytest.approx(1.2)
    assert not ctl.set_speed(1.55, 3.0) and ctl.slowdown == pytest.approx(1.2)  # 3% more: noise
    assert ctl.set_speed(float("inf"), 4.0) and ctl.slowdown == pytest.approx(80.0)  # clamped, less the margin
    assert not ctl.set_speed(float("nan"), 5.0) and ctl.slowdown == pytest.approx(80.0)


def test_a_reading_within_the_margin_ends_even_a_slowdown_smaller_than_the_step() -> None:
    ctl = controller()
    caps = [ctl.max_admitted(k) for k in Criticality]
    assert ctl.set_speed(1.5, 1.0) and ctl.slowdown == pytest.approx(1.2)
    assert ctl.set_speed(1.3, 2.0) and ctl.slowdown == pytest.approx(1.04)  # 13% less: applied
    assert ctl.set_speed(1.0, 3.0) and ctl.slowdown == 1.0  # 4% less, but back to 1: applied
    assert [ctl.max_admitted(k) for k in Criticality] == caps
    assert not ctl.set_speed(1.1, 4.0) and ctl.slowdown == 1.0  # within the margin: 1 already
    assert ctl.set_speed(1.0 / 1.5, 5.0) and ctl.slowdown == pytest.approx(1.0 / 1.2)  # the other way too
    assert ctl.set_speed(1.0 / 1.3, 6.0) and ctl.slowdown == pytest.approx(1.0 / 1.04)
    assert ctl.set_speed(0.9, 7.0) and ctl.slowdown == 1.0


def test_retry_after_grows_with_the_slowdown() -> None:
    ctl = controller()
    base = ctl.retry_after_s(30, ctl.max_admitted(S))
    ctl.set_speed(5.0, 1.0)
    assert ctl.retry_after_s(30, ctl.max_admitted(S)) > base


def test_completions_of_a_starved_engine_teach_the_model_its_usual_speed() -> None:
    usual, told, blind = controller(), controller(), controller()
    for ctl in (usual, told, blind):
        served_at(ctl, 4, base=0.3, per=0.1, seconds=15)
    told.set_speed(5.0 * 1.25, 20.0)  # applied: 5
    end = served_at(usual, 4, base=0.3, per=0.1, seconds=10, t0=20.0)
    served_slowed(told, 4, base=0.3, per=0.1, seconds=10 * 5.0, t0=20.0, slowdown=5.0)
    served_slowed(blind, 4, base=0.3, per=0.1, seconds=10 * 5.0, t0=20.0, slowdown=5.0)
    assert end > 20.0
    # told the slowdown: the model stays at the usual line and the prediction is five times it
    assert told.model.latency_s(4) == pytest.approx(usual.model.latency_s(4), rel=0.02)
    assert told.predicted_e2e_s(3) == pytest.approx(0.1 + 5.0 * usual.model.latency_s(4), rel=0.02)
    # not told: the model learned the slowness, which outlives it once the engine is fast again
    assert blind.model.latency_s(4) > 3.0 * usual.model.latency_s(4)
    told.set_speed(1.0, 80.0)  # the starvation ends: the usual caps at once
    assert [told.max_admitted(k) for k in (C, S, D)] == [usual.max_admitted(k) for k in (C, S, D)]


def test_a_completion_across_a_change_of_speed_is_divided_by_its_mean() -> None:
    ctl = controller(settings_=SETTINGS.model_copy(update={"rate_alpha": 1.0}))
    served_at(ctl, 1, base=0.5, per=0.1, seconds=10)
    ctl.set_speed(3.0 * 1.25, 100.0)  # applied: 3
    ctl.observe_completion(101.0, 2.0, 2.0)  # 1 s at 1 and 1 s at 3 in its life: 2 s at a mean of 2
    assert ctl.model.alone_s == pytest.approx(1.0)


def test_slowed_model_reads_the_model_slower() -> None:
    model = ServiceModel(0.5, 0.1, slots=8)
    slowed = SlowedModel(model, 2.0)
    assert slowed.latency_s(3) == pytest.approx(2.0 * model.latency_s(3))
    assert slowed.max_within(2.0) == model.max_within(1.0)
    assert slowed.rate_per_s == pytest.approx(model.rate_per_s / 2.0)


AT_MEAN = SETTINGS.model_copy(update={"overtake_sigmas": 0.0})  # the overtaking arrivals at their mean


@pytest.mark.parametrize("name, full_s, limit_s, above, expected", [
    ("nothing arrives above: the share's limit", 0.8, 1.6, 0.0, 1.6),
    ("above at half the server's rate: half the wait", 0.8, 1.6, 5.0, 1.2),
    ("above at a fifth: four fifths of the wait", 0.8, 1.8, 2.0, 1.6),
    ("above as fast as the server: no wait at all", 0.8, 1.6, 10.0, 0.8),
    ("above faster than the server: still a slot free now", 0.8, 1.6, 14.0, 0.8),
    ("a limit within the batch: unchanged (it starts at once)", 0.8, 0.6, 5.0, 0.6),
])
def test_overtaken_within_counts_the_slots_the_classes_above_take(
        name: str, full_s: float, limit_s: float, above: float, expected: float) -> None:
    from policies.admission import overtaken_within_s

    assert overtaken_within_s(full_s, limit_s, above, 10.0) == pytest.approx(expected), name


@pytest.mark.parametrize("name, above, sigmas, expected", [
    # full 0.8 s, limit 1.6 s (0.8 s of wait), 10 slots free per second
    ("at the mean: 4 of 8 slots overtaken, 4 in line", 5.0, 0.0, 1.2),
    ("one sd more: 4 + 2 overtaken, 2 in line", 5.0, 1.0, 1.0),
    ("two sd: 4 + 4 overtaken, none in line", 5.0, 2.0, 0.8),
    ("three sd: no wait at all, never below the batch", 5.0, 3.0, 0.8),
    ("nothing above: no margin either", 0.0, 1.0, 1.6),
    ("a fifth: 1.6 + 1.26 of the 8 freed slots overtaken", 2.0, 1.0, 0.8 + (8 - 1.6 - math.sqrt(1.6)) / 10),
])
def test_the_overtaking_arrivals_are_counted_with_their_noise(
        name: str, above: float, sigmas: float, expected: float) -> None:
    from policies.admission import overtaken_within_s

    assert overtaken_within_s(0.8, 1.6, above, 10.0, sigmas) == pytest.approx(expected), name


def test_a_lower_class_past_the_batch_counts_the_critical_work_that_starts_before_it() -> None:
    """vLLM's priority scheduler starts waiting critical requests before waiting standard ones.
    With a batch of 8 at 10 requests/s (0.8 s for a full batch) and critical work arriving at
    5/s, a standard request past the batch gets slots at 5/s, not 10/s: the k-th in line waits
    k / 5 s, so within standard's 1.6 s it may be at most 4 in line (12 in flight), not 8 (16)."""
    ctl = controller(settings_=AT_MEAN)  # no room kept, no ramp: the rule alone, at the mean
    assert [ctl.overtaken_cap(k, 0.0) for k in (C, S, D)] == [20, 16, 12]  # nothing arrives
    _offer(ctl, {C: 5.0}, 30.0)
    at = 30.1
    assert ctl.overtaken_cap(C, at) == ctl.class_cap(C, at) == 20  # critical's own cap is its share's
    cap = ctl.class_cap(S, at)
    assert cap == ctl.overtaken_cap(S, at) == 12
    full, lam, mu = ctl.model.latency_s(8), 5.0, ctl.rate_per_s
    assert full + (cap - 8) / (mu - lam) <= 1.6 + 1e-9 < full + (cap + 1 - 8) / (mu - lam)
    assert ctl.decide(S, cap - 1, at).admitted
    refused = ctl.decide(S, cap, at)
    assert not refused.admitted and refused.status == 429 and refused.limited_by == "overtaken"
    assert ctl.decide(S, 16, at).limited_by == "share"  # at its share's cap, the share alone
    assert ctl.decide(C, cap, at).admitted
    # sheddable: critical work and the standard work admitted both overtake it (1.2 s, 0.8 s in the batch)
    assert ctl.overtaken_cap(D, at) == ctl.model.max_within(0.8 + 0.4 * (1 - 5.0 / 10.0)) == 10
    # the shipped margin: critical arrivals at their mean plus one standard deviation; within 0.8 s
    # of wait 4 are expected, 4 + 2 counted, so standard may be 2 in line (10 in flight), not 4
    shipped = controller()
    _offer(shipped, {C: 5.0}, 30.0)
    assert shipped.settings.overtake_sigmas == 1.0 and shipped.overtaken_cap(S, at) == 10
    # not counted (null): the shares' caps, as before the rule
    off = controller(settings_=SETTINGS.model_copy(update={"overtake_sigmas": None}))
    _offer(off, {C: 5.0}, 30.0)
    assert [off.overtaken_cap(k, at) for k in (C, S, D)] == [20, 16, 12] and off.class_cap(S, at) == 16


def test_the_more_critical_work_arrives_the_less_lower_work_waits_behind_it() -> None:
    caps = []
    for rate in (0.0, 2.0, 4.0, 6.0, 8.0, 9.5):
        ctl = controller(settings_=AT_MEAN)
        _offer(ctl, {C: rate} if rate else {}, 30.0)
        caps.append(ctl.overtaken_cap(S, 30.1))
    assert caps == sorted(caps, reverse=True) and caps[0] == 16 and caps[-1] == 8  # down to the batch
    # within the batch a standard request starts at once: admitted however fast critical work arrives
    ctl = controller()
    _offer(ctl, {C: 9.0}, 30.0)
    assert ctl.decide(S, 7, 30.1).admitted


def test_retry_after_counts_the_slots_the_classes_above_take_while_the_backlog_drains() -> None:
    """A refused standard request fits again once ``ahead + 1 - cap`` more requests have finished
    than were admitted above it meanwhile: with critical work at about 5/s of the server's 10/s
    the backlog falls at about 5/s, not 10/s, so its Retry-After is longer; critical's is not."""
    shares_only = SETTINGS.model_copy(update={"overtake_sigmas": None})  # caps: the shares' (20, 16, 12)
    busy, idle = controller(settings_=shares_only), controller(settings_=shares_only)
    _offer(busy, {C: 5.0}, 30.0)
    at = 30.0
    above = busy.arriving_above(S.rank, at, "rate")  # the long estimate: 5 (1 - e^-3)
    assert 4.5 < above < 5.0 and busy.arriving_above(C.rank, at, "rate") == 0.0
    assert idle.decide(S, 30, at).retry_after_s == 2  # (30 + 1 - 16) / 10 = 1.5 -> 2
    assert busy.decide(S, 30, at).retry_after_s == math.ceil(15 / (10.0 - above)) == 3
    assert busy.decide(C, 30, at).retry_after_s == idle.decide(C, 30, at).retry_after_s == 2  # 11 / 10
    # sheddable: overtaken by critical work and by the standard work admitted (here none, refused)
    assert busy.arriving_above(D.rank, at, "rate") == busy.arriving_above(S.rank, at, "rate") > above
    # the classes above as fast as the server: the backlog does not fall, the longest Retry-After
    flooded = controller(settings_=shares_only)
    _offer(flooded, {C: 12.0}, 30.0)
    assert flooded.arriving_above(S.rank, at, "rate") > 10.0
    assert flooded.decide(S, 16, at).retry_after_s == SETTINGS.max_retry_after_s == 30
    assert flooded.decide(C, 20, at).retry_after_s == 1


def test_only_the_lower_classes_admitted_work_overtakes_not_what_was_refused() -> None:
    """Sheddable is overtaken by critical work and by the standard work that is admitted: standard
    requests refused at the door never reach the engine."""
    admitted, refused = controller(settings_=AT_MEAN), controller(settings_=AT_MEAN)
    for i in range(300):  # 30 s of standard work at 10/s: to an idle server, or to a full door
        admitted.decide(S, 0, i / 10.0)
        refused.decide(S, 16, i / 10.0)
    assert admitted.overtaken_cap(D, 30.0) == 8 < refused.overtaken_cap(D, 30.0) == 12
    assert refused.overtaken_cap(S, 30.0) == 16  # nothing above standard arrives


def test_the_overtaken_cap_is_counted_without_room_kept() -> None:
    """It is a prediction, not room kept: ``reserve_quantile`` 0 keeps no room and still counts it."""
    ctl = controller(settings_=SETTINGS.model_copy(update={"reserve_quantile": 0.0}))
    _offer(ctl, {C: 5.0}, 30.0)
    assert ctl.class_cap(S, 30.1) == ctl.overtaken_cap(S, 30.1) == 10 and ctl.reserve(S, 30.1) == 0
