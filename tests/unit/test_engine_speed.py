"""policies/engine_speed.py: how much slower the engine steps now than lately, step by step."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.engine_speed import (
    MIN_STEPS,
    REF_STEPS,
    SETTLE_RATIO,
    STALL_MARGIN,
    STALL_STEPS,
    EngineSpeed,
    prompt_from,
    settle,
    step_key,
    weighted_median,
)

STEP_S = 0.05  # a decode step of the batch below, at the engine's usual speed


def run(speed: EngineSpeed, t: float, seconds: float, step_s: float = STEP_S, batch: int = 4,
        prompt_tokens: int = 0) -> float:
    """Steps of ``step_s`` back to back for ``seconds``; returns the time after the last."""
    end = t + seconds
    while t + step_s <= end + 1e-9:
        t += step_s
        speed.observe(t, [step_s] * batch, prompt_tokens)
    return t


def warm() -> tuple[EngineSpeed, float]:
    speed = EngineSpeed()
    return speed, run(speed, 0.0, 20.0)  # 400 steps: the reference is the usual step


def test_steps_at_the_usual_speed_read_one() -> None:
    speed, t = warm()
    assert speed.slowdown(t) == pytest.approx(1.0)
    assert speed.state(t) == {"slowdown": 1.0, "window_steps": 20, "steps": 400, "keys": 1, "since_step_s": 0.0}


def test_a_starved_engine_reads_its_slowdown_within_a_step_and_the_end_of_it_at_once() -> None:
    speed, t = warm()
    t = run(speed, t, 0.5, step_s=10 * STEP_S)  # one step, ten times as long: half the last second
    assert speed.slowdown(t) == pytest.approx(10.0)
    t = run(speed, t, 10.0, step_s=10 * STEP_S)  # the reference keeps the usual speed meanwhile
    assert speed.slowdown(t) == pytest.approx(10.0)
    t = run(speed, t, 0.55)  # fast steps again: more than half the last second's time
    assert speed.slowdown(t) == pytest.approx(1.0)


def test_forty_times_slower_rests_on_the_latest_steps_when_the_window_holds_too_few() -> None:
    speed, t = warm()
    t = run(speed, t, 3 * 40 * STEP_S, step_s=40 * STEP_S)  # 2 s steps: none else in the last second
    assert speed.state(t)["window_steps"] == MIN_STEPS
    assert speed.slowdown(t) == pytest.approx(40.0)


def test_an_outlying_step_moves_nothing() -> None:
    speed, t = warm()
    t += 0.3
    speed.observe(t, [0.3] * 4)  # a garbage collection: one step six times as long, 0.3 of the last second
    assert speed.slowdown(t) == pytest.approx(1.0)


def test_a_long_slow_step_is_ended_by_two_usual_steps_after_it_not_by_the_window() -> None:
    speed, t = warm()
    t += 0.9
    speed.observe(t, [0.9] * 4)  # one step 18 times as long: most of the last second's time
    assert speed.slowdown(t) == pytest.approx(18.0)  # read at once, as a starvation's first step
    t = run(speed, t, STEP_S)
    assert speed.slowdown(t) == pytest.approx(18.0)  # one usual step after it is not enough
    t = run(speed, t, STEP_S)
    # two: the engine steps at its usual speed, where the window alone (0.9 s of the slow step
    # against 0.15 s of usual ones) would read 18 for most of another second
    assert speed.slowdown(t) == pytest.approx(1.0)


def test_a_starvation_whose_steps_vary_reads_on() -> None:
    speed, t = warm()
    for i in range(12):  # 8 and 12 times slower in turn: no two in a row 1.25 x below the reading
        t += (8 if i % 2 else 12) * STEP_S
        speed.observe(t, [(8 if i % 2 else 12) * STEP_S] * 4)
        assert speed.slowdown(t) >= 8.0 - 1e-9
    t = run(speed, t, 2 * STEP_S)  # then two usual steps: over
    assert speed.slowdown(t) == pytest.approx(1.0)


L2, L15 = math.log(2.0), math.log(1.5)


@pytest.mark.parametrize("reading, newest, before, settled", [
    (0.0, 0.0, 0.0, 0.0),
    (L2, 0.0, 0.0, 0.0),  # two usual steps after a 2 x reading end it
    (L2, L2, 0.0, L2),  # the newest step as slow as the reading: it stands
    (L2, 0.0, L2, L2),  # only one usual step since the slow one
    (L2, L15, 0.1, L15),  # both 1.25 x below it: the slower of the two
    (L2, math.log(2.0 / SETTLE_RATIO) + 0.01, 0.0, L2),  # not quite 1.25 x below: the window decides
    (L2, -0.3, -0.2, 0.0),  # faster steps end a slow reading at 1, not below it
    (-L2, 0.0, -0.1, -0.1),  # and the same the other way
    (-L2, 0.3, 0.0, 0.0),
    (-L2, -L2, 0.0, -L2),
])
def test_settle(reading: float, newest: float, before: float, settled: float) -> None:
    assert settle(reading, newest, before) == pytest.approx(settled)


@pytest.mark.parametrize("batch, prompt_tokens, step_s", [
    (8, 0, 2 * STEP_S),  # a larger batch steps slower: compared with its own kind
    (4, 512, 6 * STEP_S),  # a step that prefilled 512 tokens beside the decodes
    (1, 0, 0.6 * STEP_S),
])
def test_a_step_is_compared_with_steps_like_it(batch: int, prompt_tokens: int, step_s: float) -> None:
    speed, t = warm()
    t = run(speed, t, 10.0, step_s=step_s, batch=batch, prompt_tokens=prompt_tokens)
    assert speed.slowdown(t) == pytest.approx(1.0)  # new keys measure from where they are
    assert speed.state(t)["keys"] == 2
    t = run(speed, t, 2.0, step_s=3 * step_s, batch=batch, prompt_tokens=prompt_tokens)
    assert speed.slowdown(t) == pytest.approx(3.0, rel=1e-3)


def test_a_kind_of_step_first_seen_while_starved_agrees_with_the_others() -> None:
    speed, t = warm()
    t = run(speed, t, 2.0, step_s=4 * STEP_S)
    t = run(speed, t, 2.0, step_s=4 * 2 * STEP_S, batch=9)  # a batch never seen, also four times slower
    assert speed.slowdown(t) == pytest.approx(4.0)
    t = run(speed, t, 2.0, step_s=2 * STEP_S, batch=9)  # then at its usual speed (its reference: 2 x STEP_S)
    assert speed.slowdown(t) == pytest.approx(1.0)


def test_slow_drift_within_the_hold_ratio_is_absorbed_into_the_reference() -> None:
    speed, t = warm()
    t = run(speed, t, 1.0, step_s=1.5 * STEP_S)
    assert speed.slowdown(t) == pytest.approx(1.5, rel=0.02)  # learning it already, a step in 200
    t = run(speed, t, 4 * REF_STEPS * 1.5 * STEP_S, step_s=1.5 * STEP_S)  # a slower machine, for good
    assert speed.slowdown(t) < 1.05  # the admission model learns it from completions from here on


def test_an_idle_engine_lets_a_reading_fade_towards_one() -> None:
    speed, t = warm()
    t = run(speed, t, 2.0, step_s=10 * STEP_S)
    assert speed.slowdown(t) == pytest.approx(10.0)
    # nothing steps: the reading holds while its steps are fresh, then fades with idle_tau_s (10 s)
    assert speed.slowdown(t + 5.0) == pytest.approx(10.0)
    fade = speed.slowdown(t + 5.1 + 10.0)
    assert fade == pytest.approx(10.0 ** math.exp(-10.0 / 10.0), rel=0.02)
    assert speed.slowdown(t + 200.0) == pytest.approx(1.0, abs=1e-6)


def test_before_any_step_and_on_steps_where_nothing_decoded_it_reads_one() -> None:
    speed = EngineSpeed()
    assert speed.slowdown(0.0) == 1.0
    speed.observe(1.0, [], 512)  # a prefill only: no inter-token latency
    speed.observe(1.1, [0.0, float("nan")], 0)
    assert speed.steps == 0 and speed.slowdown(1.1) == 1.0


def test_the_slowdown_is_clamped() -> None:
    speed, t = warm()
    t = run(speed, t, 3 * 150 * STEP_S, step_s=150 * STEP_S)
    assert speed.slowdown(t) == pytest.approx(100.0)
    speed2, t2 = warm()
    t2 = run(speed2, t2, 1.0, step_s=0.1 * STEP_S)
    assert speed2.slowdown(t2) == pytest.approx(0.25)


@pytest.mark.parametrize("kwargs, text", [
    ({"window_s": 0}, r"window_s=0"),
    ({"window_s": 10, "stale_s": 5}, r"0 < window_s <= stale_s.*window_s=10.*stale_s=5"),
    ({"hold_ratio": 1.0}, r"hold_ratio=1\.0"),
    ({"min_slowdown": 2.0}, r"min_slowdown=2\.0"),
])
def test_bad_settings_name_the_value(kwargs: dict, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        EngineSpeed(**kwargs)


@pytest.mark.parametrize("pairs, median", [
    ([(1.0, 1.0)], 1.0),
    ([(1.0, 1.0), (2.0, 1.0)], 1.0),  # the lower median at a tie
    ([(1.0, 1.0), (2.0, 3.0)], 2.0),  # the weight decides, not the count
    ([(3.0, 0.5), (0.0, 0.1), (0.0, 0.1), (0.0, 0.1)], 3.0),
])
def test_weighted_median(pairs: list, median: float) -> None:
    assert weighted_median(pairs) == median


@pytest.mark.parametrize("batch, prompt_tokens, key", [(4, 0, (4, 0)), (4, 1, (4, 1)), (4, 2, (4, 5)),
                                                        (4, 128, (4, 29)), (4, 152, (4, 29)), (4, 153, (4, 30)),
                                                        (4, 512, (4, 37)), (4, 513, (4, 37)), (16, 1024, (16, 41))])
def test_step_key(batch: int, prompt_tokens: int, key: tuple) -> None:
    assert step_key(batch, prompt_tokens) == key


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 100_000))
def test_a_prompt_kind_spans_less_than_the_doors_margin(tokens: int) -> None:
    """Steps compared with one reference prefilled within 2 ** 0.25 = 1.19 x of each other (whole
    powers of two left 2 x: a prefill of 250 against references of about 130 read 1.3-2.1 x slower
    with the engine as fast as ever, 12-06); `prompt_from` is each kind's fewest tokens."""
    kind = step_key(1, tokens)[1]
    assert prompt_from(kind) <= tokens < prompt_from(kind + 1)
    assert prompt_from(kind + 1) - 1 <= SETTLE_RATIO * prompt_from(kind) or prompt_from(kind) < 8
    assert step_key(1, 0) == (1, 0) and prompt_from(0) == 0


