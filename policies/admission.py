"""Deadline-aware admission by criticality: admit a request only if it can finish within its budget.

Pure: no clock, no I/O, no Ray. Every call takes ``now``; the caller keeps one
`AdmissionController` per ingress replica and feeds it what it sees.

The rule, and why:

- **A measured latency model sets the limit.** A request sharing the server with ``n`` requests
  in flight (itself included) is predicted to take ``latency_s(n)`` (`ServiceModel`): within the
  engine's batch (``n <= slots``, its ``max_num_seqs``) a line ``base_s + per_request_s * (n -
  1)`` fitted through the recent completions where the service runs; past it, a request also
  waits for a slot, ``latency_s(slots) * n / slots`` (Little's law at the full batch's rate,
  which is the saturation rate). Under batching everyone in flight slows down together, so a
  request with ``ahead`` requests already admitted and unfinished in front of it (running or
  waiting at the model, wherever they wait) is predicted to finish after ``overhead +
  latency_s(ahead + 1)``, and that same bound holds for every request already in flight once it
  is admitted. ``budget_s = slo.e2e_p99_ms - admission.overhead_ms`` (the time spent outside
  what the gate measures is taken off first).
- **Classes share the budget.** Class c may use ``class_share[c] * budget_s`` (critical 1.0,
  standard 0.9, sheddable 0.9 by default), so its concurrency cap ``max_admitted(c)`` is the
  most requests in flight ``n`` with ``latency_s(n) <= class_share[c] * budget_s`` (at least 1;
  `ServiceModel.max_within`) and it is admitted iff ``ahead < max_admitted(c)``: one integer
  comparison per request. As the backlog grows, sheddable is refused first, then standard;
  critical is admitted while any room remains. A request with nothing ahead is admitted, unless
  the classes above its own alone arrive at least as fast as the server completes requests
  (below). (With a prior rate and nothing measured, ``base_s = per_request_s = 1 / rate``: the
  line is ``n / rate`` on both sides of the batch, and the cap is Little's law,
  ``floor(class_share[c] * rate * budget_s)``.)
- **More important work overtakes a waiting request** (`overtaken_caps`). Inside vLLM the
  classes are priorities, and its scheduler starts every waiting request of a more important
  class first; so past the batch a standard request gets slots not at ``rate_per_s`` but at
  that less the rate at which critical work arrives meanwhile (sheddable: less critical's and
  standard's admitted rates), and the door's ``latency_s(ahead + 1)`` would be short by those
  that overtake it. A class's cap is therefore the most requests in flight at which it finishes
  within its share counting them (`overtaken_within_s`: the wait past the batch, stretched by
  ``rate / (rate - above)``); within the batch it starts at once, and critical's cap is its
  share's. Measured before this rule (12-06, 2-core AVX-512 Xeon, 2 s SLO, 3 x C0 with 20%
  critical work): the share of the admitted standard requests that finished late rose with
  critical work's offered rate over C3, from 0% at 0.38 to 33.7% at 0.58.
- **Room is kept for more important work (trunk reservation).** Shares alone do not protect
  critical work where the caps are small: with a few requests' worth of budget, 1.0 and 0.9 of
  it round to the same cap, and a class below fills every slot critical could use. So each class
  is held to a limit below its share's cap, sized with Erlang's loss model of the door
  (`loss_chain`): the classes arrive as Poisson at their measured rates (requests offered per
  second, admitted or refused, decayed over ``reserve_window_s``, or over a fifth of it where
  that is higher: `ArrivalRate.peak`, so a step up in demand is seen within seconds), each admitted below its
  limit, and ``n`` requests in flight complete at ``n / latency_s(n)`` (the measured model). A
  class's limit is the highest at which it raises the share of refused requests of every class
  above it by at most ``1 - reserve_quantile`` (0.99: one point), over the same model without
  it (`reserved_limits`). This is the telephone network's trunk reservation, sized from the
  measured demand and service, not from a worst case: with no critical traffic nothing is
  reserved (a class whose measured arrivals have faded below `ABSENT_WEIGHT` of a request, or
  that has not arrived for `ABSENT_GAPS` of its mean gaps, counts as none:
  `ArrivalRate.present`), and where the server is far from full a class below keeps most of
  its cap. (It
  replaced a reserve of the 99th percentile of the arrivals of the classes above within the
  latency at critical's cap, which at 1.5 x C0 on a 2-core EPYC refused 23% of all requests
  while the served p99 was 0.69 x SLO; with that run's rates and a fitted line, this model puts
  the old rule's standard and sheddable limits at one request in flight.)
  And while the classes above a class alone arrive at least as fast as the server completes
  requests (their ``lam``, less one standard deviation of its estimate, ``>= rate_per_s``:
  `rate_lower_bound`, on the long estimate or the fast one), that class is shut out, even from an idle server: they will take every
  slot. Without this, where caps are small, standard and sheddable both
  sit at the floor of one request under overload and are shed alike, not in order (measured at
  3x C0 on 2 cores: sheddable 66.7% shed, standard 69.4%).
- **Room for critical work's tail.** The objective is a p99, and critical work is to be 99%
  within it, but ``latency_s`` predicts a mean; on 2 cores the latencies of requests run at the
  same concurrency spread to 1.55-1.63 x their median at the 99th percentile (12-04, AVX-512
  EPYC, 2 s SLO), and critical requests admitted beside standard work held at its share's cap
  (at the mean) ran late. So the controller measures that spread (`LatencyTail`: each served
  request's latency over the model's prediction at the concurrency it ran at, over the last
  `TAIL_WINDOW`, as a lognormal's 0.99 quantile with a robust deviation), and while critical
  work arrives and all classes together arrive at least as fast as the door drains at that
  limit (so it stays there, and a critical request runs its whole life at it), the classes
  below critical are held to the concurrency at which the prediction times that factor meets
  critical's budget (`AdmissionController.tail_limit`, `_tail_pressed`): they do not take the
  server past where 99% of requests finish within it (critical work itself may). With no
  critical work arriving, or arrivals that reach the limit only in a clump, the spread changes
  nothing; ``reserve_quantile`` 0 turns it off with the rest of the room kept.
- **A ramp into load not measured lately** (`AdmissionController.ramp_limit`). The caps rest on a
  line fitted where the service ran lately and on what was measured higher up within about a
  minute (`ServiceModel`); above both the line is extrapolated, and the first seconds of an
  overload from calm, or after a lull, admitted standard and sheddable work to concurrencies
  that ran far slower than the line said. So while critical work arrives the classes below it
  are admitted to at most ``admission.ramp_step`` (a fifth of the batch, 3 for 16 sequences)
  requests above the highest concurrency a served request ran at within `RAMP_WINDOW_S`, at
  least `RAMP_MIN`: additive increase, each completion higher up opening the next step;
  critical work keeps its own cap.
- **Critical work at a full door waits for a freed slot it can still finish in time with**
  (`serve_app.admission`): for up to `AdmissionController.critical_wait_s`
  (``admission.critical_wait_share``, 0.5, of the SLO, and no longer than an idle server could
  still finish it in time) before it is refused; each release hands its slot to the first in
  line that is still predicted to finish within critical's limit with it, its wait so far plus
  the predicted end-to-end time at the door's count (`in_time_after`), while critical's cap has
  room; no lower class is admitted meanwhile (those waiting count as ahead of it), and the
  deadline still runs from the request's arrival. A full door drains in clumps: the requests a
  burst admitted run in one batch and finish together, so the first slot may free only after a
  second or more, and the next ones at once. Measured (12-07, 2-core AVX2 EPYC, 5 s SLO, six
  repeats at 3 x C0 with 20% critical work) with a wait of a tenth of the SLO given to the first
  in line: each of the four critical refusals came after its whole 0.5 s wait at a door full at
  critical's cap (a burst of critical arrivals, or a second of a slow engine reading), and the
  door fell to 1-2 in flight 1.1-2.4 s after the wait began; a wait twice as long (0.2), given
  to the first in line, refused as many at the onset, when a level change's hold kept the door
  full (bench/RESULTS.md). A longer wait for the first freed slot would finish late by the
  wait; the in-time rule waits on instead, for a slot further down the drain. The wait's bound
  reads the engine at its usual speed (`model`), so a slowdown read for a moment (`set_speed`)
  is waited out rather than refused at once. Not
  while critical work alone arrives at least as fast as the server completes requests
  (`saturated_by`): every freed slot then goes to a critical request anyway, and one that
  waited for it has spent that much of its budget at a door whose cap already uses the rest (at
  3 x C0 with every request critical, before this: each refusal came after its wait, 222 ms
  median, and the median latency was 1.98 s; after it: refusals in 20 ms, goodput 1.01 x C3).
- **Waiting work of a lower class gives way (preemption).** Room is kept from measured rates,
  so it lags a step up: at the onset of an overload from idle the door fills with whatever
  arrives first, before any rate says how much room critical work needs (measured at 0 -> 3x C0
  with 20% critical: every critical refusal of the run fell in its first 5 s). A request the door
  refuses may instead take the place of admitted requests of less important classes that the
  model has not started yet (no token computed, no header sent), the fewest that make room for
  it (`decide`'s ``preemptible``). Those are refused then, 429 ``preempted``, with the same
  computed ``Retry-After``; what runs is never aborted, and a class never displaces its own or a
  more important one. ``admission.preempt_waiting: false`` switches it off.
- **Refusals are honest.** A refused class that critical work could still pass gets 429
  ``class_share_exhausted``; when even critical is refused the service is ``saturated``: 503.
  ``Retry-After`` is the predicted time for the backlog to drain to where this class is admitted
  again, ``ceil((ahead + 1 - max_admitted(c)) / (rate_per_s - above))``: the saturation rate
  less the rate at which the classes above it keep being admitted meanwhile (they take the freed
  slots first; `arriving_above`), clamped to ``[min_retry_after_s, max_retry_after_s]`` (the
  maximum where they take every slot): it grows with the backlog instead of inviting every
  refused client back at once after a constant.
- **The engine's speed, read at its steps** (`set_speed`, `policies.engine_speed`). The model
  learns from completions, which a starved engine (a noisy neighbour on its CPUs, a throttled
  GPU) stops delivering for as long as its slowed requests run. So each model replica also
  measures how many times slower its engine steps now than it did lately at the same batch,
  the ingress reads it every half second, and the door predicts with its model times that
  slowdown (less a margin of a quarter: noise changes no cap), and divides each completion by
  its mean slowdown over its life before the model learns it: the model keeps the engine's
  usual speed, and the slowdown says how far from it the engine is now, so the caps fall
  within about a second of a starvation and come back the moment it ends.
- **Late work is dropped, not computed.** Each admitted request carries ``deadline_at = now +
  e2e_p99``; `should_drop` tells the model deployment, just before the engine starts it, that it
  can no longer finish in time. Its answer would miss the SLO anyway, and computing it would
  delay the requests behind it that still can make it.
- **The model is measured from every served request, at any load.** The gate keeps a
  `ShareClock`: a request's own service time is its latency divided by how many requests it
  shared the server with. Each served completion is one point of the latency curve at the
  concurrency it saw (`ServiceModel.observe`); the points are gathered over windows of
  ``rate_window_s``, older ones fade by ``1 - rate_alpha`` per window, and the line is their
  least-squares fit, so it holds where the service runs now. A completion rate counted over windows cannot do this:
  at low load it measures demand, not capacity, and with the few, bursty completions of LLM
  requests (a batch finishes together) its windows are noise, which an estimate that low load
  may only raise turns into drift upwards; admission then lets through work that cannot finish
  in time. Cold start uses ``prior_rate_per_s`` (``1 / rate`` per request, moved by windows
  like a measurement) or, without one, `default_prior` (alone half the SLO; a full batch the
  whole SLO), a guess that the first completion measuring it replaces.
- **Each level has its own model** (`AdmissionController.set_level`). Optional work takes the
  same CPU as the model and shaping shortens answers, so capacity differs by level; on a level
  change the level's own measurements apply at once, but not above the caps before the change
  while requests admitted before it are in flight (they still carry the earlier level's work;
  at most one SLO). Levels are ordered by cost (a higher level does less), so at a change up a
  model of the new level that predicts a fifth more latency than the model in force where that
  one was just measured came from a slower phase of the machine, and the new level starts from
  the model in force instead.
- **Refusing is a signal for the level, and the earliest one.** Admission keeps what is in flight
  under the SLO by refusing, so past capacity the in-flight count and ``predicted_wait_ms`` stop
  growing exactly when demand keeps growing: a policy that watched only them would refuse core
  traffic while optional features still ran (measured: with reservation, a 0.5x -> 3x step
  raised level 1 only after 7 s). So the controller also reports ``refused_ratio``, the share of
  the requests it decided on over the last ``refusal_window_s`` that it refused for capacity
  (`RefusalWindow`). The first refusal is the moment demand exceeds what the level in force can
  serve within the SLO; the derived policy (`policies.slo`) raises the level on it, so optional
  work is switched off before more core traffic is refused, and holds the level until the
  window has been free of refusals for the recover dwell. With nothing arriving the ratio is
  0, so a level raised on it always recovers when the load is gone. A refusal of the ramp
  (below), and a waiting request displaced where the ramp filled the door (preemption, below),
  count only while all classes together arrive at least as fast as the door drains at the
  ramp's cap (`AdmissionController.ramp_pressed`): the ramp refuses concurrency not measured
  lately, and at the start of a load from calm a clump at half the capacity reached it and
  raised level 2 on one refusal (on 12-06 also on two displaced sheddable requests).

Why not Netflix Gradient2/Vegas alone: they steer a concurrency limit from the ratio of a
long-term (or minimum) RTT to the current one, which needs a stable no-load latency. An LLM
request's latency depends mostly on its output length, so its RTT gradient is noise; and they
know nothing of an SLO or of classes. Admission against an explicit budget with a measured
latency model gives the same adaptive limit (the concurrency at which latency meets the
budget), reasons in the SLO's own units, and serves classes with one comparison.

Per replica: each ingress replica keeps its own controller and counts its own requests in
flight and its own completions; with ``n`` ingress replicas in front of ``m`` model replicas its
share of the batches is ``slots = max_num_seqs * m / n`` (`AdmissionController.set_replicas`,
which the ingress calls with the counts the policy actor publishes), and its ``model_queued`` is
what it has beyond that share divided by ``m``: summed over the ingress replicas, the requests
waiting per model replica, which is what queue triggers sized against one engine expect. A
stalled engine (no completions at all) does not move the model, but the cap still bounds what
is admitted meanwhile, and the engine's speed read at its steps lowers it (below).

Wiring (the ingress)::

    admission = AdmissionController.from_config(policy, max_num_seqs=16)   # None: admit all
    klass = classify(key_tier or policy.slo.default_class, headers.get(CRITICALITY_HEADER))  # ValueError: 400
    d = admission.decide(klass, ahead=in_flight, now=time.time())
    if not d.admitted:   # d.status 429/503, d.reason, d.retry_after_s -> Retry-After header
        ...
    in_flight += 1; mark = share.mark(now, in_flight)   # a ShareClock; request["priority"] = klass.vllm_priority
    ...; in_flight -= 1; end = share.mark(time.time(), in_flight)
    admission.observe_completion(time.time(), latency_s, end - mark)   # served by the model only
    admission.set_speed(model_replica_health["slowdown"], time.time())   # every probe (0.5 s)
    admission.set_level(level, time.time(), in_flight, left_in_flight)   # whenever the level changes
                                             # (left_in_flight: a request the level left admitted still runs);
    admission.end_hold()                     # ... and when the last request admitted before it leaves
    # on reconfigure(): admission.update(policy.slo, policy.admission or AdmissionConfig())
    # the model deployment, before the engine starts a request:
    if should_drop(d.deadline_at, time.time()): ...            # abort, answer 503
    # every report tick: admission.signals(in_flight, time.time())
    #                    -> predicted_wait_ms, model_queued, refused_ratio
"""

