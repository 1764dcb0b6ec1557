"""Whether the model can take requests now, as the ingress last saw it: a fast 503 while it cannot.

When the model's engine dies, Serve replaces the replica (its ``check_health`` asks vLLM), and a
new vLLM replica takes tens of seconds to start. Requests sent in that time would wait in Serve's
router for a replica that is not there yet; the client should rather hear at once that the model
is unavailable, with a ``Retry-After``. So the ingress keeps this small state, fed by what it sees:

* a probe (`Ingress._probe_model`, every ``pipeline.model_probe_s``) asks a model replica for
  its engine's health, with a time-out: healthy -> up; engine dead, replica gone -> down; no
  answer in time says nothing (a busy replica answers late too, and so does Serve's router while
  it has no replica to send the probe to);
* a request whose model call failed for the model's own reason (engine dead, replica died) ->
  down; one the model served -> up.

What this state has not caught yet, the deadline does: a request that no model replica takes
before its deadline gets its 503 then (`AdmissionGate.until_reached`), not when a new replica
starts.

While down, a new request is refused with 503 + ``Retry-After`` before any work is queued. The
latest observation wins, so with several model replicas one dead replica can refuse requests for
at most one probe interval before a healthy answer lifts it; a replica that really is dead is
replaced by Serve within its health-check period either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ModelHealth:
    """Up or down, since when and why. ``clock``: wall seconds (time.time)."""

    clock: Callable[[], float] = time.time
    up: bool = True
    reason: str | None = None
    since: float = 0.0
    downs: int = 0  # transitions to down
    refused: int = 0  # requests refused because it was down

    def observe(self, ok: bool, reason: str | None = None) -> None:
        if ok != self.up:
            self.since = self.clock()
            if not ok:
                self.downs += 1
        self.up, self.reason = ok, (None if ok else reason or "the model is unavailable")

    def refusal(self) -> str | None:
        """The reason to refuse a new request now, or None to let it through."""
        if self.up:
            return None
        self.refused += 1
        return f"the model is unavailable ({self.reason}); retry later"

    def state(self) -> dict[str, Any]:
        return {"up": self.up, "reason": self.reason, "since": self.since, "downs": self.downs,
                "refused": self.refused}