@settings(max_examples=60, deadline=None)
@given(factor=st.one_of(st.floats(0.26, 0.49), st.floats(2.01, 90.0)), batch=st.integers(1, 16))
def test_any_slowdown_past_the_hold_ratio_is_read_as_itself(factor: float, batch: int) -> None:
    speed = EngineSpeed()
    t = run(speed, 0.0, 20.0, batch=batch)
    t = run(speed, t, max(2.0, 3 * factor * STEP_S), step_s=factor * STEP_S, batch=batch)
    assert speed.slowdown(t) == pytest.approx(factor, rel=1e-6)


def test_a_stall_while_busy_reads_as_its_length_over_a_margin_of_the_longest_usual_step() -> None:
    speed, t = warm()  # the usual decode step: 0.05 s
    t = run(speed, t, 2.0, step_s=0.4, batch=1, prompt_tokens=2000)  # and long prefills: 0.4 s each
    t = run(speed, t, 1.0)
    busy = t - 30.0  # busy all along
    stall_s = STALL_MARGIN * 0.4  # past this without a step: a stall
    assert speed.slowdown(t, busy) == pytest.approx(1.0)
    # no step for a little less than that: a hiccup, not a stall
    assert speed.slowdown(t + 0.9 * stall_s, busy) == pytest.approx(1.0)
    # no step for five times that while busy: at least five times slower
    assert speed.slowdown(t + 5 * stall_s, busy) == pytest.approx(5.0, rel=1e-6)
    assert speed.slowdown(t + 5 * stall_s, None) == pytest.approx(1.0)  # idle: nothing to step
    # idle, then work at t + 0.5 and no step since: counted from when the work came. Its first
    # request's prefill, alone, has no reference, but takes far less than ten usual steps
    assert speed.slowdown(t + 0.5 + 0.9 * stall_s, t + 0.5) == pytest.approx(1.0)
    assert speed.slowdown(t + 0.5 + 5 * stall_s, t + 0.5) == pytest.approx(5.0, rel=1e-6)
    speed.observe(t + 4.2, [], 30)  # that prefill's first token: from here a time without a step counts
    assert speed.slowdown(t + 4.2 + 0.9 * stall_s, t + 0.5) == pytest.approx(1.0)
    assert speed.slowdown(t + 4.2 + 5 * stall_s, t + 0.5) == pytest.approx(5.0, rel=1e-6)
    t = t + 4.2
    assert speed.state(t + 4.0, busy)["since_step_s"] == pytest.approx(4.0)
    speed.observe(t + 4.0, [], 30)  # a prefill-only output: progress, the stall is over
    assert speed.slowdown(t + 4.1, busy) == pytest.approx(1.0)
    # the stall's step, when it ends, is a reading of its own (long, weighted by its time)
    speed.observe(t + 8.0, [3.9] * 4)
    assert speed.slowdown(t + 8.0, busy) == pytest.approx(3.9 / STEP_S)
    assert speed.slowdown(t + 10000.0, busy) == pytest.approx(100.0)  # clamped