from __future__ import annotations

import bisect
import collections
import enum
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from policies.config import CRITICALITIES, AdmissionConfig, DegradationConfig, SloConfig

CRITICALITY_HEADER = "X-Brownout-Criticality"


class Criticality(str, enum.Enum):
    """A request's class. Declared most important first; `rank` 0 is the most important."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def vllm_priority(self) -> int:
        """vLLM's ``priority`` under its priority scheduling policy: lower starts first."""
        return _RANK[self]


_RANK = {c: i for i, c in enumerate(Criticality)}
assert tuple(c.value for c in Criticality) == CRITICALITIES, "config and enum must agree"


def classify(base: Criticality | str, header: str | None = None) -> Criticality:
    """The class a request is served at: ``base`` (its key's tier or the configured default),
    lowered by the ``X-Brownout-Criticality`` header, never raised.

    A header naming a more important class than ``base`` is ignored (the base stands). An
    unknown value raises `ValueError` naming it and the valid values (the ingress answers 400).
    """
    base = Criticality(base)
    if header is None or not header.strip():
        return base
    try:
        asked = Criticality(header.strip().lower())
    except ValueError:
        raise ValueError(
            f"{CRITICALITY_HEADER}: unknown class {header!r}; valid: {', '.join(CRITICALITIES)}"
        ) from None
    return asked if asked.rank > base.rank else base


def should_drop(deadline_at: float | None, now: float, min_service_s: float = 0.0) -> bool:
    """True when a request that has not started yet can no longer finish by ``deadline_at``.

    ``min_service_s`` is the least time the engine needs for it (0: drop only once the deadline
    has passed). Call it where the engine is about to start the request; ``deadline_at`` None
    (admission off) never drops.
    """
    return deadline_at is not None and now + min_service_s > deadline_at


Reason = Literal["admitted", "class_share_exhausted", "saturated", "preempted", "expired"]
Limit = Literal["share", "reserve", "shut_out", "ramp", "overtaken", "saturated"]
STATUS: dict[Reason, int] = {"admitted": 200, "class_share_exhausted": 429, "saturated": 503, "preempted": 429,
                             "expired": 503}


@dataclass(frozen=True, slots=True)
class Decision:
    """One admission decision. ``status``: 200 admitted, 429 class share exhausted, 503 saturated.

    ``preempt``: when admitted, how many admitted requests of less important classes that the
    model has not started yet must give this one their place (`AdmissionController.decide`);
    the caller refuses them (429 ``preempted``). 0 when the door had room.
    """

    admitted: bool
    criticality: Criticality
    reason: Reason
    status: int
    predicted_e2e_s: float  # overhead + latency_s(ahead + 1)
    max_admitted: int  # this class's concurrency cap at the time of the decision
    retry_after_s: int | None = None  # integer seconds >= 1 when refused
    deadline_at: float | None = None  # when admitted: past it the answer misses the SLO
    preempt: int = 0  # admitted in the place of this many waiting requests of lower classes
    # when refused, the first limit that refuses it alone: "saturated" (even critical's cap is
    # reached), "share" (the class's own share of the latency budget, ``slo.class_share``),
    # "shut_out" (the classes above alone arrive as fast as the server completes requests),
    # "ramp" (``admission.ramp_step`` past the concurrency measured lately, `ramp_limit`),
    # "overtaken" (its share of the budget, counting the work of the classes above that would
    # start before it while it waits, `overtaken_caps`) or "reserve" (room kept for the classes
    # above, `reserved_limits`)
    limited_by: Limit | None = None


class ShareClock:
    """Each request's share of the service: ``V(t) = integral of dt / max(1, n(t))``.

    ``n(t)`` is the number of requests admitted and unfinished. Between two events every one of
    them gets an equal share of the server (vLLM batches them; on CPU the enrichments share the
    same cores), so a request's own service time is ``S = V(end) - V(start)``: its latency ``L``
    divided by the (harmonic) mean number of requests it shared the server with. Call `mark` at
    every change of ``n`` (an admission, a release) with the new count; it returns ``V(now)``.
    """

    __slots__ = ("value", "_at", "_n")

    def __init__(self) -> None:
        self.value = 0.0
        self._at: float | None = None
        self._n = 0

    def mark(self, now: float, in_flight: int) -> float:
        if self._at is not None and now > self._at and self._n > 0:
            self.value += (now - self._at) / self._n
        if self._at is None or now > self._at:
            self._at = now
        self._n = max(0, in_flight)
        return self.value


class SpeedClock:
    """The engine's slowdown over time (`set`), so that a request's mean slowdown over its life is
    known at its completion (`mean`): ``F(t) = integral of f(t) dt``, with ``f`` piecewise
    constant between the values set and 1 before the first. Breakpoints older than ``keep_s``
    are forgotten (a span starting before the oldest kept reads the value before it, the last
    one forgotten)."""

    __slots__ = ("keep_s", "_points", "_before")

    def __init__(self, keep_s: float = 600.0) -> None:
        self.keep_s = float(keep_s)
        self._points: collections.deque[tuple[float, float, float]] = collections.deque()  # (t, F(t), f from t)
        self._before = 1.0  # the slowdown before the oldest breakpoint kept

    @property
    def value(self) -> float:
        """The slowdown in force: the latest set, 1 before any."""
        return self._points[-1][2] if self._points else 1.0

    def set(self, now: float, slowdown: float) -> None:
        """From ``now`` on the engine is ``slowdown`` times slower than the model's measure."""
        if self._points and now < self._points[-1][0]:
            now = self._points[-1][0]  # a late timestamp counts from the latest breakpoint
        self._points.append((now, self._integral(now), float(slowdown)))
        while len(self._points) > 1 and now - self._points[1][0] > self.keep_s:
            self._before = self._points.popleft()[2]

    def _integral(self, t: float) -> float:
        if not self._points:
            return t
        i = bisect.bisect_right(self._points, t, key=lambda p: p[0]) - 1
        if i < 0:
            at, total, _ = self._points[0]
            return total - self._before * (at - t)
        at, total, f = self._points[i]
        return total + f * (t - at)

    def mean(self, start: float, end: float) -> float:
        """The mean slowdown over ``[start, end]``; the value at ``end`` for an empty span."""
        if end <= start:
            return self.value_at(end)
        return (self._integral(end) - self._integral(start)) / (end - start)

    def value_at(self, t: float) -> float:
        """The slowdown in force at ``t`` (1 before any was set)."""
        i = bisect.bisect_right(self._points, t, key=lambda p: p[0]) - 1
        return self._before if i < 0 else self._points[i][2]


class SlowedModel:
    """A `ServiceModel` read at an engine ``slowdown`` times slower than the one it measured:
    latencies times it, the saturation rate over it (`AdmissionController.set_speed`)."""

    __slots__ = ("model", "slowdown")

    def __init__(self, model: ServiceModel, slowdown: float) -> None:
        self.model, self.slowdown = model, float(slowdown)

    def latency_s(self, n: float) -> float:
        return self.slowdown * self.model.latency_s(n)

    def max_within(self, limit_s: float) -> int:
        return self.model.max_within(limit_s / self.slowdown)

    @property
    def rate_per_s(self) -> float:
        return self.model.rate_per_s / self.slowdown


