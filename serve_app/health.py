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
starts. And that expiry is itself an observation (`observe_expired`): where nothing from the
model, neither a probe's answer nor a model call's, has come back for as long as the expired
request waited, the model is taken for down, so the requests after it get their 503 at once
instead of each waiting its whole deadline for a replica that is not there. A probe's answer
lifts it as soon as a replica answers again. (Where something did answer meanwhile, the request
found every replica full, not none: that says nothing about the model's health.)

While down, a new request is refused with 503 + ``Retry-After`` before any work is queued. The
latest observation wins, so with several model replicas one dead replica can refuse requests for
at most one probe interval before a healthy answer lifts it; a replica that really is dead is
replaced by Serve within its health-check period either way.
"""

from __future__ import annotations

import math
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
    heard_at: float | None = None  # when the model last answered anything (`observe`); None: never

    def observe(self, ok: bool, reason: str | None = None) -> None:
        """An answer from the model (a probe's, or a model call's outcome): up or down."""
        self.heard_at = self.clock()
        self._set(ok, reason)

    def _set(self, ok: bool, reason: str | None) -> None:
        if ok != self.up:
            self.since = self.clock()
            if not ok:
                self.downs += 1
        self.up, self.reason = ok, (None if ok else reason or "the model is unavailable")

    def observe_expired(self, waited_s: float) -> bool:
        """A request waited ``waited_s`` for a model replica to take it and none did before its
        deadline (`AdmissionGate.until_reached`). Where the model has not answered anything for
        at least that long (nor ever), no replica is taking work: down, and True. Otherwise the
        replicas are answering but were full: nothing changes (False)."""
        if not math.isfinite(waited_s) or waited_s < 0.0:
            return False
        silent_s = None if self.heard_at is None else self.clock() - self.heard_at
        if silent_s is not None and silent_s < waited_s:
            return False
        quiet = "since the ingress started" if silent_s is None else f"for {silent_s:.1f} s"
        self._set(False, f"no model replica took a request within its deadline ({waited_s:.1f} s), "
                         f"and none has answered {quiet}")
        return True

    def refusal(self) -> str | None:
        """The reason to refuse a new request now, or None to let it through."""
        if self.up:
            return None
        self.refused += 1
        return f"the model is unavailable ({self.reason}); retry later"

    def state(self) -> dict[str, Any]:
        return {"up": self.up, "reason": self.reason, "since": self.since, "downs": self.downs,
                "refused": self.refused, "heard_at": self.heard_at}
