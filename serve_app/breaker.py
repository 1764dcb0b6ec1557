"""A circuit breaker per optional feature: stop calling an enrichment that keeps failing.

A failing enrichment costs every request its full stage timeout before the stage is bypassed.
The breaker turns that into an immediate bypass while the enrichment is down, and probes it
back in:

- **closed**: calls go through; ``failure_threshold`` failures in a row (errors or timeouts)
  open it.
- **open**: no call is made; the stage is bypassed at once (its off-mode applies: a deferrable
  side effect is spooled, not lost). After ``open_s`` it goes half-open.
- **half-open**: at most ``probes`` calls go through at a time; ``probes`` successes close it,
  any failure opens it again for another ``open_s``.

Why not a library: the kept Python breakers (pybreaker, aiobreaker, purgatory) wrap the call
itself, while here one handle call carries several features' stages and a stage's outcome is
known only after the batch returns; this needs "may I call?" and "it went so" as two steps,
with the time passed in. Pure: no clock read, no I/O; table-tested in
``tests/unit/test_breaker.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Breaker", "BreakerSettings", "CircuitState"]


class CircuitState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    failure_threshold: int = Field(default=5, ge=1, description="failures in a row that open the circuit")
    open_s: float = Field(default=10.0, gt=0, allow_inf_nan=False, description="how long it stays open")
    probes: int = Field(default=2, ge=1, description="calls let through half-open; as many successes close it")


@dataclass
class Breaker:
    settings: BreakerSettings
    state: CircuitState = CircuitState.CLOSED
    failures: int = 0  # in a row, while closed
    opened_at: float = 0.0
    probes_out: int = 0  # half-open calls not yet reported
    probe_successes: int = 0
    opens: int = 0  # times it opened
    refused: int = 0  # calls not made because it was open

    def allow(self, now: float) -> bool:
        """May a call be made now? (A half-open yes reserves a probe: report it with `record`.)"""
        if self.state is CircuitState.OPEN:
            if now - self.opened_at < self.settings.open_s:
                self.refused += 1
                return False
            self.state, self.probes_out, self.probe_successes = CircuitState.HALF_OPEN, 0, 0
        if self.state is CircuitState.HALF_OPEN:
            if self.probes_out >= self.settings.probes:
                self.refused += 1
                return False
            self.probes_out += 1
        return True

    def record(self, ok: bool, now: float) -> None:
        """A call that `allow` let through has finished, well or not."""
        if self.state is CircuitState.HALF_OPEN:
            self.probes_out = max(0, self.probes_out - 1)
            if not ok:
                self._open(now)
                return
            self.probe_successes += 1
            if self.probe_successes >= self.settings.probes:
                self.state, self.failures = CircuitState.CLOSED, 0
            return
        if self.state is CircuitState.OPEN:
            return  # a call from before it opened: it changes nothing
        if ok:
            self.failures = 0
            return
        self.failures += 1
        if self.failures >= self.settings.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self.state, self.opened_at, self.failures, self.probes_out = CircuitState.OPEN, now, 0, 0
        self.opens += 1

    def snapshot(self) -> dict[str, object]:
        return {"state": self.state.value, "opens": self.opens, "refused": self.refused, "failures": self.failures}