class ServiceModel:
    """The measured latency model of a batching engine: a request sharing the server with ``n``
    requests (itself included) takes

        n <= slots:  base_s + per_request_s * (n - 1)       (within the batch: a line)
        n >  slots:  latency_s(slots) * n / slots           (past it: queueing, Little's law)

    Why this shape: within a batch each engine step costs a fixed part plus a part per sequence,
    and on CPU the optional stages of the requests in flight take the same cores, so each extra
    request in flight adds about ``per_request_s`` to everyone's latency. Past the batch
    (``slots``: the engine's ``max_num_seqs``, or this replica's share of it) a request waits
    for ``n - slots`` others to finish at the full batch's rate ``slots / latency_s(slots)``
    before it runs, which is the second line. The saturation rate is that full batch's rate.
    With ``slots`` None the line holds for every ``n`` (one server, no batch bound).

    Why a free intercept, fitted where the service runs: a batching engine's latency is not a
    line in the requests in flight (measured on 2 cores with the embedded model: one request
    alone 0.78 s; 4-6 in flight 1.35 s; 12-14 in flight 1.57 s while the completions doubled). A
    line anchored at the latency alone and fitted through the operating point reads a steep
    slope wherever the door runs low (0.13-0.15 s per request at 4-5 in flight against 0.07 at
    11-15), gives caps that hold the door where it is, and never measures the flat part above:
    the door had two stable states, one at a third of the other's goodput. A line fitted
    through the recent points alone is right where they are, which is where the caps are
    decided: it is the local slope, so the door climbs while the latency there has room in the
    budget and stops where it has none; and past the batch Little's law bounds the cap however
    flat the slope reads.

    Each completion of a request the model served gives ``(L, S)`` (`ShareClock`): it shared the
    server with ``m = L / S`` requests on average, a point ``(x, y) = (m - 1, L)``; past the batch
    (``m > slots``) the point of the full batch it implies, ``(slots - 1, L * slots / m)``.
    Points are gathered over windows of ``window_s`` (a window closes at the first completion at
    least ``window_s`` after it opened); at each close the points gathered so far fade by ``1 -
    alpha`` and the window's are added (weight 1 each), and the line is their least-squares fit
    with a ridge of `RIDGE` towards the slope in force: where the points barely spread (a
    steady load, one request at a time) the slope stays as it was and the line moves through
    their mean; where they spread, they decide it. The slope is kept above `MIN_SLOPE` (a flat
    or falling line is noise; Little's law past the batch bounds the caps). A built-in prior
    (`default_prior`: a guess, possibly far off) contributes no point, so the first window that
    closes (its first completion) replaces it; an operator's rate (`from_rate`) is trusted like
    one measured point at ``n = 1`` that fades like the others. Every completion counts, at any
    load: there is no busy/idle distinction to get wrong, and a capacity change (another level,
    a slower replica, a noisy neighbour) is tracked within a few windows.

    Past the recent points, a remembered floor. The line is local: its points fade within a few
    windows, so after a lull it is fitted where the lull ran (one or two in flight), and its
    extrapolation to the caps forgets what a burst measured there a minute before. Measured on
    the 2-core EPYC (12-03, 3 x C0, from the clients' records): latency grew about 0.1 s per
    request up to 9 in flight and 0.3-0.4 s per request past that; in a lull of a few seconds
    the fitted slope fell from 0.108 to 0.059 s and critical's cap rose from 12 to 16, and the
    burst that followed ran 13 in flight at 2.2-2.4 s where the line said 1.65 s (ten requests
    late, one of them critical). So each completion also goes into the bucket of its
    concurrency (``round(m)``, the point's ``x + 1``), a mean latency whose weight fades with
    time (`FLOOR_TAU_S`, 60 s). Above the highest bucket measured in the last `FLOOR_FRESH_S`
    (where the line's recent points are, and the line is the better guide), every bucket that
    still weighs `FLOOR_MIN_WEIGHT` completions is a floor under the prediction at its
    concurrency and above (`floor`): the door does not admit into a concurrency measured too
    slow within about the last minute, whatever the line extrapolates. A bucket the caps keep
    the door out of is not measured again, so it lasts until its weight has faded below the
    minimum: ``FLOOR_TAU_S * ln(weight / FLOOR_MIN_WEIGHT)``, one to three minutes for 10-60
    completions (after a capacity gain the caps stay below it that long). A level's model
    starts without buckets (`copy` takes the line only): another level runs at another speed.

    A changed machine. A noisy neighbour (another tenant, a throttled core) changes the speed
    of every request at once, and the faded points then mix two speeds at different
    concurrencies. Measured (12-04, 2-core AVX-512 EPYC, 2 s SLO, 1.5 x C0): the machine ran
    three times slower for 30 s, the door followed it down to one or two in flight, and when
    it came back the slow points at two in flight and the fast ones after them at one read a
    slope of 0.45-0.63 s per request for 40 s (0.11 before); fading does not undo such a pair
    (it shrinks their spread and their covariance alike), and where the points do not spread
    the ridge keeps the slope, so the door stayed at one or two in flight and 55% of the
    requests were within the SLO. The other way round, slow points below fast ones read a
    falling line, and the caps rose as the machine slowed. So the completions of a window
    near the points the line was fitted on (`_near_fitted`: within `SHIFT_SPAN` of their mean
    concurrency, where the line is measured, not extrapolated, and where its slope moves it
    little) are compared with the line: where they took more than `SHIFT_RATIO` times its
    prediction, either way (for `SHIFT_COUNT` of them; fewer must be further off, their mean
    being noisier), the machine's speed changed by that ratio (`shift`, at most `SHIFT_MAX` a
    window): the line, the points before the window and the buckets not measured in it are
    rescaled by it (the curve's shape at the new speed), and the window counts as those near
    completions at their mean (it may also hold completions from before the change). Away from the fitted points a
    window is not read so: there the curve itself may leave the line (a knee the line
    extrapolates past, a lull below it, a slope never measured). Nor where the line is steep:
    measured with four busy processes beside the server on 2 cores for 30 s (`bench/overload.py
    --neighbour`), requests took 11-27 s, none finished meanwhile, and their completions after
    it left a line through about the origin at 1.6 s per request; alone, 0.7 s was then read
    as a hundred times slower, and the line was rescaled to 223 s per request.
    In the door's model (`bench/door_sim.py`, the EPYC's knee-shaped engine at 2.3 req/s, 48
    seeds; bench/results/door_sim_shift.json) the requests sent after a slow phase (10 to 40 s
    into the load) were 77.9 -> 90.7% within the SLO when it was three times slower, 85.1 ->
    93.5% twice, 97.7% in both without one; during it the door follows the slower machine at
    once and refuses more critical work (fewer of it late). At 7 and 9 req/s (96 seeds) and
    on a concave curve nothing moved beyond noise. What it does not mend: after a neighbour
    that starves the engine (no completion for 30 s), the line read from the late completions
    at 7-12 in flight and the fast ones alone after them stays steep (1.8-3.0 s per request,
    the door at one in flight) for a minute and more: no completion near its points
    contradicts it. The next paragraph bounds it.

    A work-conserving bound. A server that can run requests one after another serves ``n`` of
    them in at most ``n`` times what one takes alone; a batching engine serves a few in far
    less (the EPYC: 0.62 s alone, 0.73 s at 2 in flight). So where requests alone were measured
    just now (`alone_s`: the median of the latest `ALONE_COUNT` completions alone, while the
    last is within `FLOOR_FRESH_S` of the latest completion), ``latency_s(n)`` for ``n >= 2``
    is at most ``n * alone_s``, whatever the line or the floor say, and `max_within` admits at
    least ``limit / alone_s`` when that is 2 or more. Within the bound nothing moves (no line
    measured on a running engine exceeds it); it is the way out of a steep line that the door,
    held at one in flight by it, never measures: at two in flight the completions move the line
    again. A changed machine forgets the latencies alone measured before its window (they may
    be of either speed). The same measurement anchors the line: where a fit's intercept falls
    more than `PIVOT_RATIO` below `alone_s` (a line read across a starvation ran through about
    the origin, 1 ms alone, while requests alone took 0.5 s, and the latency's spread measured
    against it held standard work at one in flight), the line pivots on its points' mean
    through the latency alone instead (`_fit`). In the door's model (48 seeds, the engine ten
    times slower from 20 to 50 s) 32% -> 68% of the requests sent after the slow phase were
    within the SLO (62% with the bound alone), critical work 53% -> 73% over the runs; at 3 x
    and after a threefold slowdown within noise. Beside two or three busy processes on the
    2-core EPYC (`bench/overload.py --neighbour`), 33-35% -> 71-74% of the requests sent after
    them (bench/RESULTS.md, 12-05). During a starvation itself the door still admits up to its
    caps: nothing finishes to learn from.
    """

    RIDGE = 2.0  # weight (completions x requests^2) of the slope in force against the points' spread
    MIN_SLOPE = 1e-3  # seconds per request: a flat or falling fitted line is read as this
    PIVOT_S = 1e-3  # the base of a line pivoted through (about) the origin (`_fit`)
    PIVOT_RATIO = 1.5  # or through `alone_s`, where the fitted base is more than this many times below it

    # a changed machine (`shift`, and the class docstring): a window whose completions within
    # SHIFT_SPAN requests of the fitted points' mean concurrency took more than SHIFT_RATIO times
    # what the line predicted for them, either way, for SHIFT_COUNT of them (fewer: more)
    SHIFT_RATIO = 1.5
    SHIFT_SPAN = 0.75
    SHIFT_COUNT = 4
    SHIFT_MAX = 4.0  # at most this much per window, either way: a larger change is read in steps
    SHIFT_SLOPE_SHARE = 0.2  # `_near_fitted`

    # the remembered floor (see the class docstring): a bucket's weight fades with this time
    # constant, it counts while it weighs at least FLOOR_MIN_WEIGHT completions, and the line
    # rules up to the highest bucket measured within FLOOR_FRESH_S
    FLOOR_TAU_S = 60.0
    FLOOR_MIN_WEIGHT = 3.0
    FLOOR_FRESH_S = 5.0
    ALONE_COUNT = 3  # `alone_s`: the median of at most this many latest completions alone

    __slots__ = ("base_s", "per_request_s", "slots", "window_s", "alpha", "_measured", "_opened_at",
                 "_window", "_near", "_sums", "_buckets", "_floor", "_alone", "_alone_s", "shifts", "learned")

    def __init__(self, base_s: float, per_request_s: float, window_s: float = 1.0, alpha: float = 0.3,
                 trusted: bool = False, slots: int | None = None) -> None:
        if not (base_s > 0 and per_request_s > 0 and window_s > 0 and 0 < alpha <= 1):
            raise ValueError(
                f"need base_s > 0, per_request_s > 0, window_s > 0, 0 < alpha <= 1; "
                f"got {base_s!r}, {per_request_s!r}, {window_s!r}, {alpha!r}"
            )
        if slots is not None and slots < 1:
            raise ValueError(f"need slots >= 1 (the engine's batch size) or None, got {slots!r}")
        self.base_s = float(base_s)
        self.per_request_s = float(per_request_s)
        self.slots = slots
        self.window_s = window_s
        self.alpha = alpha
        self._measured = trusted  # past a built-in guess: windows fold in, not replace
        self._opened_at: float | None = None
        self._window = [0.0] * 5  # the open window's sums: weight, x, y, x * x, x * y
        # its completions near the fitted points (`shift`): their latencies, count and x
        self._near = [0.0, 0.0, 0.0]
        # the faded sums of the points before it; an operator's rate is one point at n = 1
        self._sums = [1.0, 0.0, self.base_s, 0.0, 0.0] if trusted else [0.0] * 5
        self._buckets: dict[int, list[float]] = {}  # concurrency -> [weight, sum of latencies, when]
        self._floor: dict[int, float] = {}  # `floor`, as of the latest completion
        # the latest completions alone (`alone_s`): [latency, when]
        self._alone: list[list[float]] = []
        self._alone_s: float | None = None  # `alone_s`, as of the latest completion
        self.shifts = 0  # windows read as the machine changing speed (`shift`)
        self.learned = False  # it (or the model it was copied from) has learned from a completion

    @classmethod
    def from_rate(cls, rate_per_s: float, window_s: float = 1.0, alpha: float = 0.3,
                  slots: int | None = None) -> ServiceModel:
        """An operator's rate: ``1 / rate`` per request, alone or not (Little's law with requests
        served one after another). Trusted like a measurement: windows move it."""
        if not rate_per_s > 0:
            raise ValueError(f"need prior_rate_per_s > 0, got {rate_per_s!r}")
        return cls(1.0 / rate_per_s, 1.0 / rate_per_s, window_s, alpha, trusted=True, slots=slots)

    @property
    def rate_per_s(self) -> float:
        """Completions per second at saturation: a full batch's (``slots / latency_s(slots)``),
        or ``1 / per_request_s`` without a batch bound."""
        if self.slots is None:
            return 1.0 / self.per_request_s
        return self.slots / self.latency_s(self.slots)

    def fresh_reach(self, now: float | None = None) -> int:
        """The highest concurrency (``round(m)``) with a completion within `FLOOR_FRESH_S` of
        ``now`` (default: the latest completion); 0 where none."""
        if now is None:
            now = max((c[2] for c in self._buckets.values()), default=0.0)
        return max((k for k, c in self._buckets.items() if now - c[2] <= self.FLOOR_FRESH_S), default=0)

    def floor(self) -> dict[int, float]:
        """The remembered floor in force, as of the latest completion: per concurrency above the
        line's fresh reach (the highest bucket measured within `FLOOR_FRESH_S`), the mean latency
        measured there, for the buckets that still weigh `FLOOR_MIN_WEIGHT` completions after
        fading by `FLOOR_TAU_S`. Empty where nothing was measured past the reach."""
        return dict(self._floor)

    @property
    def alone_s(self) -> float | None:
        """The latency of a request alone measured just now (the class docstring's work-conserving
        bound): the median of the latest `ALONE_COUNT` completions alone (``round(m) == 1``)
        within `FLOOR_FRESH_S` of the latest completion; None where there are none."""
        return self._alone_s

    def _floor_s(self, n: float) -> float:
        return max((v for k, v in self._floor.items() if k <= n), default=0.0)

    def latency_s(self, n: float) -> float:
        """Predicted latency of a request sharing the server with ``n`` requests, itself included."""
        n = max(1.0, n)
        if self._alone_s is None or n < 2.0:  # alone, the line (fitted on many) is the better guide
            return self._curve_s(n)
        return min(self._curve_s(n), n * self._alone_s)

    def _curve_s(self, n: float) -> float:
        line = max(self.base_s + self.per_request_s * (n - 1.0), self._floor_s(n))
        if self.slots is None or n <= self.slots:
            return line
        return max(line, self._curve_s(self.slots) * n / self.slots)

    def max_within(self, limit_s: float) -> int:
        """The most requests in flight at which ``latency_s`` is at most ``limit_s``; at least 1."""
        bound = 0 if self._alone_s is None else math.floor(limit_s / self._alone_s + 1e-9)
        return max(bound if bound >= 2 else 0, self._curve_within(limit_s))

    def _curve_within(self, limit_s: float) -> int:
        n_line = math.floor((limit_s - self.base_s) / self.per_request_s + 1e-9) + 1
        for k, v in self._floor.items():  # the first concurrency remembered too slow, and above
            if v > limit_s:
                n_line = min(n_line, k - 1)
                break
        if self.slots is None or n_line <= self.slots:
            return max(1, n_line)
        n_queue = math.floor(limit_s * self.slots / self._curve_s(self.slots) + 1e-9)
        return max(1, min(n_line, n_queue))

    def copy(self) -> ServiceModel:
        other = ServiceModel(self.base_s, self.per_request_s, self.window_s, self.alpha, slots=self.slots)
        other._measured = self._measured
        other._sums = list(self._sums)
        other.learned = self.learned
        return other

    def observe(self, now: float, latency_s: float, service_s: float, ahead: int = 0) -> bool:
        """One served completion at ``now``: latency ``latency_s``, own service ``service_s``,
        ``ahead`` requests in flight when it was admitted. True when a window closed and the
        model moved.

        Past the batch (``ahead + 1 > slots``) a request admitted behind a deep queue waited for
        the ``ahead`` before it. The time average ``L / S`` undercounts them when the queue
        drains before it finishes: the requests that remain in its last seconds are few, their
        ``1 / n`` shares inflate ``S``, and the point reads a long latency at a low
        concurrency. On a model of a batching engine (a FIFO of 16 slots, 17 req/s offered at
        8.4 req/s of capacity, 96 held, then drained; `tests/unit/test_admission.py`) the line
        ended at 6.0 req/s from the drain alone, at 8.4 with ``m`` at least ``ahead + 1``
        there. Pass ``ahead`` only for a queue nothing bounded (admission off): behind the door
        a request is admitted when ``n < cap``, so ``ahead + 1`` is the most it can share the
        server with, and the bound would read every point at the cap (with it, at 3 x C0 with
        one class the line read 10.9 req/s where the engine served 10.45). Within the batch
        ``m`` is ``L / S`` alone."""
        if not (latency_s > 0 and service_s > 0):
            return False
        m = self.concurrency(latency_s, service_s, ahead)
        x, y = m - 1.0, latency_s
        if self.slots is not None and m > self.slots:  # it queued: the full batch it implies
            x, y = self.slots - 1.0, latency_s * self.slots / m
        self._remember(now, x + 1.0, y)
        self._observe_alone(now, m, latency_s)
        if self._near_fitted(x):
            self._near[0] += y
            self._near[1] += 1.0
            self._near[2] += x
        w = self._window
        w[0] += 1.0
        w[1] += x
        w[2] += y
        w[3] += x * x
        w[4] += x * y
        if self._opened_at is None or now < self._opened_at:  # the first one, or the clock went back
            self._opened_at = now
        # a built-in guess gives way to the first completion that measures it; then windows
        if now - self._opened_at < self.window_s and self._measured:
            return False
        (near_y, near_n, near_x), self._near = self._near, [0.0, 0.0, 0.0]
        # the line's prediction for them: it moves only when a window closes, below
        predicted = near_n * self.base_s + self.per_request_s * near_x
        r = self.shift(near_y, predicted, near_n) if self._measured else 1.0
        if r != 1.0:  # the machine changed speed: what was measured before is rescaled to it
            self._rescale(r, now, since=self._opened_at)
            # the window may also hold completions from before the change, which the near ones
            # do not tell apart: it counts as its near completions, at their mean (no spread)
            w[:] = [near_n, near_x, near_y, near_x * near_x / near_n, near_x * near_y / near_n]
        keep = 1.0 - self.alpha
        self._sums = [keep * s + v for s, v in zip(self._sums, w)]
        self._opened_at, self._window, self._measured = None, [0.0] * 5, True
        self._fit()
        return True

    def _rescale(self, r: float, now: float, since: float) -> None:
        """The machine runs ``r`` times slower (below 1: faster) than what was measured before
        ``since`` (the window that read it): the line, its points and the remembered buckets
        are rescaled to it, and the latencies alone measured before are forgotten (they may be
        of either speed)."""
        self.shifts += 1
        self._sums[2] *= r
        self._sums[4] *= r
        self.base_s *= r
        self.per_request_s *= r
        for b in self._buckets.values():
            if b[2] < since:  # measured since is at the new speed already
                b[1] *= r
        self._alone = [a for a in self._alone if a[1] >= since]
        self._refloor(now)
        self._realone(now)

    def _near_fitted(self, x: float) -> bool:
        """Whether a completion at ``x`` (requests in flight less 1) is near the points the line
        was fitted on (`shift`): within `SHIFT_SPAN` of their mean, and where the slope moves the
        prediction from their mean latency by at most `SHIFT_SLOPE_SHARE` of it (a steep line,
        pivoted or fitted across two speeds of the machine, is not trusted even there)."""
        n, sx, sy = self._sums[0], self._sums[1], self._sums[2]
        if n <= 0:
            return False
        dx = abs(x - sx / n)
        return dx <= self.SHIFT_SPAN and self.per_request_s * dx <= self.SHIFT_SLOPE_SHARE * sy / n

    @classmethod
    def shift(cls, measured_s: float, predicted_s: float, count: float) -> float:
        """How many times slower (below 1: faster) the machine runs now than the line says, from
        the ``count`` completions of a window near the points the line was fitted on
        (`_near_fitted`), whose latencies sum to ``measured_s`` where the
        line predicted ``predicted_s``: their ratio, where it is off by more than `SHIFT_RATIO`
        either way for `SHIFT_COUNT` completions (a mean of fewer is noisier: the bound on the
        ratio's log grows as ``sqrt(SHIFT_COUNT / count)``, one completion must be 2.25 times
        off, nine 1.31 times), else 1 (noise). 1 without such completions: away from the fitted
        points the curve itself may leave the line (a knee it extrapolates past, a lull below
        it, a slope never measured)."""
        if not (count > 0 and measured_s > 0 and predicted_s > 0):
            return 1.0
        r = measured_s / predicted_s
        bound = math.log(cls.SHIFT_RATIO) * math.sqrt(cls.SHIFT_COUNT / count)
        if abs(math.log(r)) <= bound:
            return 1.0
        return min(cls.SHIFT_MAX, max(1.0 / cls.SHIFT_MAX, r))

    def concurrency(self, latency_s: float, service_s: float, ahead: int = 0) -> float:
        """The requests a served completion shared the server with, itself included: ``L / S``
        (at least 1), and past the batch at least ``ahead + 1`` (`observe`). Both positive."""
        m = max(1.0, latency_s / service_s)
        if self.slots is not None and ahead + 1 > self.slots:
            m = max(m, ahead + 1.0)
        return m

    def _remember(self, now: float, m: float, latency_s: float) -> None:
        """Fold one completion into the bucket of its concurrency (``round(m)``), and recompute
        `floor` as of ``now``."""
        k = max(1, round(m))
        self.learned = True
        b = self._buckets.get(k)
        if b is None:
            self._buckets[k] = [1.0, latency_s, now]
        else:
            keep = math.exp(-max(0.0, now - b[2]) / self.FLOOR_TAU_S)
            b[0], b[1], b[2] = b[0] * keep + 1.0, b[1] * keep + latency_s, max(b[2], now)
        self._refloor(now)

    def _observe_alone(self, now: float, m: float, latency_s: float) -> None:
        if round(m) <= 1:
            self._alone.append([latency_s, now])
            del self._alone[:-self.ALONE_COUNT]
        self._realone(now)

    def _realone(self, now: float) -> None:
        fresh = [a[0] for a in self._alone if now - a[1] <= self.FLOOR_FRESH_S]
        self._alone_s = statistics.median(fresh) if fresh else None

    def _refloor(self, now: float) -> None:
        reach = max((j for j, c in self._buckets.items() if now - c[2] <= self.FLOOR_FRESH_S), default=0)
        self._floor = {
            j: c[1] / c[0] for j, c in sorted(self._buckets.items())
            if j > reach and c[0] * math.exp(-max(0.0, now - c[2]) / self.FLOOR_TAU_S) >= self.FLOOR_MIN_WEIGHT
        }

    def _fit(self) -> None:
        n, sx, sy, sxx, sxy = self._sums
        if n <= 0:
            return
        mx, my = sx / n, sy / n
        cxx = max(0.0, sxx - n * mx * mx)
        cxy = sxy - n * mx * my
        slope = max(self.MIN_SLOPE, (cxy + self.RIDGE * self.per_request_s) / (cxx + self.RIDGE))
        base = my - slope * mx
        alone = self._alone_s
        if alone is not None and mx > 0 and base < max(self.PIVOT_S, alone / self.PIVOT_RATIO):
            # far below a request alone measured just now: pivot on the mean, through that latency
            base, slope = alone, max(self.MIN_SLOPE, (my - alone) / mx)
        elif base < self.PIVOT_S:  # the slope would put the line through zero before n = 1: pivot on the mean
            base = self.PIVOT_S
            slope = max(self.MIN_SLOPE, (my - base) / mx) if mx > 0 else slope
        self.base_s, self.per_request_s = base, slope


