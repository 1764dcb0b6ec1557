"""decide(): stepped tick by tick with explicit times, as Ray's autoscaling-policy tests do."""

from __future__ import annotations

import json

import pytest

from policies.config import parse_policy
from policies.controller import (
    ControllerState,
    clear_feature,
    decide,
    enabled_features,
    force_feature,
    naive_level,
    pin_level,
    unpin,
)
from policies.features import Level
from policies.signals import Signals

# One signal, clear numbers: level k triggers at queue 10k, recovers below 10k - 5.
CFG = parse_policy(
    {
        "level1": {"trigger": {"queue_length": 10}, "recover": {"queue_length": 5},
                   "recover_dwell_s": 10, "cooldown_s": 4, "disable": ["debug_capture"]},
        "level2": {"trigger": {"queue_length": 20}, "recover": {"queue_length": 15},
                   "recover_dwell_s": 10, "cooldown_s": 4, "disable": ["ab_test"]},
        "level3": {"trigger": {"queue_length": 30}, "recover": {"queue_length": 25},
                   "recover_dwell_s": 10, "cooldown_s": 4, "disable": ["all_non_critical"]},
    }
)


def snap(t: float, q: float | None = None, stale: tuple[str, ...] = ()) -> Signals:
    values = {} if q is None else {"queue_length": float(q)}
    return Signals(at=t, values=values, stale=frozenset(stale), sources=1)


def run(cfg, steps, state=None):  # type: ignore[no-untyped-def]
    state = state or ControllerState()
    levels, transitions = [], []
    for t, q in steps:
        state, tr = decide(cfg, state, snap(t, q), t)
        levels.append(int(state.level))
        if tr:
            transitions.append(tr)
    return state, levels, transitions


@pytest.mark.parametrize(
    "name, steps, expected",
    [
        ("quiet stays normal", [(0, 0), (1, 9.9), (2, 3)], [0, 0, 0]),
        ("threshold reached is a trigger (>=)", [(0, 10)], [1]),
        ("jumps several levels at once", [(0, 0), (1, 35)], [0, 3]),
        (
            "recovers one level per dwell, never two",
            # calm from t=1: steps at 11, 21, 31; each step starts the next dwell
            [(0, 35), (1, 0), (11, 0), (12, 0), (20.9, 0), (21, 0), (30.9, 0), (31, 0), (50, 0)],
            [3, 3, 2, 2, 2, 1, 1, 0, 0],
        ),
        (
            "dead band holds the level",
            [(0, 12), (1, 7), (20, 9), (40, 6), (60, 5.5)],
            [1, 1, 1, 1, 1],
        ),
        (
            "interrupted dwell restarts",
            # calm from t=1; a crossing at t=8 (6 >= recover 5) breaks it; calm again from t=9
            [(0, 12), (1, 2), (8, 6), (9, 2), (18, 2), (19, 2)],
            [1, 1, 1, 1, 1, 0],
        ),
        (
            "re-escalation during recovery is immediate",
            [(0, 25), (1, 0), (11, 0), (11.5, 26)],
            [2, 2, 1, 2],
        ),
        ("missing signal neither triggers nor blocks", [(0, 12), (1, None), (11, None)], [1, 1, 0]),
    ],
)
def test_sequences(name: str, steps: list, expected: list[int]) -> None:
    _, levels, _ = run(CFG, steps)
    assert levels == expected, name


def test_cooldown_delays_recovery_after_a_change() -> None:
    cfg = parse_policy({"level1": {"trigger": {"queue_length": 10}, "recover_dwell_s": 1, "cooldown_s": 30}})
    _, levels, _ = run(cfg, [(0, 12), (1, 0), (5, 0), (29, 0), (30, 0)])
    assert levels == [1, 1, 1, 1, 0]


def test_escalate_after_s_needs_an_unbroken_hold() -> None:
    cfg = parse_policy({"level1": {"trigger": {"queue_length": 10}, "escalate_after_s": 3}})
    _, levels, _ = run(cfg, [(0, 11), (2, 11), (2.5, 0), (3, 11), (5.9, 11), (6, 11)])
    assert levels == [0, 0, 0, 0, 0, 1]