def test_before_any_step_a_busy_engine_reads_one() -> None:
    assert EngineSpeed().slowdown(5.0, 0.0) == 1.0


def test_a_fresh_engine_reads_no_stall_before_it_has_stepped_enough() -> None:
    speed = EngineSpeed()
    t = run(speed, 0.0, (STALL_STEPS - 1) * STEP_S)  # one step short
    assert speed.steps == STALL_STEPS - 1
    gap_s = 3 * STALL_MARGIN * STEP_S
    assert speed.slowdown(t + gap_s, 0.0) == pytest.approx(1.0)  # no step for long: not yet read as a stall
    t = run(speed, t, STEP_S)
    assert speed.slowdown(t + gap_s, 0.0) == pytest.approx(3.0)


def test_the_window_says_which_kinds_of_step_a_reading_rests_on() -> None:
    speed, t = warm()  # decodes of 4 at 50 ms: the reference of (4, no prefill)
    t = run(speed, t, 2.0, step_s=0.1, batch=2, prompt_tokens=300)  # a kind of its own: its reference
    t = run(speed, t, 2.0)  # the usual decodes, as usual
    t = run(speed, t, 0.66, step_s=0.33, batch=2, prompt_tokens=300)  # that kind now 3.3 times slower
    assert speed.window(t) == [
        {"batch": 2, "prompt_from": 256, "steps": 2, "time_s": 0.66, "ratio": 3.3, "ref_ms": 100.0},
        {"batch": 4, "prompt_from": 0, "steps": 7, "time_s": 0.35, "ratio": 1.0, "ref_ms": 50.0},
    ]
    assert speed.slowdown(t) == pytest.approx(3.3)  # the slow kind holds more than half the time
    assert EngineSpeed().window(0.0) == []  # nothing observed: nothing to rest on


def test_the_window_weighs_a_kinds_steps_by_their_time_as_the_reading_does() -> None:
    speed, t = warm()
    t = run(speed, t, 0.6, step_s=0.6)  # one step of 0.6 s, twelve times the usual, after 0.4 s of usual ones
    (kind,) = speed.window(t)
    assert kind["steps"] == 9 and kind["time_s"] == pytest.approx(1.0)
    assert kind["ratio"] == pytest.approx(12.0)  # the plain median of the nine would say 1
    assert speed.slowdown(t) == pytest.approx(12.0)