# Unless the policy sets admission.wait_smoothing_s, the predicted wait averages the requests in
# flight over this many times the latency of one request alone (`AdmissionController.signals`).
WAIT_SMOOTHING_ALONE = 2.0

# At a change up, the new level's model is taken for one from a slower phase of the machine (and
# replaced by the model in force) where it predicts more than this many times the latency of the
# model in force at the concurrency just measured, or in flight where nothing was measured just
# now (`AdmissionController.set_level`): a margin
# over the noise of a mean of recent completions, far under the twice measured when it mattered.
STALE_RATIO = 1.2

# A class is shut out only while the classes above it arrive faster than the server completes
# requests by more than this many standard deviations of their measured rate (`rate_lower_bound`).
# The estimate rests on a few arrivals (0.5/s over a 10 s time constant: about five), so the
# plain estimate crosses a service rate 10-30% above the true demand a third of the time, and
# each crossing shut a class out (measured at 1.5x C0: 69% within the SLO, 88.6% without the
# rule); one standard deviation keeps the rule to demand that is over the server for sure.
SHUT_OUT_SIGMAS = 1.0

# The reserved limits (`reserved_limits`) are recomputed at most this often (seconds of ``now``):
# the arrival rates they rest on move with a 10 s time constant, and one computation costs
# O(cap * log cap) (about a millisecond at a cap of a few hundred).
RESERVE_REFRESH_S = 0.25


# A class whose arrivals' decayed weight (`ArrivalRate.weight`: rate x time constant, the
# requests the estimate still counts) is below this is not arriving, for the room kept for it
# (`AdmissionController._reserved`). The estimate decays exponentially and never reaches 0, and
# where a class's cap equals the cap of the class above it (small caps: a few requests fill the
# batch), any rate above 0 has the class above lose a share of its requests to the class below,
# however few requests that share is of: so the room kept outlived the demand it was kept for.
# Measured (12-04, 2-core AVX2 EPYC, 5 s SLO): in the standard-only run at 1.5 x C0, critical's
# estimate from the mixed run before (its last critical request over a minute earlier) kept one
# of standard's five slots for 32 s, and 7 of the run's 16 refusals came from it. One twentieth
# of a request is about three time constants after a lone arrival (30 s at the shipped 10 s),
# longer after more (ln(weight / 0.05) time constants).
ABSENT_WEIGHT = 0.05
# A class has also stopped arriving when no request of it came for this many of its mean gaps at
# the rate measured at its last arrival (the lesser of the long and fast estimates, so a rate
# that was falling is not held against it): Poisson arrivals at that rate leave such a gap with
# probability exp(-10), about 5e-5 (`ArrivalRate.present`). The weight alone outlives a class
# that stopped after arriving fast: measured (12-06, 2-core AVX-512 Xeon, 2 s SLO), after the
# 1.5 x C0 mix (2.9 critical requests/s, a weight of 29) critical's weight stayed over
# `ABSENT_WEIGHT` for 27 s of the standard-only run that followed its 35 s reset, `ramp_limit`
# held standard work to the concurrency measured lately plus 3 meanwhile, and 57 of the run's
# 59 refusals (6.5% of its requests) fell there, 2 in the 33 s after; at 2.9/s this rule ends it
# 3.4 s after the last critical request.
ABSENT_GAPS = 10.0


# An arrival rate is also estimated on a time constant this much shorter (`ArrivalRate.fast_rate`):
# the room kept for the classes above and their shut-out follow a step up in their demand within
# seconds, and fall back with the long estimate. Measured at 3 x C0 on an AMX Xeon (2 s SLO,
# 20 requests/s from a quiet start): with the 10 s estimate alone the door filled with standard
# and sheddable work in the first second, before any room was reserved, and 23% of the critical
# requests of the first 5 s were refused.
FAST_FRACTION = 0.2


# Critical work is held to the objective's own quantile (the SLO is a p99, and critical requests
# are to be at least 99% within it), but the latency model predicts a mean. On 2 cores the
# latency of requests run at the same concurrency spreads wide: measured (12-04, 2-core AVX-512
# EPYC, 2 s SLO, 3 x C0 with the 20/50/30 mix, clients' records): the 99th percentile of a
# request's latency over the median at its concurrency 1.55-1.63, the 90th 1.26-1.30; critical
# requests ran where standard's cap (0.9 of the budget, at the mean) held the door, 8-11 in
# flight, and 13 of 312 finished 2.01-2.35 s after they were sent. So while critical work
# arrives, the classes below it are held to the concurrency at which that quantile of the
# latency is within critical's budget (`LatencyTail`, `AdmissionController.tail_limit`). Where the
# model reads a changed machine (`ServiceModel.shift`) the spread is measured again from nothing:
# it was measured around a line the machine left (in the door's model, after a phase ten times
# slower it read 2.0-2.2 for a few minutes, and held critical's cap at one or two in flight).
TAIL_Z = 2.326  # the standard normal's 0.99 quantile: the objective is a p99
TAIL_WINDOW = 200  # completions the spread is measured over
TAIL_MIN = 30  # fewer than this measure no spread (no margin)


class LatencyTail:
    """How far served requests' latencies spread above the latency model's prediction at the
    concurrency each ran at (``latency_s(m)``, ``m`` its mean requests in flight): over the last
    `TAIL_WINDOW` completions, the logs of latency over prediction, taken as normal (a
    lognormal latency), and ``factor`` = ``exp(median + z * sd)``, at least 1: the prediction
    times ``factor`` is the ``z`` quantile of the latency. The spread is robust (``sd`` from the
    median absolute deviation, `MAD_TO_SD`): the few large ratios of a moment when the model
    lags a change of load (a calm, then an overload) are its error, not the engine's spread,
    and a plain deviation kept them for the whole window. 1.0 (no margin) with fewer than
    `TAIL_MIN` completions."""

    __slots__ = ("_logs",)

    def __init__(self, window: int = TAIL_WINDOW) -> None:
        self._logs: collections.deque[float] = collections.deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._logs)

    def add(self, ratio: float) -> None:
        """One completion's latency over the model's prediction for it."""
        if ratio > 0 and math.isfinite(ratio):
            self._logs.append(math.log(ratio))

    def factor(self, z: float = TAIL_Z) -> float:
        if len(self._logs) < TAIL_MIN:
            return 1.0
        mid = statistics.median(self._logs)
        mad = statistics.median(abs(x - mid) for x in self._logs)
        return max(1.0, math.exp(mid + z * MAD_TO_SD * mad))


MAD_TO_SD = 1.4826  # a normal's standard deviation over its median absolute deviation


# While critical work arrives, the classes below it are admitted to at most admission.ramp_step
# requests above the highest concurrency a served request was measured at within RAMP_WINDOW_S,
# and at least to RAMP_MIN (`AdmissionController.ramp_limit`): additive increase into concurrency
# the latency model has not measured lately. 10 s: a few latencies, so the limit follows a run of
# load that lasts, and a lull of that long starts the ramp again; 4: a door at one or two in
# flight admits a clump of a few without refusing it (in the door's model at 2.5 req/s, with an
# earlier variant of the rule, a floor of 2 cost 2.0 points of the requests within the SLO, 4
# cost 1.2).
RAMP_MIN = 4
RAMP_WINDOW_S = 10.0
# Unless the policy sets admission.ramp_step, the step is this share of the batch (the slots of
# this replica), at least 1: 3 for the 16 sequences of the embedded model's engine, where it was
# measured (`AdmissionController.ramp_limit`); scaled with the batch, a GPU engine of 256
# sequences climbs from calm to its batch in about as many completions (not measured on one).
RAMP_STEP_SHARE = 0.2

# `AdmissionController.set_speed`: a slowdown that moves less than this (a fraction) from the one
# in force changes nothing (the caps are not recomputed for the noise of a 1 s median of steps);
# and at most this many times slower (or faster) is believed.
SPEED_STEP = 0.1
SPEED_MAX = 100.0
# and a reading within this factor of 1 either way is applied as 1, one past it less this factor:
# the step times of an engine on a shared machine wander by a fifth with its other work, and the
# exact caps of a steady load should not move with them
SPEED_MARGIN = 1.25


class ArrivalRate:
    """Requests offered per second, exponentially decayed with time constant ``tau_s``:
    ``rate(now) = sum(exp(-(now - t_i) / tau_s)) / tau_s`` over arrivals ``t_i``; and the same
    on ``fast_tau_s = FAST_FRACTION * tau_s`` (`fast_rate`), which sees a step up sooner and is
    noisier. ``peak`` is the larger of the two: quick to rise, slow to fall. O(1) per arrival."""

    __slots__ = ("tau_s", "_count", "_fast", "_at", "_last_at", "_last_rate")

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self._count = 0.0
        self._fast = 0.0
        self._at: float | None = None
        self._last_at: float | None = None  # the latest arrival
        self._last_rate = 0.0  # the lesser estimate just after it (`present`)

    @property
    def fast_tau_s(self) -> float:
        return FAST_FRACTION * self.tau_s

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._count *= math.exp(-(now - self._at) / self.tau_s)
            self._fast *= math.exp(-(now - self._at) / self.fast_tau_s)
        if self._at is None or now > self._at:
            self._at = now

    def add(self, now: float) -> None:
        self._decay(now)
        self._count += 1.0
        self._fast += 1.0
        if self._last_at is None or now >= self._last_at:
            self._last_at = now
            self._last_rate = min(self._count / self.tau_s, self._fast / self.fast_tau_s)

    def rate(self, now: float) -> float:
        self._decay(now)
        return self._count / self.tau_s

    def fast_rate(self, now: float) -> float:
        self._decay(now)
        return self._fast / self.fast_tau_s

    def peak(self, now: float) -> float:
        return max(self.rate(now), self.fast_rate(now))

    def retune(self, tau_s: float) -> None:
        """Take a new time constant (a reloaded ``reserve_window_s``) keeping both estimates: the
        decayed counts are rescaled by ``new / old``, so ``rate`` and ``fast_rate`` read the same
        just after as just before. Kept as they were, a count gathered over 60 s read over 10 s
        was a six-fold arrival rate out of nothing, which shut classes out (saturated) at once.
        The time since the last reading then decays at the new constant."""
        if tau_s != self.tau_s:
            scale = tau_s / self.tau_s
            self._count *= scale
            self._fast *= scale
            self.tau_s = tau_s

    def weight(self, now: float) -> float:
        """The arrivals the long estimate still counts (``rate * tau_s``): each 1 when it came,
        fading with ``tau_s``."""
        self._decay(now)
        return self._count

    def present(self, now: float) -> bool:
        """Whether this class still arrives: its `weight` is at least `ABSENT_WEIGHT`, and no
        more than `ABSENT_GAPS` mean gaps (at the lesser of the two estimates just after its
        latest arrival) have passed since that arrival. The first bounds how long a few
        arrivals are remembered (about 30 s after a lone one at the shipped 10 s); the second
        ends a class that arrived fast and stopped (after 2.9/s, 3.4 s later) where its weight
        would keep it for a minute or more."""
        if self.weight(now) < ABSENT_WEIGHT or self._last_at is None:
            return False
        return (now - self._last_at) * self._last_rate < ABSENT_GAPS


