"""Invariants of decide(), over random signal sequences and policies (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.config import parse_policy
from policies.controller import ControllerState, decide, force_feature, enabled_features, pin_level
from policies.signals import Signals


@st.composite
def policies(draw):  # type: ignore[no-untyped-def]
    t1 = draw(st.floats(2, 20))
    t2 = t1 + draw(st.floats(1, 20))
    t3 = t2 + draw(st.floats(1, 20))
    dwell = draw(st.floats(0.5, 30))
    cooldown = draw(st.floats(0, 30))
    esc = draw(st.floats(0, 3))
    lv = lambda t: {"trigger": {"queue_length": t}, "recover_dwell_s": dwell,  # noqa: E731
                    "cooldown_s": cooldown, "escalate_after_s": esc}
    window = draw(st.floats(0, 60))
    damping = {"window_s": window, "dwell_factor": draw(st.floats(1, 3)),
               "max_dwell_factor": draw(st.floats(1, 8)),
               "reset_after_s": window + draw(st.floats(1, 200))}
    return parse_policy({"level1": lv(t1), "level2": lv(t2), "level3": lv(t3), "flap_damping": damping})


def undamped(cfg):  # type: ignore[no-untyped-def]
    return cfg.model_copy(update={"flap_damping": cfg.flap_damping.model_copy(update={"dwell_factor": 1.0})})


@st.composite
def traces(draw):  # type: ignore[no-untyped-def]
    n = draw(st.integers(1, 80))
    gaps = draw(st.lists(st.floats(0.05, 5), min_size=n, max_size=n))
    values = draw(st.lists(st.one_of(st.floats(0, 80), st.none()), min_size=n, max_size=n))
    t, out = 0.0, []
    for gap, v in zip(gaps, values):
        t += gap
        out.append((t, v))
    return out


def replay(cfg, trace, state=None):  # type: ignore[no-untyped-def]
    state = state or ControllerState()
    history = []
    for t, v in trace:
        values = {} if v is None else {"queue_length": v}
        state, tr = decide(cfg, state, Signals(at=t, values=values), t)
        history.append((t, int(state.level), tr))
    return state, history


@settings(max_examples=300, deadline=None)
@given(cfg=policies(), trace=traces())
def test_never_more_than_one_level_down_per_dwell(cfg, trace) -> None:  # type: ignore[no-untyped-def]
    _, history = replay(cfg, trace)
    downs = [(t, tr) for t, _, tr in history if tr and tr.to_level < tr.from_level]
    for (_, tr) in downs:
        assert tr.from_level - tr.to_level == 1
    for (t_a, _), (t_b, _) in zip(downs, downs[1:]):
        assert t_b - t_a >= cfg.dwell_s(1) - 1e-9


@settings(max_examples=300, deadline=None)
@given(cfg=policies(), trace=traces())
def test_never_down_during_cooldown(cfg, trace) -> None:  # type: ignore[no-untyped-def]
    _, history = replay(cfg, trace)
    last_change = None
    for t, _, tr in history:
        if tr is None:
            continue
        if tr.to_level < tr.from_level and last_change is not None:
            assert t - last_change >= cfg.cooldown_s(1) - 1e-9
        last_change = t


@settings(max_examples=200, deadline=None)
@given(cfg=policies(), trace=traces(), value=st.floats(0, 80))
def test_constant_signals_converge_and_stay(cfg, trace, value) -> None:  # type: ignore[no-untyped-def]
    state, history = replay(cfg, trace)
    t = history[-1][0]
    # long enough for any escalation plus three full recoveries, each at the longest damped dwell
    longest_dwell = cfg.dwell_s(1) * cfg.flap_damping.max_dwell_factor
    horizon = 4 * (longest_dwell + cfg.cooldown_s(1) + cfg.escalate_after_s(1)) + 10
    step = max(0.5, horizon / 1000)
    steps = int(horizon / step) + 1
    levels = []
    for i in range(1, steps + 1):
        state, _ = decide(cfg, state, Signals(at=t + i * step, values={"queue_length": value}), t + i * step)
        levels.append(int(state.level))
    final = levels[-1]
    # once settled it never moves again
    tail = levels[-(int((longest_dwell + cfg.cooldown_s(1)) / step) + 2):]
    assert set(tail) == {final}
    # and it settled where the load says: at or above what the triggers call for,
    # and a level above that only if the load is not below its recover value
    from policies.controller import naive_level

    floor = int(naive_level(cfg, {"queue_length": value}))
    assert final >= floor
    if final > floor:
        assert value >= cfg.recover_thresholds(final)["queue_length"]


@settings(max_examples=200, deadline=None)
@given(cfg=policies(), trace=traces(), pin=st.integers(0, 3), ttl=st.floats(0.5, 50))
def test_level_pin_wins_until_it_expires(cfg, trace, pin, ttl) -> None:  # type: ignore[no-untyped-def]
    state, _ = pin_level(ControllerState(), pin, now=0.0, ttl_s=ttl)
    _, history = replay(cfg, trace, state)
    for t, level, _ in history:
        if t < ttl:
            assert level == pin


@settings(max_examples=200, deadline=None)
@given(cfg=policies(), trace=traces(), on=st.booleans(), ttl=st.floats(0.5, 50))
def test_feature_override_wins_until_it_expires(cfg, trace, on, ttl) -> None:  # type: ignore[no-untyped-def]
    state = force_feature(ControllerState(), "ab_test", on, now=0.0, ttl_s=ttl)
    for t, v in trace:
        state, _ = decide(cfg, state, Signals(at=t, values={} if v is None else {"queue_length": v}), t)
        if t < ttl:
            assert ("ab_test" in enabled_features(cfg, state, t)) == on


@settings(max_examples=300, deadline=None)
@given(cfg=policies(), trace=traces())
def test_flap_damping_never_sheds_less_than_the_undamped_rule(cfg, trace) -> None:  # type: ignore[no-untyped-def]
    """Damping only delays steps down: from the same state and signals, the damped decision's
    level is never below the undamped rule's.

    (Compared tick by tick from one shared history, not as two separate runs: an undamped run
    that flaps restarts its own cooldown on each re-escalation, and a cooldown longer than the
    damped dwell can then hold it up while the damped run, which did not flap, steps down. That
    is the cooldown's doing, not a step the damping took early.)
    """
    state, plain_cfg = ControllerState(), undamped(cfg)
    for t, v in trace:
        signals = Signals(at=t, values={} if v is None else {"queue_length": v})
        plain, _ = decide(plain_cfg, state, signals, t)
        state, _ = decide(cfg, state, signals, t)
        assert state.level >= plain.level, t


@settings(max_examples=300, deadline=None)
@given(cfg=policies(), trace=traces())
def test_every_step_down_waits_the_damped_dwell(cfg, trace) -> None:  # type: ignore[no-untyped-def]
    """A step down comes only after an unbroken calm of dwell * factor(flaps), never sooner."""
    state = ControllerState()
    for t, v in trace:
        before = state
        values = {} if v is None else {"queue_length": v}
        state, tr = decide(cfg, state, Signals(at=t, values=values), t)
        if tr is not None and tr.to_level < tr.from_level:
            flaps = before.flaps
            if before.last_escalate_at is not None and t - before.last_escalate_at >= cfg.flap_damping.reset_after_s:
                flaps = 0
            assert before.calm_since is not None
            needed = cfg.dwell_s(int(tr.from_level)) * cfg.flap_damping.factor(flaps)
            assert t - before.calm_since >= needed - 1e-9
            assert cfg.flap_damping.factor(flaps) <= cfg.flap_damping.max_dwell_factor


@settings(max_examples=200, deadline=None)
@given(cfg=policies(), trace=traces())
def test_without_flaps_damping_changes_nothing(cfg, trace) -> None:  # type: ignore[no-untyped-def]
    """A window of 0 s can never see a flap: the damped run is the undamped run."""
    no_window = cfg.model_copy(update={"flap_damping": cfg.flap_damping.model_copy(update={"window_s": 0.0})})
    _, a = replay(no_window, trace)
    _, b = replay(undamped(cfg), trace)
    assert [lv for _, lv, _ in a] == [lv for _, lv, _ in b]