def test_stale_signal_blocks_recovery_but_not_escalation() -> None:
    state, _, _ = run(CFG, [(0, 12)])
    for t in (1, 5, 20, 40):
        state, tr = decide(CFG, state, snap(t, 0, stale=("queue_length",)), t)
        assert state.level == 1 and tr is None
    assert state.recovery_blocked_by == {"queue_length"}
    state, tr = decide(CFG, state, snap(41, 40, stale=("queue_length",)), 41)
    assert state.level == 3 and tr is not None


def test_transition_carries_reason_and_is_one_json_line() -> None:
    _, _, transitions = run(CFG, [(0, 0), (1, 22.5)])
    (tr,) = transitions
    line = tr.to_json()
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["from"] == 0 and doc["to"] == 2 and doc["at"] == 1
    assert doc["reason"] == {"kind": "trigger", "signal": "queue_length", "value": 22.5,
                             "threshold": 20, "detail": "level2 trigger held"}
    assert doc["signals"]["values"] == {"queue_length": 22.5}


def test_recover_transition_says_why() -> None:
    _, _, transitions = run(CFG, [(0, 12), (1, 0), (11, 0)])
    assert transitions[-1].reason.kind == "recover"
    assert "below its recover value for 10s" in transitions[-1].reason.detail


def test_pin_wins_until_it_expires_and_rules_run_underneath() -> None:
    state = ControllerState()
    state, tr = pin_level(state, 3, now=0, ttl_s=10)
    assert tr is not None and tr.reason.kind == "override" and state.level == 3
    # load says level 1 meanwhile; the pin wins
    for t in (1, 5, 9.9):
        state, tr = decide(CFG, state, snap(t, 12), t)
        assert state.level == 3 and tr is None
    assert state.policy_level == 1
    state, tr = decide(CFG, state, snap(10, 12), 10)
    assert state.level == 1 and tr is not None and tr.reason.kind == "override_expired"


def test_unpin_returns_to_the_rules() -> None:
    state, _ = pin_level(ControllerState(), 2, now=0)
    state, _, _ = run(CFG, [(1, 0), (100, 0)], state)
    assert state.level == 2
    state, tr = unpin(state, now=101)
    assert state.level == 0 and tr is not None and tr.reason.kind == "override_cleared"


def test_pin_rejects_bad_level_and_ttl() -> None:
    with pytest.raises(ValueError, match=r"level must be one of \[0, 1, 2, 3\], got 7"):
        pin_level(ControllerState(), 7, now=0)
    with pytest.raises(ValueError, match=r"ttl_s must be > 0.*got -1"):
        pin_level(ControllerState(), 1, now=0, ttl_s=-1)


def test_feature_override_forces_and_expires() -> None:
    state, _, _ = run(CFG, [(0, 35)])
    assert "ab_test" not in enabled_features(CFG, state, 0)
    state = force_feature(state, "ab_test", True, now=0, ttl_s=5)
    assert "ab_test" in enabled_features(CFG, state, 4.9)
    assert "ab_test" not in enabled_features(CFG, state, 5)
    state = force_feature(state, "debug_capture", False, now=0)
    state, _, _ = run(CFG, [(1, 0), (11, 0), (21, 0), (31, 0)], state)
    assert state.level == 0 and "debug_capture" not in enabled_features(CFG, state, 31)
    state = clear_feature(state, "debug_capture")
    assert "debug_capture" in enabled_features(CFG, state, 31)


def test_critical_feature_cannot_be_forced_off() -> None:
    with pytest.raises(ValueError, match=r"'model' is critical"):
        force_feature(ControllerState(), "model", False, now=0)
    with pytest.raises(ValueError, match=r"unknown feature 'modle'"):
        force_feature(ControllerState(), "modle", True, now=0)


def test_naive_level_is_highest_crossed() -> None:
    assert naive_level(CFG, {"queue_length": 21}) == Level.AUXILIARY
    assert naive_level(CFG, {"queue_length": 9}) == Level.NORMAL


# -- flap damping ---------------------------------------------------------------------------------