def rate_lower_bound(rate: float, tau_s: float, sigmas: float) -> float:
    """``rate`` (an `ArrivalRate` estimate, or a sum of independent ones with the same ``tau_s``)
    less ``sigmas`` standard deviations: for Poisson arrivals at ``lam`` the decayed estimate
    has mean ``lam`` and variance ``lam / (2 tau_s)``, with the estimate standing in for
    ``lam``. At 0.5 request/s and tau 10 s one standard deviation is 0.16/s: a third of it."""
    return max(0.0, rate - sigmas * math.sqrt(max(rate, 0.0) / (2.0 * tau_s)))


class RefusalWindow:
    """The share of door decisions that refused, over the last ``window_s`` seconds.

    Counted in ``BINS`` bins of ``window_s / BINS`` each, so memory stays constant whatever the
    request rate; a bin leaves the window whole, so the window spans ``window_s`` to one bin more.
    ``ratio`` is 0 when nothing was decided in the window (no load: nothing to hold a level up).

    The ratio's denominator is at least ``MIN_DECISIONS``: at a few requests a minute one
    refusal of two decisions would read 50% and take the level to 3 in one step (measured: a
    sheddable request refused at 0.5 x C0, where one request alone takes 40% of the SLO), while
    it is one request's worth of evidence; so one refusal in a quiet window reads at most 5%.
    At the rates where the ratio matters (more than ``MIN_DECISIONS`` per window) it is the plain
    share refused.
    """

    BINS = 20
    MIN_DECISIONS = 20
    __slots__ = ("window_s", "_bins")

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self._bins: collections.deque[list[int]] = collections.deque()  # [bin index, decided, refused]

    def _index(self, now: float) -> int:
        return math.floor(now * self.BINS / self.window_s)

    def _trim(self, now: float) -> None:
        oldest = self._index(now) - self.BINS  # the newest (partial) bin and BINS whole ones
        while self._bins and self._bins[0][0] < oldest:
            self._bins.popleft()

    def add(self, now: float, refused: bool) -> None:
        i = self._index(now)
        if not self._bins or self._bins[-1][0] < i:
            self._bins.append([i, 0, 0])
        last = self._bins[-1]  # a late (out-of-order) timestamp counts in the newest bin
        last[1] += 1
        last[2] += int(refused)
        self._trim(now)

    def counts(self, now: float) -> tuple[int, int]:
        """``(decided, refused)`` within the window at ``now``."""
        self._trim(now)
        return sum(b[1] for b in self._bins), sum(b[2] for b in self._bins)

    def ratio(self, now: float) -> float:
        decided, refused = self.counts(now)
        return refused / max(decided, self.MIN_DECISIONS) if decided else 0.0


def loss_chain(rates: Sequence[float], limits: Sequence[int], latency_s: Callable[[int], float]) -> list[float]:
    """The stationary distribution of the number of requests in flight, ``p[0..max(limits)]``,
    in a birth-death model of the door: class ``k`` arrives as Poisson at ``rates[k]`` and is
    admitted iff ``n < limits[k]``; with ``n`` in flight each takes ``latency_s(n)``, so requests
    complete at ``n / latency_s(n)`` (they share the server). With one class and a constant
    latency this is Erlang's loss system (``p[n]`` proportional to ``a**n / n!``, ``a = rate *
    latency``). By PASTA, class ``k`` is refused with probability ``sum(p[limits[k]:])``."""
    top = max(limits, default=0)
    p = [1.0]
    for n in range(top):
        lam = sum(r for r, lim in zip(rates, limits, strict=True) if n < lim)
        p.append(p[-1] * lam * latency_s(n + 1) / (n + 1))
        if p[-1] > 1e200:  # scale down as it goes: only the ratios matter
            p = [x * 1e-200 for x in p]
    total = sum(p)
    return [x / total for x in p]


def refused_share(p: Sequence[float], limit: int) -> float:
    """The probability that a class admitted iff ``n < limit`` is refused, from `loss_chain`'s ``p``."""
    return sum(p[limit:])


def overtaken_within_s(full_s: float, limit_s: float, above_per_s: float, rate_per_s: float,
                       sigmas: float = 0.0) -> float:
    """The latency the model may predict for a request of a lower class (``latency_s(ahead + 1)``)
    for it to finish within ``limit_s`` once the work of the classes above that arrives while it
    waits, at ``above_per_s``, starts before it.

    Past the batch the model predicts ``full_s + p / rate``: ``full_s = latency_s(slots)`` to run,
    after waiting for the ``p`` requests ahead of it in line to be started as slots free at
    ``rate``, the full batch's rate. If the classes above arrive meanwhile, each takes a slot
    first: waiting ``w`` it starts once ``rate * w = p + A(w)`` slots have freed, ``A(w)`` the
    arrivals above within ``w``, Poisson with mean ``above * w``. With ``A(w)`` at its mean plus
    ``sigmas`` standard deviations, ``sqrt(above * w)``, the wait is within ``r = limit_s -
    full_s`` iff ``p <= (rate - above) * r - sigmas * sqrt(above * r)``; the latency the model
    predicts for that ``p`` is returned. At ``sigmas`` 0 that is ``full_s + r * (1 - above /
    rate)``: the wait stretched by ``rate / (rate - above)``. Where nothing can wait (the classes
    above at or past the server's rate, or their noise alone fills ``r``), ``full_s``: only a slot
    free now. ``limit_s`` unchanged where it is at most ``full_s`` (the class is admitted only
    within the batch, where it starts at once) or nothing arrives above."""
    if limit_s <= full_s or above_per_s <= 0.0:
        return limit_s
    r = limit_s - full_s
    line = (rate_per_s - above_per_s) * r - sigmas * math.sqrt(above_per_s * r)
    return full_s + max(0.0, line) / rate_per_s


def reserved_limits(rates: Sequence[float], caps: Sequence[int], latency_s: Callable[[int], float],
                    tolerance: float) -> tuple[int, ...]:
    """Per class (most important first), the most requests in flight at which it is admitted.

    The first class gets its cap. Each class below gets the highest limit (at most its own cap
    and the limit of the class above it, at least 1) at which it raises the share of refused
    requests of every class above it by no more than ``tolerance``, over the same model
    without it (`loss_chain`: its arrival rate admitted up to that limit, theirs up to theirs).
    A class that does not arrive costs nothing and gets its cap; the higher its own demand and
    the closer the classes above already are to filling the server, the lower its limit. A
    limit of 1 (admitted only to an idle server) may still cost more than ``tolerance``: the
    shut-out rule (`AdmissionController.class_cap`) is what refuses a class even then. Past the
    point where the classes above alone arrive faster than the server completes requests, they
    are refused often whatever the class below does, their share barely moves with its limit,
    and the limit rises again: that regime is the shut-out rule's too.

    The cost is monotone in the limit (admitting more of a class only adds congestion), so each
    limit is a bisection: ``O(cap * log cap)`` per class.
    """
    limits = [int(caps[0])]
    for k in range(1, len(rates)):
        above = list(rates[:k])
        alone = loss_chain(above, limits, latency_s)
        before = [refused_share(alone, lim) for lim in limits]

        def fits(limit: int, k: int = k, above: list[float] = above, before: list[float] = before) -> bool:
            p = loss_chain([*above, rates[k]], [*limits, limit], latency_s)
            return all(refused_share(p, lim) - b <= tolerance  # a class that does not arrive is never refused
                       for lim, b, r in zip(limits, before, above, strict=True) if r > 0.0)

        lo, hi = 1, max(1, min(int(caps[k]), limits[-1]))
        if rates[k] <= 0.0 or not any(r > 0.0 for r in above) or fits(hi):
            lo = hi
        else:
            while hi - lo > 1:  # fits(lo) is assumed (the floor); fits(hi) is false
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
        limits.append(lo)
    return tuple(limits)


