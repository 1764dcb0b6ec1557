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
``Retry-After`` is the predicted rest of the outage (`retry_after_s`), not a constant: a
replacement replica of vLLM takes a minute or two to start on a few CPU cores (118 s on a 2-core
AVX2 EPYC), and a client told "1 s" would ask about a hundred times in vain. The prediction is
the median of the model's last outages (each from the moment an ingress took the model for down
to the first answer after; kept by the policy actor for every ingress replica, see below), or,
before any has ended, how long the model replica that answered
last took to start (`deployments.model.VLLMModel.health`'s ``start_s``: a lower bound, since
Serve's noticing the death and the new process come on top), less the time the model has been
down. Once the outage has outlasted the prediction by ``d`` seconds, the rest is taken as ``d``
(the prediction was short; the checks then come at doubling intervals, the back-off a careful
client would use itself). Clamped to ``[limits.retry_after_s, limits.max_retry_after_s]``. Not
while the model is down on silence alone (an expiry, no answer saying so: `inferred`): a jammed
or starved engine is silent too, so the floor is sent until an answer says the model is down
(a probe that finds the engine dead or the replica gone), and such an outage is not counted
among those the prediction takes. The
latest observation wins, so with several model replicas one dead replica can refuse requests for
at most one probe interval before a healthy answer lifts it; a replica that really is dead is
replaced by Serve within its health-check period either way.

The outages are the service's, not one replica's: an ingress replica started after an outage,
or restarted since, would otherwise predict from the start time alone (a lower bound: 174 s
reported where the replacement answered after 127 s). So each outage seen end here is sent to
the policy actor (`share`, from a background task: `policies.service.PolicyCore.record_outage`,
which merges the reports of the replicas that saw the same outage and persists the last
`OUTAGES_KEPT`), and its answer, the record of every replica, is what the prediction takes. A
replica reads the record once at its start. Until the actor answers, the outages seen here are
the record (and are sent later).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from policies.service import OUTAGES_KEPT, finite_number  # OUTAGES_KEPT: the outages `predicted_outage_s` takes

__all__ = ["OUTAGES_KEPT", "ModelHealth"]


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
    start_s: float | None = None  # how long the model replica that answered last took to start
    outages: list[float] = field(default_factory=list)  # the last `OUTAGES_KEPT` outages seen end, s
    # down on silence alone (`observe_expired`): no answer from the model has said so yet
    inferred: bool = False
    # outages seen end here and not yet kept by the policy actor: (ended_at, duration_s)
    unshared: list[tuple[float, float]] = field(default_factory=list)
    shared: bool = False  # the actor's record has been read (`share`)

    def observe(self, ok: bool, reason: str | None = None) -> None:
        """An answer from the model (a probe's, or a model call's outcome): up or down."""
        self.heard_at = self.clock()
        self._set(ok, reason)

    def observe_start(self, start_s: Any) -> None:
        """A model replica's start time as its health answer reports it (``start_s``); anything
        but a finite number >= 0 says nothing (a replica of an older version sends none)."""
        if finite_number(start_s) and start_s >= 0.0:
            self.start_s = float(start_s)

    def _set(self, ok: bool, reason: str | None, inferred: bool = False) -> None:
        if ok != self.up:
            now = self.clock()
            if ok and not self.inferred:  # an outage ended: how long it lasted, as seen from here
                lasted = max(0.0, now - self.since)
                self.outages = [*self.outages, lasted][-OUTAGES_KEPT:]
                self.unshared = [*self.unshared, (now, lasted)][-OUTAGES_KEPT:]
            elif not ok:
                self.downs += 1
            self.since, self.inferred = now, inferred
        elif not ok:  # still down: an answer saying so makes it certain
            self.inferred = self.inferred and inferred
        self.up, self.reason = ok, (None if ok else reason or "the model is unavailable")

    def adopt(self, durations: Any) -> bool:
        """The policy actor's record of the model's outages (durations, oldest first) replaces
        this replica's; anything but a list of finite numbers >= 0 changes nothing (False)."""
        if not isinstance(durations, list) or not all(finite_number(d) and d >= 0.0 for d in durations):
            return False
        self.outages = [float(d) for d in durations][-OUTAGES_KEPT:]
        return True

    async def share(self, call: Callable[..., Awaitable[Any]]) -> bool:
        """Send the outages seen end here to the policy actor (``call``: its link's
        ``call(method, *args)``), oldest first, and adopt the record it answers with; with nothing
        to send, read the record once (a replica's start). True if a record was adopted. A
        failed call raises and keeps what was not sent, for the next try."""
        record = None
        while self.unshared:
            sent = self.unshared[0]
            record = await call("record_outage", *sent)
            if self.unshared and self.unshared[0] == sent:  # (more outages meanwhile may have pushed it out)
                self.unshared.pop(0)
        if record is None:
            if self.shared:
                return False
            record = await call("model_outages")
        if not self.adopt(record):
            raise TypeError(f"the policy actor's outage record is not a list of seconds: {record!r}")
        self.shared = True
        return True

    def predicted_outage_s(self) -> float | None:
        """How long an outage lasts, from the moment it is seen to the first answer after: the
        median of the last `OUTAGES_KEPT` seen here, or before any has ended the model
        replica's start time (`start_s`, a lower bound); None where neither is known."""
        return statistics.median(self.outages) if self.outages else self.start_s

    def retry_after_s(self, floor_s: int, cap_s: int) -> int:
        """``Retry-After`` for a refusal because the model is down: the predicted rest of the
        outage (`predicted_outage_s` less the time it has been down; once it has outlasted the
        prediction by ``d``, ``d``: checks at doubling intervals), rounded up and clamped to
        ``[floor_s, cap_s]``; ``floor_s`` while up, where nothing is predicted, and while the
        model is down on silence alone (`inferred`): a jammed engine is silent too, and an outage
        predicted for it would send clients away for a minute from a service that may answer
        again within seconds."""
        predicted = self.predicted_outage_s()
        if self.up or self.inferred or predicted is None:
            return floor_s
        rest = abs(predicted - (self.clock() - self.since))
        return max(floor_s, min(cap_s, math.ceil(rest - 1e-9)))

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
                         f"and none has answered {quiet}", inferred=True)
        return True

    def refusal(self) -> str | None:
        """The reason to refuse a new request now, or None to let it through."""
        if self.up:
            return None
        self.refused += 1
        return f"the model is unavailable ({self.reason}); retry later"

    def state(self) -> dict[str, Any]:
        return {"up": self.up, "reason": self.reason, "since": self.since, "downs": self.downs,
                "refused": self.refused, "heard_at": self.heard_at, "start_s": self.start_s,
                "inferred": self.inferred, "outages_s": [round(x, 3) for x in self.outages],
                "predicted_outage_s": self.predicted_outage_s(), "outages_shared": self.shared,
                "outages_unshared": len(self.unshared)}
