"""The circuit breaker, tick by tick: (time, event) -> state after it."""

from __future__ import annotations

import pytest

from serve_app.breaker import Breaker, BreakerSettings, CircuitState

C, O, H = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN
S = BreakerSettings(failure_threshold=3, open_s=10, probes=2)

# events: "allow" (expects the bool in the 3rd column), "ok", "fail"
TABLES = {
    "closed stays closed below the threshold, a success resets the count": [
        (0, "fail", None, C), (1, "fail", None, C), (2, "ok", None, C), (3, "fail", None, C), (4, "fail", None, C),
    ],
    "three failures in a row open it; calls are refused while open": [
        (0, "fail", None, C), (1, "fail", None, C), (2, "fail", None, O),
        (3, "allow", False, O), (11.9, "allow", False, O),
    ],
    "after open_s it lets two probes through, two successes close it": [
        (0, "fail", None, C), (0, "fail", None, C), (0, "fail", None, O),
        (10, "allow", True, H), (10, "allow", True, H), (10, "allow", False, H),
        (11, "ok", None, H), (12, "ok", None, C), (12, "allow", True, C),
    ],
    "a failed probe opens it again for another open_s": [
        (0, "fail", None, C), (0, "fail", None, C), (0, "fail", None, O),
        (10, "allow", True, H), (11, "fail", None, O), (20, "allow", False, O), (21, "allow", True, H),
    ],
    "a late result while open changes nothing": [
        (0, "fail", None, C), (0, "fail", None, C), (0, "fail", None, O), (1, "ok", None, O), (2, "allow", False, O),
    ],
}


@pytest.mark.parametrize("name", TABLES)
def test_breaker_table(name: str) -> None:
    b = Breaker(S)
    for at, event, allowed, state in TABLES[name]:
        if event == "allow":
            assert b.allow(at) is allowed, (name, at)
        else:
            b.record(event == "ok", at)
        assert b.state is state, (name, at, event, b.state)


def test_counters_say_how_often_it_opened_and_refused() -> None:
    b = Breaker(BreakerSettings(failure_threshold=1, open_s=5, probes=1))
    b.record(False, 0)
    assert not b.allow(1) and not b.allow(2)
    assert b.allow(5) and b.state is H
    b.record(False, 6)
    assert b.snapshot() == {"state": "open", "opens": 2, "refused": 2, "failures": 0}


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        BreakerSettings(failure_threshold=0)
    with pytest.raises(ValueError, match="open_s"):
        BreakerSettings(open_s=float("inf"))