# One level, dwell 10 s; a re-escalation within 30 s of a step down doubles the next dwell, up to
# 4x (40 s); 100 s without any escalation forgets the flaps.
DAMPED = parse_policy(
    {
        "level1": {"trigger": {"queue_length": 10}, "recover": {"queue_length": 5},
                   "recover_dwell_s": 10, "cooldown_s": 4, "disable": ["debug_capture"]},
        "flap_damping": {"window_s": 30, "dwell_factor": 2, "max_dwell_factor": 4, "reset_after_s": 100},
    }
)
UNDAMPED = DAMPED.model_copy(update={"flap_damping": DAMPED.flap_damping.model_copy(update={"dwell_factor": 1.0})})


@pytest.mark.parametrize(
    "name, cfg, steps, expected",
    [
        (
            "first recovery takes the plain dwell",
            DAMPED,
            [(0, 12), (1, 0), (10.9, 0), (11, 0)],
            [1, 1, 1, 0],
        ),
        (
            "a recovery undone within the window doubles the next dwell, then doubles again",
            DAMPED,
            # up at 0, calm from 1, down at 11; burst at 20 (9 s after the step down: a flap)
            # calm from 21: the dwell is now 20 s -> still up at 40.9, down at 41
            # burst at 50 (a second flap): dwell 40 s from 51 -> down at 91, not before
            [(0, 12), (1, 0), (11, 0), (20, 12), (21, 0), (31, 0), (40.9, 0), (41, 0),
             (50, 12), (51, 0), (61, 0), (90.9, 0), (91, 0)],
            [1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0],
        ),
        (
            "the same bursts without damping step down and up once per burst",
            UNDAMPED,
            [(0, 12), (1, 0), (11, 0), (20, 12), (21, 0), (31, 0), (40.9, 0), (41, 0),
             (50, 12), (51, 0), (61, 0), (90.9, 0), (91, 0)],
            [1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0],
        ),
        (
            "the dwell stops growing at max_dwell_factor",
            DAMPED,
            # three flaps (at 20, 50, 100): 2x, 4x, then still 4x = 40 s
            [(0, 12), (1, 0), (11, 0), (20, 12), (21, 0), (41, 0), (50, 12), (51, 0), (91, 0),
             (100, 12), (101, 0), (140.9, 0), (141, 0)],
            [1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0],
        ),
        (
            "an escalation long after the step down is no flap",
            DAMPED,
            # down at 11; back up at 41.1, 30.1 s later: outside the window, dwell stays 10 s
            [(0, 12), (1, 0), (11, 0), (41.1, 12), (42, 0), (52, 0)],
            [1, 1, 0, 1, 1, 0],
        ),
        (
            "a long calm forgets the flaps",
            DAMPED,
            # a flap at 20 (dwell 20 s, down at 41); no escalation from 20 to 130 (>= 100 s):
            # the flap is forgotten and the next recovery takes the plain 10 s again
            [(0, 12), (1, 0), (11, 0), (20, 12), (21, 0), (41, 0), (130, 0), (131, 12),
             (132, 0), (142, 0)],
            [1, 1, 0, 1, 1, 0, 0, 1, 1, 0],
        ),
    ],
)
def test_flap_damping_sequences(name: str, cfg, steps: list, expected: list[int]) -> None:  # type: ignore[no-untyped-def]
    _, levels, _ = run(cfg, steps)
    assert levels == expected, name


def test_flap_damping_state_and_reason() -> None:
    state, _, transitions = run(
        DAMPED, [(0, 12), (1, 0), (11, 0), (20, 12), (21, 0), (41, 0)]
    )
    assert state.flaps == 1 and state.last_recover_at == 41 and state.last_escalate_at == 20
    assert transitions[-1].reason.kind == "recover"
    assert "(dwell 20s = 10s x2 after 1 flap(s))" in transitions[-1].reason.detail


def test_flap_damping_escalation_is_never_delayed() -> None:
    # however many flaps, a trigger still escalates on the same tick
    state, _, _ = run(DAMPED, [(0, 12), (1, 0), (11, 0), (20, 12), (21, 0), (41, 0)])
    state, tr = decide(DAMPED, state, snap(42, 11), 42)
    assert state.level == 1 and tr is not None and tr.reason.kind == "trigger"
    assert state.flaps == 2
