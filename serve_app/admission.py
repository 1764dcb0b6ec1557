"""The ingress's door: a request's class, deadline-aware admission, honest refusals.

`AdmissionGate` wraps the pure rule (`policies.admission.AdmissionController`) with what only
the ingress knows: how many requests it has admitted that have not finished yet (``in_flight``:
from admission until the model's last token, open streams included), which of them the model
actually served (only those feed the service model), each request's share of the server while
it was in flight and how many were ahead of it (`policies.admission.ShareClock`,
`ServiceModel.observe`), the degradation level in force (`set_level`: each level has its own
measured model), and the HTTP shape of a refusal.

A request is classified first (its key's tier once keys exist, else the policy's
``slo.default_class``; the ``X-Brownout-Criticality`` header may lower it, never raise it), then
admitted or refused before any enrichment or model work:

- 429 ``class_share_exhausted``: this class's share of the latency budget is used up, more
  important work still gets in;
- 503 ``saturated``: even critical work would miss the SLO;
- a critical request that finds the door full first waits for a freed slot it can still finish
  in time with, for up to ``admission.critical_wait_share`` of the SLO (`admit_waiting`), then
  gets the 503; it gets the 503 at once while critical work alone saturates the server
  (`saturated_by`);
- 429 ``preempted``, after admission: a more important request found the door full and took the
  place of this one, which the model had not started yet (`waiting`, `preempted_error`);
- 503 ``expired``, after admission: no model replica took the request before its deadline (none
  is running, or every one is full: it waited in Serve's router), so its answer could only be
  late (`until_reached`).

Both carry OpenAI's error JSON, a ``Retry-After`` computed from the predicted drain time of the
backlog, and ``X-Brownout-Criticality``; each is counted by class and reason. An admitted request
gets a `Ticket`: its class (vLLM ``priority``) and the deadline past which the model deployment
drops it instead of computing an answer nobody can use. Release every ticket exactly once
(`release` is idempotent), whatever happened to the request.

A policy without an ``slo`` section admits everything (the gate still classifies and counts).
Plain logic, no Ray: the clock and the refusal hook are constructor arguments.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from policies.admission import (
    CRITICALITY_HEADER,
    AdmissionController,
    Criticality,
    STATUS,
    Decision,
    ShareClock,
    classify,
)
from policies.config import AdmissionConfig, DegradationConfig
from serve_app.openai_api import RequestError

__all__ = ["AdmissionGate", "Ticket"]

_KIND = {429: "rate_limit_error", 503: "service_unavailable"}
# a model replica's slowdown (`AdmissionGate.observe_speed`) counts this long after it was read:
# a few probe intervals (the ingress probes a model replica every `model_probe_s`, 0.5 s)
SPEED_FRESH_S = 5.0
T = TypeVar("T")


def _refusal_error(status: int, criticality: Criticality, retry_after_s: int, message: str) -> RequestError:
    """A refusal in OpenAI's error shape, with its computed Retry-After and the request's class."""
    return RequestError(status, message, None, kind=_KIND[status], headers={
        "Retry-After": str(retry_after_s), "X-Brownout-Criticality": criticality.value,
    })


@dataclass(eq=False)
class Ticket:
    """One admitted request, until `AdmissionGate.release`."""

    criticality: Criticality
    deadline_at: float | None  # wall-clock seconds; None when admitted with admission off
    admitted_at: float = 0.0
    ahead: int = 0  # requests admitted and unfinished when this one was admitted
    share_mark: float = 0.0  # the gate's ShareClock at admission: its own service time starts here
    released: bool = False
    preempted: bool = False  # a more important request took its place before the model started it
    expired: bool = False  # no model replica took it before its deadline (`until_reached`)
    seq: int = 0  # the gate's count of tickets issued, this one included

    @property
    def priority(self) -> int:
        """vLLM's ``priority`` (priority scheduling: lower starts first)."""
        return self.criticality.vllm_priority