class AdmissionController:
    """Admission for one ingress replica. See the module docstring for the rule.

    ``slots``: the engine's batch size (``max_num_seqs``), or this replica's share of it.
    """

    def __init__(self, slo: SloConfig, settings: AdmissionConfig, slots: int) -> None:
        self._configure(slo, settings, slots)
        self.batch = self.slots  # one model replica's batch (max_num_seqs)
        self.model_replicas = 1
        self.level = 0
        self._models: dict[int, ServiceModel] = {0: self._prior(slo, settings)}
        self._caps: tuple[int, ...] = ()
        # (until, the models of the levels whose requests still run): `set_level`
        self._hold: tuple[float, tuple[ServiceModel, ...]] | None = None
        self._arrivals = tuple(ArrivalRate(settings.reserve_window_s) for _ in Criticality)
        # requests admitted per second, per class (`overtaken_caps`: what overtakes a class below)
        self._admitted = tuple(ArrivalRate(settings.reserve_window_s) for _ in Criticality)
        self._refusals = RefusalWindow(settings.refusal_window_s)
        self._in_flight_avg: tuple[float, float | None] = (0.0, None)  # (average, when)
        self.models_replaced = 0  # level models found stale at a change up (`set_level`)
        self.speed_shifts = 0  # windows the level's model read as the machine changing speed (`ServiceModel.shift`)
        self._tail = LatencyTail()  # latency over the model's prediction (`_reserved`)
        self._reach: dict[int, float] = {}  # concurrency (round(m)) -> latest completion there (`ramp_limit`)
        self._speed = SpeedClock()  # the engine's slowdown over time, as the door applies it (`set_speed`)
        self.measured_slowdown = 1.0  # the latest reading given to `set_speed`
        self._recompute()

    def _prior(self, slo: SloConfig, settings: AdmissionConfig) -> ServiceModel:
        if settings.prior_rate_per_s is not None:
            return ServiceModel.from_rate(settings.prior_rate_per_s, settings.rate_window_s, settings.rate_alpha,
                                          slots=self.slots)
        base_s, per_request_s = default_prior(slo, self.slots)
        return ServiceModel(base_s, per_request_s, settings.rate_window_s, settings.rate_alpha, slots=self.slots)

    @property
    def model(self) -> ServiceModel:
        """The service model of the level in force (`set_level`), as measured: at the engine's
        usual speed (`set_speed`)."""
        return self._models[self.level]

    @property
    def predictor(self) -> ServiceModel | SlowedModel:
        """What the door predicts with: `model` at the engine's slowdown in force (`set_speed`)."""
        f = self._speed.value
        return self.model if f == 1.0 else SlowedModel(self.model, f)

    @property
    def slowdown(self) -> float:
        """The engine's slowdown the door applies now (`set_speed`: the reading less its
        margin); 1 until one is set."""
        return self._speed.value

    def set_speed(self, slowdown: float, now: float) -> bool:
        """The engine steps ``slowdown`` times slower now than it did lately
        (`policies.engine_speed.EngineSpeed`, read from the model replicas). True if the door's
        predictions changed.

        From ``now`` on every prediction is the measured model's times ``slowdown`` (the caps,
        the room kept, `Retry-After`, ``predicted_wait_ms``), and each completion is divided by
        its mean slowdown over its life before the model learns it (`observe_completion`), so
        the model keeps measuring the engine at its usual speed and the slowdown says how far
        from it the engine is now. Without this, a starved engine (a noisy neighbour on its
        CPUs) finishes nothing for as long as its slowed requests run, the door admits up to
        caps it no longer meets, and the completions that finally arrive teach the model a
        slowness that is already over. In the door's model (`bench/door_sim.py --speed-lag`, the
        knee-shaped engine, 2.3 req/s with the mix, 48 seeds, the same for each setting;
        bench/results/door_sim_speed.json), ten times slower for 30 s and the slowdown known 1 s
        late: the requests sent after the slow phase 70.9 -> 95.0% within the SLO, those sent
        during it late 15.2 -> 8.2% (refused at once instead), goodput 1.31 -> 1.62 req/s;
        three times slower 92.1 -> 96.2% after, twice 93.3 -> 96.7%; known 2 s late 94.3 / 93.7
        / 94.4%. A prototype that scaled the predictions but let the model learn the slow
        completions as they came (16 seeds, no margin): 82.6% after ten times slower, and, known
        3 s late, worse than not knowing (66.5% against 71.8%): the slowness it learned outlived
        the starvation again.

        What the door applies is the reading less a margin of `SPEED_MARGIN` either way (``f /
        1.25`` above 1.25, ``f * 1.25`` below 1 / 1.25, 1 between), continuous in the reading: a
        step time that wanders by a fifth with the CPU's other work changes no cap (the model
        learns such drift from completions as before), while a starved engine is seen almost
        whole (ten times slower: eight). A change of less than `SPEED_STEP` from the value in
        force is ignored (the caps are not recomputed for noise), except back to 1: a reading
        within the margin ends any slowdown in force, however small (measured 12-05, seed 212:
        1.26 applied as 1.01, then ignored back to 1 for the last 160 s of a 3 x run, and a 1.006
        kept across three runs on seed 208; a reading of 1.5 then 1.3 would have left 1.04). The
        value is clamped to ``[1 / SPEED_MAX, SPEED_MAX]``, and a reading that is not a positive
        number is ignored."""
        if math.isnan(slowdown) or not slowdown > 0:  # not a reading: nothing changes
            return False
        self.measured_slowdown = float(slowdown)
        log_f = math.log(min(SPEED_MAX, max(1.0 / SPEED_MAX, float(slowdown))))
        margin = math.log(SPEED_MARGIN)
        f = math.exp(math.copysign(max(0.0, abs(log_f) - margin), log_f))
        step = abs(math.log(f / self._speed.value))
        if step == 0.0 or (f != 1.0 and step < math.log1p(SPEED_STEP)):
            return False
        self._speed.set(now, f)
        self._recompute()
        return True

    def update(self, slo: SloConfig, settings: AdmissionConfig, slots: int | None = None) -> None:
        """Apply a reloaded policy, keeping what was measured (a prior only seeds a new model),
        unless the policy sets a new ``prior_rate_per_s``: an operator's explicit rate restarts
        the estimate from it."""
        new_prior = settings.prior_rate_per_s
        restart = new_prior is not None and new_prior != self.settings.prior_rate_per_s
        self._configure(slo, settings, self.slots if slots is None else slots)
        if restart:
            self._models = {self.level: self._prior(slo, settings)}
        for model in self._models.values():
            model.window_s = settings.rate_window_s
            model.alpha = settings.rate_alpha
            model.slots = self.slots
        for arrivals in (*self._arrivals, *self._admitted):
            arrivals.retune(settings.reserve_window_s)
        if settings.refusal_window_s != self._refusals.window_s:
            self._refusals = RefusalWindow(settings.refusal_window_s)
        self._recompute()

    def set_replicas(self, model: int, ingress: int) -> bool:
        """``model`` replicas serve behind ``ingress`` replicas (each with its own controller): this
        replica's share of the batches becomes ``slots = max(1, round(batch * model / ingress))``
        and ``model_queued`` is counted per model replica. A count below 1 (not known yet, or
        every replica's report stale) leaves the share as it is. True if the share changed."""
        if model < 1 or ingress < 1:
            return False
        slots = max(1, round(self.batch * model / ingress))
        if (slots, model) == (self.slots, self.model_replicas):
            return False
        self.slots, self.model_replicas = slots, int(model)
        for m in self._models.values():  # the knee of each level's latency model moves with the share
            m.slots = slots
        self._recompute()
        return True

    def set_level(self, level: int, now: float | None = None, in_flight: int = 0,
                  left_in_flight: bool | None = None) -> bool:
        """The degradation level now in force; True if it changed.

        Capacity depends on the level (optional work takes the same CPU as the model, and
        shaping shortens answers), so each level keeps its own service model: on a change the
        level's own measurements come back at once, instead of the previous level's being
        unlearned over several windows while admission over-admits (after a step down) or
        over-refuses (after a step up). A level never measured starts from the model in force
        (conservative after a step up, since the higher level does less per request).

        But the ``in_flight`` requests admitted before the change still carry the work of the
        level they were admitted at, so while they run the engine is not yet the new level's:
        given ``now``, the caps in force stay at most the caps of the level before the change
        (and of any level still held from an earlier change): the hold. They are that level's
        model read at the engine's speed in force, not the numbers that stood at the change: a
        speed reading in force then (which can itself raise the level, through
        ``predicted_wait_ms``) would otherwise outlive itself in them. Measured before this (12-05,
        2-core AVX2 EPYC, 5 s SLO, the benchmark's oscillating load): a 6.3 x reading raised level
        3, and the hold kept every cap at 1 for a second after the reading was back at 1, with
        the requests in flight finishing within the SLO. A level that admitted nothing while it
        was in force (``left_in_flight`` False: the gate tells; None: as if it did wherever
        anything is in flight) carries no request, so it is not held: measured (12-07, 2-core
        AVX2 EPYC, 5 s SLO, 3 x C0 with 20% critical work), level 2 came 1.6 s into the run and
        level 3 0.6 s later; level 2 admitted nothing (its caps were 1 with 4 in flight), yet its
        caps held every class at 1 for 2.2 s more, and two critical requests were refused. The hold lasts
        until `end_hold` (the gate calls it when the last of them has left) or one
        ``e2e_p99_ms`` after the change, whichever comes first (none of them can still be on
        time then). Measured (12-03, 2-core AVX2 EPYC, 5 s SLO, the step profile 0.5 x -> 3 x
        C0): level 3 came 1.6 s after the step, and its model, measured minutes before,
        raised critical's and standard's caps from 9 and 8 at once to 16 and 13; 13-14 ran in
        flight, and the six requests sent in the first 2 s of the step (one critical, most
        admitted at level 1) finished 5.2-6.6 s after they were sent, at 9.6-11.6 in flight
        over their lives. With the hold, in the same step: the caps held at 8 and 7 for 3.3 s
        after level 3 came, at most 6 in flight, no request late. With nothing in flight at
        the change, or without ``now``, the new level's caps apply at once. A hold only lowers
        caps, so a change to a slower level is not delayed.

        Critical work is held only while no class below it arrives (`critical_cap`). Where one
        does, the classes below are held and critical's cap is the new level's: held too, it
        would invert the classes' order, keeping critical requests out while the work of the
        classes below admitted before the change (at the onset of load, before any critical
        arrival was measured to keep room by) fills the door to critical's held cap. Measured
        (12-07, 2-core AVX2 EPYC, 5 s SLO, 3 x C0 with 20% critical work): level 2 came 2.8 s
        into the run with 6 in flight, all admitted at level 0; the door stood at critical's
        held cap of 7 from 3.3 s to 5.4 s, where the new level's was 10, two critical requests
        waited at it and one was refused after its whole wait. What critical work adds beyond
        the held cap is its own arrivals during the hold, which lasts one SLO at most. Where
        critical work alone arrives, the hold bounds its own requests in flight, as for any class.

        Levels are ordered by cost: a higher level does a subset of the optional work of the one
        below and shapes answers at least as short, so on the same machine it is at least as
        fast at any concurrency. So on a change up, a model of the new level that predicts more
        than `STALE_RATIO` times the latency of the model in force where that one was just
        measured (its `fresh_reach`: the highest concurrency with a completion within
        `ServiceModel.FLOOR_FRESH_S`) was measured in a slower phase of the machine: it
        contradicts what was just measured, and is replaced by a copy of the model in force (its
        line: `copy`; counted in ``models_replaced``). Where the model in force was measured (or
        is the copy of one: `ServiceModel.learned`, as at a change up through a level never
        measured) but has no fresh completion (a change at the onset of load after a calm), they are compared at the
        concurrency in flight (at least 1), where the door admits next: neither was measured
        just now, and the order of the levels still says which is wrong; the copy is what a
        level never measured starts from. Where the new level's model is slower only higher up
        (measured there, while the level in force has only been extrapolated to it), nothing
        contradicts it and it stays; nor does a model in force never measured (a prior). Measured (12-03, 2-core AVX2 EPYC,
        5 s SLO, 3 x C0): level 3 came 4.4 s into the run, and its model, from the run before a
        minute earlier when 4 in flight took 5.2 s (here 2.6 s), cut critical's cap from level
        2's 9 to 3; two critical requests were refused before fresh points replaced it. And
        (12-07, the same machine, 3 x C0 with 20% critical work, 1.6 s into the run, before any
        completion): level 2's model from minutes before (5.2 s + 0.14 s per request) predicted
        1.7 times level 0's at the 4 in flight and set every cap to 1. A
        change down keeps the new level's own model: it is at most as fast as the level it
        leaves, whatever that one measured, and the hold bounds its caps meanwhile.
        """
        level = int(level)
        if level == self.level:
            return False
        if now is not None:
            self._expire_hold(now)
        left = self.model  # with the levels still held from an earlier change, it bounds the new one's caps
        stale = False
        if level > self.level and level in self._models:
            at = self.model.fresh_reach(now)
            if not at and self.model.learned:  # measured (or copied from a measured one), not just now
                at = max(1, in_flight)
            stale = at > 0 and self._models[level].latency_s(at) > STALE_RATIO * self.model.latency_s(at)
        if level not in self._models or stale:
            self._models[level] = self.model.copy()
            self.models_replaced += stale
        self.level = level
        earlier = () if self._hold is None else self._hold[1]  # never holds `left`: it was in force
        held = (*earlier, left) if left_in_flight is not False else earlier
        held = tuple(m for m in held if m is not self.model)
        self._hold = ((now + self.e2e_s, held) if now is not None and in_flight > 0 and held else None)
        self._recompute()
        return True

    @property
    def held_until(self) -> float | None:
        """When the hold of a level change ends at the latest (`set_level`); None without one."""
        return None if self._hold is None else self._hold[0]

    def end_hold(self) -> bool:
        """The requests admitted before the last level change have all left: the caps of the
        level in force apply from now on (`set_level`). True if a hold ended."""
        if self._hold is None:
            return False
        self._hold = None
        self._recompute()
        return True

    def _expire_hold(self, now: float) -> None:
        if self._hold is not None and now >= self._hold[0]:
            self.end_hold()

    def _configure(self, slo: SloConfig, settings: AdmissionConfig, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1 (the engine's batch size), got {slots!r}")
        self.slo = slo
        self.settings = settings
        self.slots = int(slots)
        self.budget_s = (slo.e2e_p99_ms - settings.overhead_ms) / 1000.0
        if self.budget_s <= 0:
            raise ValueError(
                f"admission.overhead_ms: {settings.overhead_ms:g} leaves no budget within "
                f"slo.e2e_p99_ms: {slo.e2e_p99_ms:g}"
            )
        self.overhead_s = settings.overhead_ms / 1000.0
        self.e2e_s = slo.e2e_p99_ms / 1000.0
        shares = slo.class_share
        self._shares = tuple(getattr(shares, c.value) for c in Criticality)

    @classmethod
    def from_config(
        cls, config: DegradationConfig, max_num_seqs: int, share: float = 1.0
    ) -> AdmissionController | None:
        """The controller for a policy, or None when it has no ``slo`` or admission is disabled.

        ``share``: this ingress replica's share of the model's batch (model replicas / ingress
        replicas), so that ``slots = max(1, round(max_num_seqs * share))``.
        """
        if config.slo is None:
            return None
        settings = config.admission or AdmissionConfig()
        if not settings.enabled:
            return None
        return cls(config.slo, settings, max(1, round(max_num_seqs * share)))

    # -- the hot path ------------------------------------------------------------------------

    def decide(self, criticality: Criticality, ahead: int, now: float, preemptible: int = 0) -> Decision:
        """Admit or refuse one request with ``ahead`` (>= 0) requests admitted and unfinished.

        ``ahead``: what this replica admitted that has not finished yet (counting from admission
        is conservative: a request still in its pre stages will reach the model soon).
        ``preemptible``: how many of them belong to less important classes and have not been
        started by the model yet. Where the door is full for this class but would not be without
        them, it is admitted in the place of the fewest that make room (``Decision.preempt``;
        ``admission.preempt_waiting``): the work that can still be had back goes to the more
        important request, which is what keeps critical work whole at the onset of an overload,
        when the door fills before the classes' arrival rates are measured to keep room by.
        """
        rank = _RANK[criticality]
        self._arrivals[rank].add(now)
        cap = self.class_cap(criticality, now)
        if ahead < cap:
            self._refusals.add(now, refused=False)
            self._admitted[rank].add(now)
            return Decision(True, criticality, "admitted", 200, self.predicted_e2e_s(ahead), cap,
                            deadline_at=now + self.e2e_s)
        reason: Reason = "saturated" if ahead >= self.critical_cap(now) else "class_share_exhausted"
        limit: Limit = ("saturated" if reason == "saturated" else "share" if ahead >= self._caps[rank]
                        else "shut_out" if cap == 0 else "ramp" if cap < self._reserved(now)[rank]
                        else "overtaken" if ahead >= self._overtaken[rank] else "reserve")
        # a door full at the ramp tells the level of demand past capacity only while arrivals
        # press the ramp (`ramp_pressed`); otherwise its refusal, or the waiting requests it
        # displaces, are decisions that refused nothing the level could give back
        counted = limit != "ramp" or self.ramp_pressed(cap, now)
        preempt = ahead - cap + 1
        if self.settings.preempt_waiting and 0 < preempt <= min(preemptible, ahead):
            self._refusals.add(now, refused=False)
            self._admitted[rank].add(now)
            for _ in range(preempt):  # each displaced request is a refusal for capacity
                self._refusals.add(now, refused=counted)
            return Decision(True, criticality, "admitted", 200, self.predicted_e2e_s(cap - 1), cap,
                            deadline_at=now + self.e2e_s, preempt=preempt)
        self._refusals.add(now, refused=counted)
        return Decision(False, criticality, reason, STATUS[reason], self.predicted_e2e_s(ahead), cap,
                        retry_after_s=self.retry_after_s(ahead, cap, criticality, now), limited_by=limit)

    def share(self, criticality: Criticality) -> float:
        """``slo.class_share`` of ``criticality``: the part of the latency budget it may use."""
        return self._shares[_RANK[criticality]]

    def share_limit_s(self, criticality: Criticality) -> float:
        """The predicted end-to-end time within which ``criticality`` is admitted: the overhead
        plus its share of the budget (`_recompute`)."""
        return self.overhead_s + self.share(criticality) * self.budget_s

    def reserve(self, criticality: Criticality, now: float) -> int:
        """Slots of its cap that ``criticality`` leaves to the classes above it: its share's cap,
        counting the work that overtakes it (`overtaken_cap`), less its reserved limit
        (`reserved_limits`, from the classes' measured arrival rates and the service model in
        force, within `tail_limit` while critical work arrives and the door stays there); 0 for
        critical."""
        self._expire_hold(now)
        rank = _RANK[criticality]
        limit = self._reserved(now)[rank]
        return max(0, min(self._overtaken[rank], self._caps[0]) - limit)

    def overtaken_cap(self, criticality: Criticality, now: float) -> int:
        """``criticality``'s share's cap counting the more important work that starts before it
        while it waits for a slot (`overtaken_caps`), as in force now; critical's is its share's."""
        self._expire_hold(now)
        self._reserved(now)
        return self._overtaken[_RANK[criticality]]

    def _reserved(self, now: float) -> tuple[int, ...]:
        """`reserved_limits` now, recomputed at most every `RESERVE_REFRESH_S` of ``now`` (the
        rates move with a 10 s time constant) or when the caps or the service model changed; a
        class that no longer arrives (`ArrivalRate.present`) counts as not arriving.

        While critical work arrives and the door stays at `tail_limit` (`_tail_pressed`), each
        class below it is also held to that limit (the concurrency at which the measured tail of
        the latency, not only its mean, is within critical's budget), before the room each keeps
        for the classes above it is sized, so that standard and sheddable work keep their order
        within it. With ``reserve_quantile`` 0 no room is kept for anyone (neither limit).
        Both start from `overtaken_caps`, which holds either way: it is a prediction of when a
        request finishes, not room kept."""
        at, limits = self._limits
        if limits is None or at is None or not (0.0 <= now - at < RESERVE_REFRESH_S):
            caps = self._overtaken = self.overtaken_caps(now)
            q = self.settings.reserve_quantile
            if q > 0.0:
                # a class that no longer arrives (`ArrivalRate.present`) is kept no room
                rates = [a.peak(now) if a.present(now) else 0.0 for a in self._arrivals]
                tail = self._tail_limit
                if tail is not None and self.tail_holds(now):  # first, so the room kept below keeps their order
                    caps = caps[:1] + tuple(min(cap, tail) for cap in caps[1:])
                caps = reserved_limits(rates, caps, self.predictor.latency_s, 1.0 - q)
            limits = caps
            self._limits = (now, limits)
        return limits

    def overtaken_caps(self, now: float) -> tuple[int, ...]:
        """Per class, its share's cap (`max_admitted`) counting the more important work that will
        start before it while it waits for a slot: vLLM's priority scheduler starts every waiting
        request of a more important class first, so past the batch a request of a lower class
        gets slots at ``rate_per_s`` less the rate at which the classes above are admitted, not
        at ``rate_per_s`` (`overtaken_within_s`). The classes above arrive at: critical's offered
        rate (it is refused only where the service is saturated; a critical request handed a
        freed slot after waiting at the door is admitted too) plus the admitted rates of the
        classes between, each its `ArrivalRate.peak`, as none where it no longer arrives
        (`ArrivalRate.present`). Critical's cap is its share's; a class's cap within the batch
        (``<= slots``) is its share's too: it starts at once.

        Measured before this rule (bench/RESULTS.md, 12-06, 2-core AVX-512 Xeon, 2 s SLO, 3 x C0
        with 20% critical work): of the standard requests the door admitted, the share that
        finished past the SLO rose with critical work's offered rate over C3: 0% at 0.38, 1.5% at
        0.39, 4.1% at 0.43, 14.1% at 0.46 and 33.7% at 0.58 (the engine compiled in the last
        two, which served more of the rest). The arrivals above are counted at their mean plus
        ``admission.overtake_sigmas`` standard deviations (1 by default; None: not counted, the
        shares' caps). In the door's model one deviation gave the best goodput under overload;
        on the service it also refused, at 1.5 x C0 with a mixed load, sheddable work that would
        have finished in time (bench/RESULTS.md, 12-07)."""
        caps = self._caps
        sigmas = self.settings.overtake_sigmas
        if sigmas is None:  # not counted: each class's share alone
            return caps
        predictor = self.predictor
        full_s, rate = predictor.latency_s(self.slots), predictor.rate_per_s
        out = [caps[0]]
        for k in range(1, len(caps)):
            above = self.arriving_above(k, now)
            limit_s = self._shares[k] * self.budget_s
            if above <= 0.0 or caps[k] <= self.slots or limit_s <= full_s:
                out.append(caps[k])
                continue
            within_s = overtaken_within_s(full_s, limit_s, above, rate, sigmas)
            out.append(max(1, min(caps[k], predictor.max_within(within_s))))
        return tuple(out)

    def arriving_above(self, rank: int, now: float, estimate: str = "peak") -> float:
        """Requests per second of the classes more important than the class of ``rank`` that
        reach the engine and start before its waiting work: critical's offered rate (it is refused
        only where the service is saturated) plus the admitted rates of the classes between (a
        request refused at the door never reaches the engine), each by ``estimate`` (`ArrivalRate`'s
        ``"peak"``, quick to rise, or ``"rate"``, the long estimate) and as none where it no
        longer arrives (`ArrivalRate.present`); 0 for critical."""
        above = 0.0
        for k in range(rank):
            arrivals = self._arrivals[0] if k == 0 else self._admitted[k]
            if arrivals.present(now):
                above += arrivals.peak(now) if estimate == "peak" else arrivals.rate(now)
        return above

    @property
    def tail_factor(self) -> float:
        """The measured latency's 0.99 quantile over the model's prediction (`LatencyTail`)."""
        return self._tail_factor

    @property
    def tail_limit(self) -> int | None:
        """While critical work arrives and all classes arrive fast enough to keep the door at it
        (`_tail_pressed`), the most requests in flight at which a class below it is admitted:
        the concurrency at which the model's prediction times `tail_factor` is within
        critical's share of the budget, at least 1, so the classes below do not take the server
        past where 99% of requests finish within critical's budget (critical work itself may go
        on to its own cap). None (no such limit) until `TAIL_MIN` completions have measured the
        spread.

        Not for critical work itself, nor the ramp's limit for it (`ramp_limit`): in the door's
        model (`bench/door_sim.py --critical-cap`, 12-07, the AVX2 line, 3 x C0, 48 seeds of
        225 s; bench/RESULTS.md) holding critical work to this limit too refused 293 critical
        requests where its own cap refused 18, saved none of the 38 late ones, and cut goodput
        by a tenth; held to the ramp's limit it refused 29 and was late as often.

        Not one less, for a critical request arriving at that full door: measured (12-04,
        AVX-512 EPYC, 2 s SLO, 3 x C0), one less held standard and sheddable work to 3-4 in
        flight, critical work ran at p99 1.75-1.91 s, and goodput fell to 0.89 x C3 in one
        repeat of three, below what the minimal path serves within the SLO with every request
        counted (C3)."""
        return self._tail_limit

    def saturated_by(self, criticality: Criticality, now: float, usual_speed: bool = False) -> bool:
        """Whether ``criticality`` and the classes above it alone arrive at least as fast as the
        server completes requests (their measured rate less `SHUT_OUT_SIGMAS` of its noise, on
        the long estimate or the fast one, ``>= rate_per_s``): then a slot freed at the full
        door is taken by the next of them anyway, and a request of this class that waits for one
        only spends its budget waiting (`serve_app.admission`: a critical request at a full door
        waits for a freed slot only while critical work alone does not saturate the server).
        ``usual_speed``: the server's rate at the engine's usual speed (`model`), not at the
        slowdown in force (`predictor`), as the critical wait reads it (`critical_wait_s`): a
        slowdown read for a moment divides the rate by as much, and would refuse at once the
        critical work that could wait it out."""
        rate_per_s = (self.model if usual_speed else self.predictor).rate_per_s
        return self._arrive_at_least(_RANK[criticality] + 1, rate_per_s, now)

    def critical_wait_s(self) -> float:
        """The longest a critical request waits for a freed slot at a full door
        (`serve_app.admission`): ``admission.critical_wait_share`` of the SLO, and no longer than
        a request that waited could still finish within critical's limit on an idle server at the
        engine's usual speed (`share_limit_s` less the overhead and `model`'s latency of one
        request alone; not the slowed `predictor`'s): a slowdown read for a second (measured
        12-07, 2-core AVX2 EPYC, 5 s SLO, 3 x C0: a reading of 8.2 for one poll took critical's
        cap to 1 with 4 in flight, and 1.7 for a second to 4 with 5) is waited out, and a freed
        slot still goes only to a request in time at the speed in force (`in_time_after`).
        0 where it cannot wait."""
        limit_s = self.share_limit_s(Criticality.CRITICAL) - self.overhead_s - self.model.latency_s(1)
        return max(0.0, min(self.settings.critical_wait_share * self.e2e_s, limit_s))

    def in_time_after(self, waited_s: float, ahead: int) -> bool:
        """Whether a critical request that has waited ``waited_s`` at the door and would join
        ``ahead`` requests in flight is still predicted to finish within critical's limit:
        ``waited_s + predicted_e2e_s(ahead) <= share_limit_s`` (its deadline runs from its
        arrival). A full door drains in clumps (requests admitted together in a burst run in one
        batch and finish together), so a freed slot with the door still near critical's cap is
        given only to a request that has not waited long; one that has waits on while the door
        drains further, up to `critical_wait_s`."""
        return waited_s + self.predicted_e2e_s(ahead) <= self.share_limit_s(Criticality.CRITICAL) + 1e-9

    def _first_saturate(self, count: int, now: float) -> bool:
        """Whether the ``count`` most important classes alone arrive at least as fast as the
        server completes requests (``>= rate_per_s``, `_arrive_at_least`)."""
        return self._arrive_at_least(count, self.predictor.rate_per_s, now)

    def _arrive_at_least(self, count: int, rate_per_s: float, now: float) -> bool:
        """Whether the ``count`` most important classes together arrive at least at
        ``rate_per_s``: their arrival rate less `SHUT_OUT_SIGMAS` of its noise, the larger of
        that bound on the long estimate and on the fast one (`ArrivalRate.fast_rate`, noisier
        and so discounted more), so a step up is seen within seconds."""
        first = self._arrivals[:count]
        slow = rate_lower_bound(sum(a.rate(now) for a in first), first[0].tau_s, SHUT_OUT_SIGMAS)
        fast = rate_lower_bound(sum(a.fast_rate(now) for a in first), first[0].fast_tau_s, SHUT_OUT_SIGMAS)
        return max(slow, fast) >= rate_per_s

    def tail_holds(self, now: float) -> bool:
        """Whether `tail_limit` holds the classes below critical now: there is one, room is kept
        (``reserve_quantile`` > 0), critical work arrives (`ArrivalRate.present`) and the door stays
        at the limit (`_tail_pressed`)."""
        tail = self._tail_limit
        return (tail is not None and self.settings.reserve_quantile > 0.0
                and self._arrivals[0].present(now) and self._tail_pressed(tail, now))

    def _tail_pressed(self, tail: int, now: float) -> bool:
        """Whether all classes together arrive at least as fast as the server completes
        requests with ``tail`` (`tail_limit`) in flight (``tail / latency_s(tail)``, Little's
        law; `_arrive_at_least`): then each request that leaves is replaced at once, the door
        stays at the limit, and a critical request runs its whole life there (the regime the
        limit is for). Below that the door reaches the limit only in a clump of arrivals, which
        drains before it is refilled, and holding the classes below to it refused their work at
        half the capacity: measured (12-04, AVX-512 EPYC, 2 s SLO), with the limit at any load
        sheddable work at 1.5 x C0 was 43-51% within the SLO (76-94% without it, critical work
        100% within in both), and a refusal in the 0.5 x C0 phase of the step profile raised
        the level before the step. With this gate (same machine, seeds and C0): sheddable work
        at 1.5 x C0 82-90% within, the step's level 1 0.70 s after it, critical work at 3 x
        332 of 337 pooled. At 3 x C0 the arrivals (4.65/s) were about the drain rate at the
        limit (4.2-5.2/s, the machine in a fast phase) and the limit held in 30-59% of the
        polls (4 of the 5 late critical requests were sent where it lapsed); a gate on the
        estimates that also held for ``reserve_window_s`` after (96-99%) left critical work at
        the same 332 of 337 (late in the run's first second and just after the model's line
        had flattened in a lull and raised the limit; one refused) and held the limit in 30-94%
        of the 1.5 x polls (sheddable work 18-67% within): measured worse, reverted. A
        trigger with two thresholds (start on the lower bound, hold on while the upper bound
        reaches the drain rate; ce608db) held it in 79-95% of the 3 x polls and critical work
        was 318 of 325 and 331 of 342 (its own bursts with the limit holding, a slower
        machine, a lull then a clump): no better, reverted (bench/RESULTS.md)."""
        return self._arrive_at_least(len(self._arrivals), tail / self.predictor.latency_s(tail), now)

    def class_cap(self, criticality: Criticality, now: float) -> int:
        """The most requests in flight at which ``criticality`` is still admitted now: its
        reserved limit (`reserved_limits`: its share's cap counting the more important work that
        overtakes it while it waits, `overtaken_caps`, lowered while admitting more of it would
        cost the classes above it more than ``1 - reserve_quantile`` of their requests);
        at least 1 (an idle server admits), except while the classes above it alone arrive at
        least as fast as the server completes requests (their measured arrival rate, less
        `SHUT_OUT_SIGMAS` of its noise, >= `rate_per_s`): they will take every slot, so this
        class is shut out (0) rather than let in whenever the server happens to be idle for a
        moment. Without it, where caps are small (a few requests fill the batch) standard and
        sheddable both sit at the floor of 1 under overload and are shed alike, not in order.
        While a level change's hold lasts (`set_level`), at most the caps before the change
        (critical's only while no class below it arrives: `critical_cap`); and for the classes
        below critical, at most `ramp_limit` while critical work arrives."""
        self._expire_hold(now)
        rank = _RANK[criticality]
        if rank and self._first_saturate(rank, now):  # the classes above it take every slot
            return 0
        limit = self._reserved(now)[rank]
        if not rank:
            limit = min(limit, self.critical_cap(now))
        else:
            ramp = self.ramp_limit(now)
            if ramp is not None:
                limit = min(limit, ramp)
        return limit

    def critical_cap(self, now: float) -> int:
        """Critical's share's cap now (`max_admitted`), within the hold of a level change
        (`set_level`) only while no class below critical arrives (`ArrivalRate.present`): the
        door is saturated at it."""
        self._expire_hold(now)
        held = self._held_critical
        if held is not None and not any(a.present(now) for a in self._arrivals[1:]):
            return held
        return self._caps[0]

    def arrival_rates(self, now: float) -> dict[str, tuple[float, float]]:
        """Each class's measured arrival rate (requests/s offered, admitted or refused) as
        ``(long, fast)``: the `ArrivalRate` estimates on ``admission.reserve_window_s`` and a fifth
        of it that room kept, shut-outs and the tail limit's gate read. For the operator and the
        benchmark's polls: whether a refusal came in a clump or with demand past what the door
        drains at its caps is read from them beside ``class_cap`` and the model's line."""
        return {c.value: (a.rate(now), a.fast_rate(now)) for c, a in zip(Criticality, self._arrivals, strict=True)}

    def measured_reach(self, now: float) -> int:
        """The highest concurrency (``round(m)`` of `ServiceModel.concurrency`, at any level) at
        which a served request completed within the last `RAMP_WINDOW_S` of ``now``; 0 where none.
        Not the level model's `ServiceModel.fresh_reach`: that one starts empty at each level
        change (the engine ran there all the same) and looks back `ServiceModel.FLOOR_FRESH_S`."""
        return max((k for k, at in self._reach.items() if 0.0 <= now - at <= RAMP_WINDOW_S), default=0)

    def ramp_limit(self, now: float) -> int | None:
        """While critical work arrives (`ArrivalRate.present`) and room is kept (``reserve_quantile`` >
        0), the most requests in flight at which a class below critical is admitted:
        `ramp_step` (3 for a batch of 16) more than the concurrency served requests were measured
        at lately (`measured_reach`), at least `RAMP_MIN`. None otherwise, or with ``ramp_step``
        0 (no such limit; critical work is never held to it).

        The caps come from a line fitted where the service ran lately and from what was measured
        higher up within about a minute (`ServiceModel`); above both the line is extrapolated,
        and a batching engine on a few cores is not a line there: measured (12-04, 2-core
        AVX-512 EPYC, 2 s SLO, 3 x C0 with 20% critical work), after a lull the line read
        0.058 s per request, the caps rose to 15-17, and 13 in flight took 2.15-3.08 s; of the
        critical requests late at 3 x, those sent in the first seconds of an overload from calm
        or just after a lull were the largest group. So the classes below critical grow into
        unmeasured concurrency a few requests at a time, each completion at the new concurrency
        opening the next step, while critical work keeps its own cap and goes first.

        Why additive, as TCP's congestion avoidance, and not doubling, as its slow start (the
        first version of this rule, 77659a4: twice the reach): a critical request's latency is
        set by the requests in flight over its whole life, not at its admission, so the lower
        classes admitted after it decide whether it is late, and a doubling step takes them past
        a knee (9 in flight on the EPYC) within one or two completions. In the door's model
        (`bench/door_sim.py`, the EPYC's knee-shaped engine, 60 s of calm first, 20% noise, 96
        seeds, the same seeds for both; bench/results/door_sim_ramp_step.json) 49 of the 68 late
        critical requests of 48 seeds at 7 req/s with doubling were sent in the load's first
        five seconds, where the door ran to 11-16 in flight; adding 3 instead, critical work
        within the SLO at 4 req/s 98.7 -> 99.5%, at 5 req/s 97.7 -> 99.1%, at 7 and 9 req/s
        97.8 -> 99.0% and 96.9 -> 98.1%, goodput 1.7-3.4% up at each; at 2.3 req/s (1.5 x C0
        there) the requests within the SLO the same 98.4%; on the ``concave`` curve and after a
        slow phase within noise. A step of 2 was better still at 7-9 req/s and cost a point of
        the requests within at 2.3 (clumps of arrivals refused); a multiplicative 1.25 cost three
        there."""
        step = self.ramp_step
        if step <= 0 or self.settings.reserve_quantile <= 0.0 or not self._arrivals[0].present(now):
            return None
        return max(RAMP_MIN, self.measured_reach(now) + step)

    def ramp_pressed(self, cap: int, now: float) -> bool:
        """Whether all classes together arrive (`ArrivalRate.fast_rate`) at least as fast as the
        server completes requests with ``cap`` (a `ramp_limit`) in flight, ``cap / latency_s(cap)``:
        then the ramp holds back demand that lasts, and its refusals count in ``refused_ratio``
        (the level's earliest signal, `RefusalWindow`); below that a ramp refusal is a decision
        that refused nothing for the level, as if it had admitted.

        Why: the ramp refuses where the concurrency above has not been measured lately, not where
        the service is measured short of capacity, and at the start of a load from calm it starts
        at `RAMP_MIN`, which a clump of five arrivals at half the capacity passes. Counted as any
        refusal, one such refusal read 5% (a window's `RefusalWindow.MIN_DECISIONS`) and raised
        level 2 for a whole dwell: measured, the step profile's level rose in its 0.5 x C0 phase
        in 14 of the 44 runs stored from 12-03 to 12-06, 12 of them on one refusal; of the 8
        step runs of 12-06 (2 s SLO, AVX-512 Xeon) in 3 on one refusal of the ramp
        (`bench/step_levels.py`), where "level >= 1 within 2 s of the step up" measured nothing.
        The two such refusals of 12-06 whose arrivals the polls kept came with the fast estimate
        at 0.63 and 0.20 of this drain rate;
        after the step up to 3 x C0 the ramp's refusals came at 0.66 of it, then 1.01 half a
        second later and 1.3-2.3 from there on. The fast estimate, not a lower bound on it
        (`_arrive_at_least`): a lower bound would not count that second poll's refusals and
        would delay the level another half second after a step."""
        arriving = sum(a.fast_rate(now) for a in self._arrivals)
        return arriving >= cap / self.predictor.latency_s(cap)

    @property
    def ramp_step(self) -> int:
        """Requests `ramp_limit` admits above the concurrency measured lately: ``admission.ramp_step``,
        or where the policy leaves it unset `RAMP_STEP_SHARE` of this replica's batch (``slots``),
        at least 1 (3 for 16 slots). 0: no ramp."""
        step = self.settings.ramp_step
        return max(1, round(RAMP_STEP_SHARE * self.slots)) if step is None else step

    def retry_after_s(self, ahead: int, cap: int, criticality: Criticality = Criticality.CRITICAL,
                      now: float | None = None) -> int:
        """``Retry-After`` for a refusal of ``criticality`` with ``ahead`` in flight and the class
        admitted below ``cap``: the time for ``ahead + 1 - cap`` requests to drain. Requests
        complete at the saturation rate, but the classes above keep being admitted meanwhile and
        take the freed slots first, so the backlog falls at the saturation rate less their arrival
        rate (`arriving_above`, the long estimate: a drain lasts seconds; counted where ``now`` is
        given). Where they arrive as fast as the server serves, it does not fall:
        ``max_retry_after_s``. Clamped to ``[min_retry_after_s, max_retry_after_s]``."""
        lo, hi = self.settings.min_retry_after_s, self.settings.max_retry_after_s
        above = 0.0 if now is None else self.arriving_above(_RANK[criticality], now, "rate")
        drain_per_s = self.predictor.rate_per_s - above
        if drain_per_s <= 0.0:
            return hi
        drain_s = (ahead + 1 - cap) / drain_per_s
        return min(hi, max(lo, math.ceil(drain_s - 1e-9)))

    # -- feedback ----------------------------------------------------------------------------

    def observe_completion(self, now: float, latency_s: float, service_s: float, ahead: int = 0) -> None:
        """A request the model served finished at ``now``, ``latency_s`` after its admission,
        having had ``service_s`` of the server to itself (`ShareClock`); ``ahead``: the requests
        in flight at its admission where nothing bounded them (admission off), else 0
        (`ServiceModel.observe`).

        Feed completions of requests the model served only: an abort, an error or a
        semantic-cache answer says nothing about the model's capacity. Both times are divided by
        the engine's mean slowdown over the request's life (`set_speed`) before anything learns
        them: the model measures the engine at its usual speed.
        """
        if latency_s > 0:
            f = self._speed.mean(now - latency_s, now)
            if f != 1.0:
                latency_s, service_s = latency_s / f, service_s / f
        if latency_s > 0 and service_s > 0:  # its spread around the prediction where the model places it
            model = self.model
            m = model.concurrency(latency_s, service_s, ahead)
            self._tail.add(latency_s / model.latency_s(m))
            k = max(1, round(m))
            self._reach[k] = max(now, self._reach.get(k, now))
            if len(self._reach) > 4 * self.slots:  # forget what is long past the window
                self._reach = {j: at for j, at in self._reach.items() if now - at <= RAMP_WINDOW_S}
        model, shifts = self.model, self.model.shifts
        if model.observe(now, latency_s, service_s, ahead):
            if model.shifts != shifts:  # the spread was measured around a line the machine left
                self.speed_shifts += model.shifts - shifts
                self._tail = LatencyTail()
            self._recompute()

    def _recompute(self) -> None:
        # admitted iff overhead + latency_s(ahead + 1) <= overhead + share * budget
        predictor = self.predictor
        caps = tuple(predictor.max_within(share * self.budget_s) for share in self._shares)
        held_critical = None
        if self._hold is not None:  # a level change's requests are still in flight (`set_level`)
            f = self._speed.value
            held_critical = caps[0]
            for m in self._hold[1]:  # the levels they were admitted at, at the speed in force
                held = m if f == 1.0 else SlowedModel(m, f)
                bound = tuple(held.max_within(share * self.budget_s) for share in self._shares)
                # critical's own bound applies only where no class below it arrives (`critical_cap`)
                caps = caps[:1] + tuple(min(c, b) for c, b in zip(caps[1:], bound[1:]))
                held_critical = min(held_critical, bound[0])
        self._caps = caps
        self._held_critical = held_critical
        self._tail_factor = self._tail.factor()
        self._tail_limit = (None if len(self._tail) < TAIL_MIN else
                            predictor.max_within(self._shares[0] * self.budget_s / self._tail_factor))
        self._limits: tuple[float | None, tuple[int, ...] | None] = (None, None)  # `_reserved`'s cache
        self._overtaken = caps  # `overtaken_caps` as `_reserved` last computed it

    # -- what the ingress reads --------------------------------------------------------------

    @property
    def rate_per_s(self) -> float:
        """Completions per second at saturation (a full batch's: `ServiceModel.rate_per_s`), at the
        engine's slowdown in force."""
        return self.predictor.rate_per_s

    def max_admitted(self, criticality: Criticality = Criticality.CRITICAL) -> int:
        """The most requests in flight at which ``criticality`` is still admitted.

        Critical's cap is the queue cap to size the hops with: behind it no admitted request
        waits past the SLO. Beyond ``slots`` the rest wait for the model (``model_queued``).
        While a level change's hold lasts, each class's cap as held (`set_level`); critical's
        hold applies only while no class below it arrives (`critical_cap`).
        """
        rank = _RANK[criticality]
        if not rank and self._held_critical is not None:  # as held: `critical_cap` says when it applies
            return self._held_critical
        return self._caps[rank]

    def predicted_e2e_s(self, ahead: int) -> float:
        return self.overhead_s + self.predictor.latency_s(ahead + 1)

    def drain_s(self, in_flight: int) -> float:
        """Seconds for ``in_flight`` requests to drain at the saturation rate."""
        return in_flight / self.predictor.rate_per_s

    @property
    def wait_smoothing_s(self) -> float:
        """The time constant ``signals`` averages the requests in flight over: the policy's
        ``admission.wait_smoothing_s``, or where it is unset `WAIT_SMOOTHING_ALONE` times the
        latency of one request alone in the model in force."""
        tau = self.settings.wait_smoothing_s
        return WAIT_SMOOTHING_ALONE * self.model.latency_s(1) if tau is None else tau

    def _smoothed_in_flight(self, in_flight: int, now: float) -> float:
        """The requests in flight averaged over `wait_smoothing_s` (an exponential average of
        the counts ``signals`` is called with, weighted by the time between calls); the count
        itself when it is 0 or on the first call. Exactly 0 once nothing is in flight and the
        average has fallen below a hundredth of a request."""
        tau = self.wait_smoothing_s
        prev, at = self._in_flight_avg
        if tau <= 0 or at is None:
            avg, at = float(in_flight), now if at is None else max(at, now)
        elif now > at:
            keep = math.exp(-(now - at) / tau)
            avg, at = keep * prev + (1.0 - keep) * in_flight, now
        else:  # no time has passed: the average stands
            avg = prev
        if in_flight == 0 and avg < 0.01:
            avg = 0.0
        self._in_flight_avg = (avg, at)
        return avg

    def signals(self, in_flight: int, now: float) -> dict[str, float]:
        """This replica's early signals for the policy actor (names from policies.config.SIGNALS).

        ``predicted_wait_ms``: the queueing delay a request arriving now would see
        (``latency_s(in_flight + 1) - latency_s(1)``), on the scale of the SLO: multiplied by
        ``e2e / (e2e - latency_s(1))``, the SLO over the room that the unloaded latency leaves
        for queueing.
        So it reaches the SLO exactly when a request arriving now would finish at the SLO,
        whatever the unloaded latency, and a level triggered at a fraction of the SLO fires when
        queueing has used that fraction of the room. Where one request alone takes little of the
        SLO it is the plain queueing delay. The count of requests in flight is averaged over
        `wait_smoothing_s`: the door decides on the instant count, but a level switches features
        off for at least its dwell (30 s), so it follows sustained load, not a clump of two
        Poisson arrivals. A clump lasts about one request's latency, so the time constant is
        `WAIT_SMOOTHING_ALONE` (2) latencies of one request alone unless the policy sets one: a
        clump of two then moves the average by well under one request, while a step to overload
        keeps the count up and reaches the trigger within about two latencies. Measured
        (replayed on the admission polls, 0.5 s apart, of the step profiles of six runs on the
        2-core AVX-512 EPYC at level 0 at the step, one request alone 0.7-0.9 s): at 4 s, the
        setting before, this signal would have raised level 1 3.0-5.0 s after the step in the
        four runs of 12-03 and 8.9 and 15.2 s in the two of 12-02 (refusals came first: 2.9-3.6 s
        in the seed-7 runs of 12-03); at 1.5 s, 1.45-1.97 s and 2.5 and 3.9 s. In the 0.5 x C0
        phase before the step (28 polls per run) it read 35% at one poll in two of nine runs (at
        4 s: none). The fixed 4 s was chosen on a machine where one request alone took 1.5 s of
        a 4 s SLO; twice that is 3 s there. It falls to exactly 0 within a few time constants
        once nothing is in flight, so a level raised on it can always recover when the load is
        gone.

        ``refused_ratio``: the share of this replica's door decisions over the last
        ``refusal_window_s`` that refused for capacity (see the module docstring).
        """
        model = self.predictor
        alone_s = model.latency_s(1)
        room_s = max(self.e2e_s - alone_s, 0.05 * self.e2e_s)
        queued_s = model.latency_s(self._smoothed_in_flight(in_flight, now) + 1.0) - alone_s
        wait_s = queued_s * self.e2e_s / room_s
        return {
            "predicted_wait_ms": round(wait_s * 1000.0, 1),
            "model_queued": round(max(0, in_flight - self.slots) / self.model_replicas, 3),
            "refused_ratio": round(self._refusals.ratio(now), 4),
        }


def default_prior(slo: SloConfig, slots: int) -> tuple[float, float]:
    """The cold-start model when no ``prior_rate_per_s`` is configured, as ``(base_s,
    per_request_s)``: one request alone takes half the SLO, and a full batch the whole SLO
    (``per_request_s = e2e / 2 / (slots - 1)``).

    An SLO is set so that one request alone meets it comfortably; these admit about one batch
    before the first measurement, and the first window of completions replaces them.
    """
    e2e_s = slo.e2e_p99_ms / 1000.0
    return e2e_s / 2.0, e2e_s / 2.0 / max(1, slots - 1)


def default_prior_rate(slo: SloConfig, slots: int) -> float:
    """The saturation rate of `default_prior`: a full batch of ``slots`` within the SLO."""
    base_s, per_request_s = default_prior(slo, slots)
    return ServiceModel(base_s, per_request_s, slots=slots).rate_per_s


def queue_caps(
    slo: SloConfig, settings: AdmissionConfig, max_num_seqs: int, rate_per_s: float | None = None
) -> dict[str, int]:
    """Static queue sizes for the serving hops, so that no admitted request waits past the SLO.

    ``max_in_flight``: rate * budget, the most requests the model should hold (running +
    waiting); ``max_waiting``: the part of it beyond the batch. With ``rate_per_s`` None the
    prior is used (the cold-start cap; the live cap is `AdmissionController.max_admitted`).
    """
    ctl = AdmissionController(
        slo,
        settings if rate_per_s is None else settings.model_copy(update={"prior_rate_per_s": rate_per_s}),
        max_num_seqs,
    )
    cap = ctl.max_admitted(Criticality.CRITICAL)
    return {"max_in_flight": cap, "max_waiting": max(0, cap - max_num_seqs)}


__all__ = [
    "CRITICALITY_HEADER",
    "AdmissionController",
    "Criticality",
    "Decision",
    "ServiceModel",
    "RefusalWindow",
    "ShareClock",
    "STATUS",
    "classify",
    "default_prior",
    "loss_chain",
    "refused_share",
    "reserved_limits",
    "default_prior_rate",
    "queue_caps",
    "should_drop",
]