class AdmissionGate:
    """Admission for one ingress replica. Not thread-safe: use it from the event loop."""

    def __init__(
        self,
        max_num_seqs: int,
        clock: Callable[[], float] = time.time,
        on_refusal: Callable[[Criticality, str], None] | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self._clock = clock
        self._on_refusal = on_refusal or (lambda criticality, reason: None)
        # Kept while admission is switched off (admission.enabled: false), so that it goes on
        # measuring the service rate and predicting latency, and is warm when switched back on.
        self.controller: AdmissionController | None = None
        self.enabled = False
        self.default_class = Criticality.STANDARD
        self.in_flight = 0
        self.share = ShareClock()  # each request's share of the service, for the service model
        self.level = 0  # the degradation level in force (`set_level`): each has its own model
        self.replicas = (1, 1)  # model and ingress replicas serving (`set_replicas`)
        self._speeds: dict[Any, tuple[float, float]] = {}  # model replica -> (slowdown, when read)
        self._issued = 0  # tickets issued (`Ticket.seq`)
        # the last level change (`set_level`): the last ticket issued before it, and how many of
        # the tickets issued before it are still in flight
        self._change_seq = 0
        self._before_change = 0
        self.admitted: Counter[str] = Counter()
        self.refused: Counter[tuple[str, str]] = Counter()
        # admitted requests the model has not started, each with the hook that stops its wait
        self._waiting: dict[Ticket, Callable[[], None]] = {}
        # critical requests that found the door full, waiting for a freed slot (`admit_waiting`):
        # (arrived at, the future their ticket is handed over by), first come first served
        self._queue: collections.deque[tuple[float, asyncio.Future[Ticket]]] = collections.deque()

    def configure(self, policy: DegradationConfig) -> None:
        """Apply a (re)loaded policy; a measured service rate is kept across reloads."""
        slo = policy.slo
        self.default_class = Criticality(slo.default_class) if slo is not None else Criticality.STANDARD
        settings = policy.admission or AdmissionConfig()
        if slo is None:
            self.controller = None
        elif self.controller is None:
            self.controller = AdmissionController(slo, settings, self.max_num_seqs)
            self.controller.set_level(self.level)
            self.controller.set_replicas(*self.replicas)
        else:
            self.controller.update(slo, settings)
        self.enabled = self.controller is not None and settings.enabled
        if self._queue:  # a door no longer kept lets everyone in; caps that grew let some in
            self._hand_over()

    def admit(self, criticality_header: str | None, base: Criticality | None = None) -> Ticket:
        """Admit the request or raise the `RequestError` that refuses it (400 for a bad header)."""
        criticality = self._classify(criticality_header, base)
        ticket, refused = self._enter(criticality)
        if ticket is None:
            assert refused is not None
            raise self._refusal(refused)
        return ticket

    async def admit_waiting(self, criticality_header: str | None, base: Criticality | None = None) -> Ticket:
        """`admit`, except that a critical request the door would refuse waits for a freed slot,
        for up to `AdmissionController.critical_wait_s` (``admission.critical_wait_share`` of
        the SLO, no longer than it could still finish in time on an idle server at the engine's
        usual speed).

        Meanwhile no request of a lower class is admitted (the requests waiting count as ahead of
        it), and each release hands the slot it frees to the first in line that is still
        predicted to finish in time with it (`AdmissionController.in_time_after`: its wait so
        far plus the predicted end-to-end time at the door's count) while critical's cap has
        room (`release`); one that is not waits on while the door drains further. A full door
        drains in clumps: the requests admitted in a burst run in one batch and finish together.
        Measured before this (12-07, 2-core AVX2 EPYC, 5 s SLO, six repeats at 3 x C0 with 20%
        critical work, a wait of a tenth of the SLO given to the first in line): each of the four
        critical refusals came after its whole 0.5 s wait at a door full at critical's cap (a
        burst of critical arrivals, or a second of a slow engine reading), and the door fell to
        1-2 in flight 1.1-2.4 s after the wait began. Its deadline runs from its arrival, not
        from the end of its wait.
        Past the wait it is refused like at the door (503 ``saturated``, computed Retry-After);
        while critical work alone saturates the server at the engine's usual speed
        (`AdmissionController.saturated_by`) it is refused at once: each freed slot would go to a
        critical request anyway, and one that waited for it would finish late by its wait; a
        client that goes away while waiting leaves the line and takes no slot. Its first
        decision still counts as a refusal in ``refused_ratio`` (the level's earliest signal):
        the door was full.
        """
        criticality = self._classify(criticality_header, base)
        arrived_at = self._clock()
        ticket, refused = self._enter(criticality)
        if ticket is not None:
            return ticket
        assert refused is not None and self.controller is not None
        wait_s = self.controller.critical_wait_s()
        if criticality.rank or wait_s <= 0 or self.controller.saturated_by(criticality, arrived_at, usual_speed=True):
            raise self._refusal(refused)  # nobody waits where the next freed slot is another's anyway
        handed: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        entry = (arrived_at, handed)
        self._queue.append(entry)
        try:
            await asyncio.wait({handed}, timeout=wait_s)
        except BaseException:  # the client went away (or the replica stops): leave the line
            self._leave(entry)
            if handed.done() and not handed.cancelled():
                self.release(handed.result(), served=False)  # handed over as it went: give it back
            raise
        if handed.done() and not handed.cancelled():
            return handed.result()
        self._leave(entry)
        ctl = self.controller
        if ctl is None or not self.enabled:  # admission was switched off meanwhile
            return self._ticket(criticality, None, self._clock(), self.in_flight)
        ahead = self.in_flight + len(self._queue)
        now = self._clock()
        cap = ctl.class_cap(criticality, now)
        late = Decision(False, criticality, "saturated", STATUS["saturated"], ctl.predicted_e2e_s(ahead), cap,
                        retry_after_s=ctl.retry_after_s(ahead, cap, criticality, now))
        raise self._refusal(late)

    def refuse_unavailable(self, criticality_header: str | None, base: Criticality | None, message: str,
                           retry_after_s: int) -> RequestError:
        """The 503 for a request that arrives while the model is down (`serve_app.health`),
        counted like the door's refusals, by class and reason ``model_down``. A bad
        criticality header is still its 400 (raised)."""
        criticality = self._classify(criticality_header, base)
        self._count_refusal(criticality, "model_down")
        return _refusal_error(503, criticality, retry_after_s, message)

    def _classify(self, criticality_header: str | None, base: Criticality | None) -> Criticality:
        try:
            return classify(base or self.default_class, criticality_header)
        except ValueError as err:
            raise RequestError(400, str(err), CRITICALITY_HEADER) from None

    def _leave(self, entry: tuple[float, asyncio.Future[Ticket]]) -> None:
        try:
            self._queue.remove(entry)
        except ValueError:
            pass  # handed over (or already gone)
        entry[1].cancel()

    def _enter(self, criticality: Criticality) -> tuple[Ticket | None, Decision | None]:
        """Decide at the door: the ticket, or the refusing decision (not counted yet)."""
        deadline_at, now, ahead = None, self._clock(), self.in_flight
        if self.controller is not None and self.enabled:
            below = [t for t in self._waiting if t.criticality.rank > criticality.rank]
            # critical requests waiting for a slot are ahead of every arrival
            decision = self.controller.decide(criticality, ahead + len(self._queue), now, preemptible=len(below))
            if not decision.admitted:
                return None, decision
            if decision.preempt:
                # the least important first, and within a class the one that waited least
                below.sort(key=lambda t: (t.criticality.rank, t.admitted_at), reverse=True)
                for victim in below[:decision.preempt]:
                    self._preempt(victim)
                ahead = self.in_flight
            deadline_at = decision.deadline_at
        return self._ticket(criticality, deadline_at, now, ahead), None

    def _ticket(self, criticality: Criticality, deadline_at: float | None, now: float, ahead: int) -> Ticket:
        self.in_flight += 1
        self.admitted[criticality.value] += 1
        self._issued += 1
        return Ticket(criticality, deadline_at, now, ahead, self.share.mark(now, self.in_flight), seq=self._issued)

    def _hand_over(self) -> None:
        """Give freed slots to the critical requests waiting for one, first in line first, while
        critical's cap has room, each to one still predicted to finish in time with it
        (`AdmissionController.in_time_after`); the others wait on (`admit_waiting`)."""
        ctl = self.controller
        if ctl is None or not self.enabled:
            while self._queue:  # admission switched off: everyone in
                self._queue.popleft()[1].cancel()
            return
        now = self._clock()
        kept: collections.deque[tuple[float, asyncio.Future[Ticket]]] = collections.deque()
        while self._queue:
            entry = self._queue.popleft()
            arrived_at, handed = entry
            if handed.done():  # left the line already
                continue
            if (self.in_flight < ctl.class_cap(Criticality.CRITICAL, now)
                    and ctl.in_time_after(now - arrived_at, self.in_flight)):
                handed.set_result(self._ticket(Criticality.CRITICAL, arrived_at + ctl.e2e_s, now, self.in_flight))
            else:
                kept.append(entry)
        self._queue = kept

    def waiting(self, ticket: Ticket, stop: Callable[[], None]) -> None:
        """``ticket``'s request waits for the model to start it (its pre stages, the model's first
        event): until `started`, a more important request that finds the door full may take its
        place. ``stop`` ends that wait (the ingress cancels it and answers `preempted_error`)."""
        if not ticket.released and ticket.criticality.rank > 0:
            self._waiting[ticket] = stop

    async def until_started(self, ticket: Ticket, awaitable: Awaitable[T], call: Any = None) -> T:
        """Await one step of a request's wait for the model: its pre stages, or the model's first
        event (the model deployment's `Started`: vLLM has computed its first token). Meanwhile
        a more important request that finds the door full may take its place (`waiting`): this
        wait is then cancelled, and the model ``call`` with it (``call.cancel()``: vLLM aborts
        the request), and `preempted_error` is raised: 429 with a computed Retry-After. No
        header has been sent yet, so the client gets an honest refusal, not a broken stream.
        Whole (non-streamed) responses give way the same way: the ingress streams them too, as a
        `Started` and then the `Completion`. Critical requests give way to none, and nothing
        gives way while admission is off."""
        if ticket.criticality.rank == 0 or not self.enabled or ticket.released:
            return await awaitable
        task = asyncio.ensure_future(awaitable)
        self.waiting(ticket, task.cancel)
        try:
            result = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not ticket.preempted or (current is not None and current.cancelling()):
                raise  # the client went away (or the replica stops): not a preemption
        finally:
            self.started(ticket)
        if ticket.preempted:  # also where the cancel came too late to stop the step
            if call is not None:
                call.cancel()
            raise self.preempted_error(ticket)
        return result

    async def until_reached(self, ticket: Ticket, awaitable: Awaitable[T]) -> T:
        """Await the model's first event (`deployments.model.Reached`: a model replica has the
        request), for no longer than the ticket's deadline. A request that no replica took by
        then (none is running, or every one is full) could only be answered late, and the model
        deployment would drop it on arrival (`should_drop`); without this bound it would wait in
        Serve's router until a replica starts, minutes for a replaced one. Past the deadline the
        wait is cancelled and `expired_error` raised (the caller cancels the model call, which is
        still in Serve's router). No deadline (admission off): no bound."""
        if ticket.deadline_at is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, max(0.0, ticket.deadline_at - self._clock()))
        except TimeoutError:
            ticket.expired = True
            self._count_refusal(ticket.criticality, "expired")
            raise self.expired_error(ticket) from None

    def expired_error(self, ticket: Ticket) -> RequestError:
        """The 503 of a request no model replica took before its deadline (`until_reached`), with
        the drain time of the work admitted as ``Retry-After``."""
        retry = self.drain_s()
        message = (f"{ticket.criticality.value} request not taken by a model replica before its deadline "
                   f"(none is running, or every one is full): its answer could only be late. "
                   f"Retry after {retry} s.")
        return _refusal_error(503, ticket.criticality, retry, message)

    def started(self, ticket: Ticket) -> None:
        """The model started ``ticket``'s request (or it no longer waits): it keeps its place."""
        self._waiting.pop(ticket, None)

    def _preempt(self, victim: Ticket) -> None:
        stop = self._waiting.pop(victim)
        victim.preempted = True
        self._count_refusal(victim.criticality, "preempted")
        self.release(victim, served=False)
        stop()

    def preempted_error(self, ticket: Ticket) -> RequestError:
        """The refusal of a request whose place a more important one took (`waiting`), with the
        ``Retry-After`` of a refusal of its class at the door now (`retry_after_s`)."""
        ctl = self.controller
        if ctl is None:
            retry = self.drain_s()
        else:
            now = self._clock()
            c = ticket.criticality
            retry = ctl.retry_after_s(self.in_flight, ctl.class_cap(c, now), c, now)
        message = (f"{ticket.criticality.value} request preempted before the model started it: a more "
                   f"important request needed its place to stay within its latency objective. "
                   f"Retry after {retry} s.")
        return _refusal_error(429, ticket.criticality, retry, message)

    def release(self, ticket: Ticket, served: bool) -> None:
        """The request is over. ``served``: the model computed its answer to the end (only
        those measure the service rate; aborts, errors and cache answers do not). It measures
        the model of the level in force when it finishes, whatever the level at its admission:
        right after a step up the engine still serves the earlier level's work, and that is the
        server the door admits against."""
        if ticket.released:
            return
        ticket.released = True
        self._waiting.pop(ticket, None)
        self.in_flight -= 1
        now = self._clock()
        mark = self.share.mark(now, self.in_flight)
        if served and self.controller is not None:
            # the requests ahead bound a queue only the door did not bound (`ServiceModel.observe`)
            ahead = ticket.ahead if ticket.deadline_at is None else 0
            self.controller.observe_completion(now, now - ticket.admitted_at, mark - ticket.share_mark, ahead)
        if self._before_change and ticket.seq <= self._change_seq:
            self._before_change -= 1
            if not self._before_change and self.controller is not None:
                self.controller.end_hold()  # the last one admitted before the level change left
        if self._queue:
            self._hand_over()

    def set_replicas(self, model: int, ingress: int) -> None:
        """How many model and ingress replicas serve (the policy actor's view): this replica's
        share of the batches (`AdmissionController.set_replicas`)."""
        self.replicas = (int(model), int(ingress))
        if self.controller is not None:
            self.controller.set_replicas(model, ingress)
        if self._queue:  # a larger share of the batches may have room for those waiting
            self._hand_over()

    def observe_speed(self, replica: Any, slowdown: float) -> None:
        """A model replica's engine steps ``slowdown`` times slower than it did lately (its
        ``health()``, `policies.engine_speed`). The door predicts with the mean over the
        replicas read within `SPEED_FRESH_S` (the ingress's requests spread over them); one not
        read for longer no longer counts (`AdmissionController.set_speed`)."""
        now = self._clock()
        if not (isinstance(slowdown, (int, float)) and math.isfinite(slowdown) and slowdown > 0):
            return
        self._speeds[replica] = (float(slowdown), now)
        self._speeds = {r: v for r, v in self._speeds.items() if 0.0 <= now - v[1] <= SPEED_FRESH_S}
        if self.controller is not None:  # the replica just read is fresh: never an empty mean
            self.controller.set_speed(sum(f for f, _ in self._speeds.values()) / len(self._speeds), now)
        if self._queue:  # a faster engine may have room for those waiting at the door
            self._hand_over()

    def set_level(self, level: int) -> None:
        """The degradation level in force, as the ingress last fetched it: admission uses that
        level's measured service model (`AdmissionController.set_level`), within the caps before
        the change until the requests admitted before it have left (they still carry the
        earlier level's work; `release` ends the hold)."""
        self.level = int(level)
        if self.controller is not None:
            now = self._clock()
            # the level left is held only if a request it admitted is still in flight: the tickets
            # in flight not issued before the last change
            if self.controller.set_level(self.level, now, self.in_flight, self.in_flight > self._before_change):
                self._change_seq, self._before_change = self._issued, self.in_flight
        if self._queue:  # that level's caps may have room for those waiting at the door
            self._hand_over()

    def _refusal(self, d: Decision) -> RequestError:
        reason, klass = d.reason, d.criticality.value
        self._count_refusal(d.criticality, reason)
        # the message says which limit refused it (`Decision.limited_by`): a standard request
        # refused by its share alone, with no critical traffic, is not kept out for anyone's sake
        if reason == "saturated":
            why = "the service is saturated: even critical requests would miss the latency objective"
        elif d.limited_by in ("share", "overtaken") and self.controller is not None:
            ctl = self.controller
            why = (f"{klass} requests are admitted only while predicted to finish within "
                   f"{ctl.share_limit_s(d.criticality):.1f} s, class_share.{klass} ({ctl.share(d.criticality):g}) "
                   f"of the {ctl.e2e_s:g} s objective's budget")
            if d.limited_by == "overtaken":
                why += (", counting the more important requests that arrive while one waits for the model "
                        "and start before it")
        elif d.limited_by == "shut_out":
            why = (f"{klass} requests are shed while more important work alone arrives as fast as the "
                   "service completes requests")
        elif d.limited_by == "ramp" and self.controller is not None:
            step = self.controller.ramp_step
            why = (f"{klass} requests are admitted up to {step} request{'s' if step != 1 else ''} above the "
                   "load the service was measured at lately while it ramps up, keeping room for critical work")
        else:
            why = f"{klass} requests are being shed to keep room for more important work within its latency objective"
        message = (f"{why} ({self.in_flight} requests ahead, {klass} admitted below {d.max_admitted}; "
                   f"predicted {d.predicted_e2e_s:.1f} s). Retry after {d.retry_after_s} s.")
        assert d.retry_after_s is not None  # a refusal always has one
        return _refusal_error(d.status, d.criticality, d.retry_after_s, message)

    def _count_refusal(self, criticality: Criticality, reason: str) -> None:
        """Every refusal, at the door or by preemption: the gate's counters and the metric hook."""
        self.refused[(criticality.value, reason)] += 1
        self._on_refusal(criticality, reason)

    def drain_s(self) -> int:
        """Seconds for the work now admitted to drain at the measured rate (a Retry-After for
        refusals that come from past the door, e.g. a request dropped late); at least 1."""
        ctl = self.controller
        if ctl is None:
            return 1
        return max(1, math.ceil(ctl.drain_s(self.in_flight) - 1e-9))

    def signals(self) -> dict[str, float]:
        """Early signals for the policy actor: predicted end-to-end time, requests waiting for
        the model's batch, the share refused at the door; nothing while admission is off."""
        return self.controller.signals(self.in_flight, self._clock()) if self.controller is not None else {}

    def state(self) -> dict[str, Any]:
        """For ``/admin/brownout``: the caps per class, the measured rate, the counters."""
        ctl = self.controller
        now = self._clock()
        # first: a level change's hold that has run out ends here, before the caps are read
        class_cap = None if ctl is None else {c.value: ctl.class_cap(c, now) for c in Criticality}
        ramp = None if ctl is None else ctl.ramp_limit(now)
        return {
            "enabled": self.enabled,
            "in_flight": self.in_flight,
            "waiting": len(self._waiting),  # admitted, not started by the model, a lower class's to take
            "queued": len(self._queue),  # critical requests waiting at the full door for a slot
            # the longest a critical request at a full door waits for a slot it can finish in time with
            "critical_wait_s": None if ctl is None else round(ctl.critical_wait_s(), 3),
            "default_class": self.default_class.value,
            "rate_per_s": None if ctl is None else round(ctl.rate_per_s, 3),
            "base_latency_s": None if ctl is None else round(ctl.model.base_s, 3),
            "per_request_s": None if ctl is None else round(ctl.model.per_request_s, 3),
            # the latency of a request alone, measured within 5 s of the latest completion: n in flight are
            # predicted to take at most n times it (`ServiceModel.alone_s`); None where none was
            "latency_alone_s": None if ctl is None or ctl.model.alone_s is None else round(ctl.model.alone_s, 3),
            # latency measured past the line's recent points, per concurrency: a floor under it
            "latency_floor_s": None if ctl is None else {str(k): round(v, 3) for k, v in ctl.model.floor().items()},
            # the time constant the predicted_wait_ms signal averages the requests in flight over
            "wait_smoothing_s": None if ctl is None else round(ctl.wait_smoothing_s, 3),
            "level": self.level,
            "slots": None if ctl is None else ctl.slots,
            "model_replicas": None if ctl is None else ctl.model_replicas,
            "max_admitted": None if ctl is None else {c.value: ctl.max_admitted(c) for c in Criticality},
            # the caps in force now: the share's cap less the room kept for more critical classes
            "class_cap": class_cap,
            # seconds the caps before the last level change still bound these at most (`set_level`)
            "caps_held_s": None if ctl is None or ctl.held_until is None else round(max(0.0, ctl.held_until - now), 3),
            # level models found measured in a slower phase at a change up, and replaced (`set_level`)
            "level_models_replaced": None if ctl is None else ctl.models_replaced,
            # windows of completions read as the machine changing speed: the model rescaled (`ServiceModel.shift`)
            "speed_shifts": None if ctl is None else ctl.speed_shifts,
            # how many times slower the model's engine steps now than lately, as read from the model
            # replicas, and what the door applies of it: it predicts with its model times that
            # (`AdmissionController.set_speed`)
            "engine_slowdown": None if ctl is None else round(ctl.measured_slowdown, 3),
            "slowdown_applied": None if ctl is None else round(ctl.slowdown, 3),
            # each class's share's cap counting the more important work that would start before it
            # while it waits for a slot (`AdmissionController.overtaken_caps`)
            "overtaken_cap": None if ctl is None else {c.value: ctl.overtaken_cap(c, now) for c in Criticality},
            "reserved": None if ctl is None else {c.value: ctl.reserve(c, now) for c in Criticality},
            # the measured latency's 0.99 quantile over the model's prediction, and the limit it sets
            # the classes below critical (`AdmissionController.tail_limit`)
            "latency_tail": None if ctl is None else round(ctl.tail_factor, 3),
            "tail_limit": None if ctl is None else ctl.tail_limit,
            # whether it holds them now: critical work arrives and all classes keep the door at it
            "tail_holds": None if ctl is None else ctl.tail_holds(now),
            # the highest concurrency served requests were measured at in the last 10 s, and the
            # limit it sets the classes below critical while critical work arrives (`ramp_limit`)
            "measured_reach": None if ctl is None else ctl.measured_reach(now),
            # each class's arrivals per second, [long, fast] estimate (`arrival_rates`)
            "arrival_rate_per_s": None if ctl is None else {
                c: [round(long, 3), round(fast, 3)] for c, (long, fast) in ctl.arrival_rates(now).items()},
            "ramp_limit": ramp,
            # whether all classes arrive at least as fast as the door drains at that limit: only then
            # do its refusals count in refused_ratio, the level's signal (`ramp_pressed`)
            "ramp_pressed": None if ctl is None or ramp is None else ctl.ramp_pressed(ramp, now),
            "ramp_step": None if ctl is None else ctl.ramp_step,
            "admitted": dict(self.admitted),
            "refused": {f"{c}:{r}": n for (c, r), n in sorted(self.refused.items())},
        }
