"""Deadline-aware admission by criticality: admit a request only if it can finish within its budget.

Pure: no clock, no I/O, no Ray. Every call takes ``now``; the caller keeps one
`AdmissionController` per ingress replica and feeds it what it sees.

The rule, and why:

- **Little's law sets the limit.** With the model completing ``rate`` requests per second at
  full load, at most ``rate * budget_s`` requests can be in flight at the model and all still
  finish within ``budget_s``; one more and the last of them misses it. So a request with
  ``ahead`` requests already admitted and unfinished in front of it (running or waiting at the
  model, wherever they wait) is predicted to finish after ``overhead + (ahead + 1) / rate``,
  where ``budget_s = slo.e2e_p99_ms - admission.overhead_ms`` (the time spent outside the model,
  in the ingress and enrichments, is taken off first).
- **Classes share the budget.** Class c may use ``class_share[c] * budget_s`` (critical 1.0,
  standard 0.8, sheddable 0.6 by default), so its concurrency cap is
  ``max_admitted(c) = max(1, floor(class_share[c] * rate * budget_s))`` and it is admitted iff
  ``ahead < max_admitted(c)``: one integer comparison per request. As the backlog grows,
  sheddable is refused first, then standard; critical is admitted while any room remains. A
  request with nothing ahead is always admitted: refusing it would help no one.
- **Refusals are honest.** A refused class that critical work could still pass gets 429
  ``class_share_exhausted``; when even critical is refused the service is ``saturated``: 503.
  ``Retry-After`` is the predicted time for the backlog to drain to where this class is admitted
  again, ``ceil((ahead + 1 - max_admitted(c)) / rate)``, clamped to
  ``[min_retry_after_s, max_retry_after_s]``: it grows with the backlog instead of inviting every
  refused client back at once after a constant.
- **Late work is dropped, not computed.** Each admitted request carries ``deadline_at = now +
  e2e_p99``; `should_drop` tells the model deployment, just before the engine starts it, that it
  can no longer finish in time. Its answer would miss the SLO anyway, and computing it would
  delay the requests behind it that still can make it.
- **The rate is measured** (`RateEstimator`): an EWMA of completions per second over windows of
  ``rate_window_s``. A window in which the model was busy at the admission limit measures
  capacity; any other window is limited by demand, so it can only raise the estimate. Cold start
  uses ``prior_rate_per_s`` (default: the batch completes in half the SLO). Because the cap is
  ``rate * budget``, the controller finds the concurrency at which latency equals the budget:
  while latency at the current concurrency is below budget the measured rate lets the cap grow
  past it, and above budget the cap shrinks (the fixed point of Vegas-style limits, reached
  from the SLO instead of from a minimum RTT).

Why not Netflix Gradient2/Vegas alone: they steer a concurrency limit from the ratio of a
long-term (or minimum) RTT to the current one, which needs a stable no-load latency. An LLM
request's latency depends mostly on its output length, so its RTT gradient is noise; and they
know nothing of an SLO or of classes. Admission against an explicit budget with a measured
rate gives the same adaptive limit, reasons in the SLO's own units, and serves classes with
one comparison.

Per replica: each ingress replica keeps its own controller and counts its own requests in
flight and its own completions; with ``n`` ingress replicas in front of ``m`` model replicas
pass ``slots = max_num_seqs * m / n`` (`AdmissionController.from_config`'s ``share``). A stalled
engine (no completions at all) does not lower the rate, but the cap still bounds what is
admitted meanwhile.

Wiring (the ingress)::

    admission = AdmissionController.from_config(policy, max_num_seqs=16)   # None: admit all
    klass = classify(key_tier or policy.slo.default_class, headers.get(CRITICALITY_HEADER))  # ValueError: 400
    d = admission.decide(klass, ahead=in_flight, now=time.time())
    if not d.admitted:   # d.status 429/503, d.reason, d.retry_after_s -> Retry-After header
        ...
    in_flight += 1                          # request["priority"] = klass.vllm_priority
    ...; in_flight -= 1
    admission.observe_completion(time.time(), in_flight)      # served by the model only
    # on reconfigure(): admission.update(policy.slo, policy.admission or AdmissionConfig())
    # the model deployment, before the engine starts a request:
    if should_drop(d.deadline_at, time.time()): ...            # abort, answer 503
    # every report tick: admission.signals(in_flight) -> predicted_wait_ms, model_queued
"""

from __future__ import annotations

import enum
import math
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


Reason = Literal["admitted", "class_share_exhausted", "saturated"]
STATUS: dict[Reason, int] = {"admitted": 200, "class_share_exhausted": 429, "saturated": 503}


@dataclass(frozen=True, slots=True)
class Decision:
    """One admission decision. ``status``: 200 admitted, 429 class share exhausted, 503 saturated."""

    admitted: bool
    criticality: Criticality
    reason: Reason
    status: int
    predicted_e2e_s: float  # overhead + (ahead + 1) / rate
    max_admitted: int  # this class's concurrency cap at the time of the decision
    retry_after_s: int | None = None  # integer seconds >= 1 when refused
    deadline_at: float | None = None  # when admitted: past it the answer misses the SLO


class RateEstimator:
    """EWMA of the model's completion rate at full load (completions per second).

    Completions are counted over windows of ``window_s``: a window closes at the first completion
    at least ``window_s`` after it opened, and its rate is ``completions / elapsed``. Then::

        busy window:   rate += alpha * (sample - rate)      (it measured capacity)
        other window:  same, but only if sample > rate      (demand-limited: a lower bound)

    A window is busy when, at every completion in it (and the one that opened it), at least
    ``busy_at`` requests were still in flight counting the finished one, i.e. the batch or the
    admission limit was full the whole time. Defaults (1 s windows, alpha 0.3): a step change
    in capacity is 90% tracked after about 6 busy seconds, while one noisy window moves the
    estimate by under a third.
    """

    __slots__ = ("rate_per_s", "window_s", "alpha", "_opened_at", "_count", "_busy")

    def __init__(self, prior_rate_per_s: float, window_s: float = 1.0, alpha: float = 0.3) -> None:
        if not (prior_rate_per_s > 0 and window_s > 0 and 0 < alpha <= 1):
            raise ValueError(
                f"need prior_rate_per_s > 0, window_s > 0, 0 < alpha <= 1; "
                f"got {prior_rate_per_s!r}, {window_s!r}, {alpha!r}"
            )
        self.rate_per_s = float(prior_rate_per_s)
        self.window_s = window_s
        self.alpha = alpha
        self._opened_at: float | None = None
        self._count = 0
        self._busy = True

    def cap_to(self, rate_per_s: float) -> bool:
        """Lower the estimate to ``rate_per_s`` if it is above it (a completion proved it
        optimistic); True if it changed."""
        if rate_per_s <= 0 or rate_per_s >= self.rate_per_s:
            return False
        self.rate_per_s = rate_per_s
        return True

    def observe(self, now: float, in_flight: int, busy_at: int) -> bool:
        """One completion at ``now``; ``in_flight`` still unfinished after it. True: rate updated."""
        busy = in_flight + 1 >= busy_at
        if self._opened_at is None or now < self._opened_at:  # first one, or the clock went back
            self._opened_at, self._count, self._busy = now, 0, busy
            return False
        self._count += 1
        self._busy = self._busy and busy
        elapsed = now - self._opened_at
        if elapsed < self.window_s:
            return False
        sample = self._count / elapsed
        if self._busy or sample > self.rate_per_s:
            self.rate_per_s += self.alpha * (sample - self.rate_per_s)
        self._opened_at, self._count, self._busy = now, 0, busy
        return True


class AdmissionController:
    """Admission for one ingress replica. See the module docstring for the rule.

    ``slots``: the engine's batch size (``max_num_seqs``), or this replica's share of it.
    """

    def __init__(self, slo: SloConfig, settings: AdmissionConfig, slots: int) -> None:
        self._configure(slo, settings, slots)
        prior = settings.prior_rate_per_s or default_prior_rate(slo, self.slots)
        self.estimator = RateEstimator(prior, settings.rate_window_s, settings.rate_alpha)
        self._caps: tuple[int, ...] = ()
        self._recompute()

    def update(self, slo: SloConfig, settings: AdmissionConfig, slots: int | None = None) -> None:
        """Apply a reloaded policy, keeping the measured rate (a prior only seeds a new one),
        unless the policy sets a new ``prior_rate_per_s``: an operator's explicit rate restarts
        the estimate from it."""
        new_prior = settings.prior_rate_per_s
        if new_prior is not None and new_prior != self.settings.prior_rate_per_s:
            self.estimator = RateEstimator(new_prior, settings.rate_window_s, settings.rate_alpha)
        self._configure(slo, settings, self.slots if slots is None else slots)
        self.estimator.window_s = settings.rate_window_s
        self.estimator.alpha = settings.rate_alpha
        self._recompute()

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

    def decide(self, criticality: Criticality, ahead: int, now: float) -> Decision:
        """Admit or refuse one request with ``ahead`` (>= 0) requests admitted and unfinished.

        ``ahead``: what this replica admitted that has not finished yet (counting from admission
        is conservative: a request still in its pre stages will reach the model soon).
        """
        rank = _RANK[criticality]
        cap = self._caps[rank]
        rate = self.estimator.rate_per_s
        predicted = self.predicted_e2e_s(ahead)
        if ahead < cap:
            return Decision(True, criticality, "admitted", 200, predicted, cap,
                            deadline_at=now + self.e2e_s)
        reason: Reason = "saturated" if ahead >= self._caps[0] else "class_share_exhausted"
        return Decision(False, criticality, reason, STATUS[reason], predicted, cap,
                        retry_after_s=self._retry_after(ahead, cap, rate))

    def _retry_after(self, ahead: int, cap: int, rate: float) -> int:
        drain_s = (ahead + 1 - cap) / rate  # completions needed before this class fits again
        lo, hi = self.settings.min_retry_after_s, self.settings.max_retry_after_s
        return min(hi, max(lo, math.ceil(drain_s - 1e-9)))

    # -- feedback ----------------------------------------------------------------------------

    def observe_completion(self, now: float, in_flight: int, latency_s: float | None = None,
                           ahead_at_admission: int | None = None) -> None:
        """A request finished at ``now``; ``in_flight`` admitted requests are still unfinished.

        Feed completions of requests the model served only: an abort, an error or a
        semantic-cache answer says nothing about the model's capacity.

        ``latency_s`` (admission to completion) and ``ahead_at_admission`` (the ``ahead`` it was
        admitted with) are the request's own evidence. A request that took longer than the
        budget proves the rate too optimistic: it was served at ``(ahead + 1) / latency_s`` at
        best, and the estimate drops to that at once instead of waiting for windows to close
        (a wrong prior, or a machine far slower than assumed, would otherwise keep admitting
        work that cannot finish in time for as long as the first completions take).
        """
        if (latency_s is not None and ahead_at_admission is not None and latency_s > self.budget_s
                and self.estimator.cap_to((ahead_at_admission + 1) / latency_s)):
            self._recompute()
        # Busy: the batch is full, or the admission limit of the least important class is
        # reached. Not critical's: with no critical traffic nothing would fill it, the estimate
        # could then only rise, and a capacity drop (a lower level, a slower replica) would go
        # unseen. At or past the smallest cap the completion rate is the throughput at that
        # concurrency, so caps follow it both ways towards latency == share * budget.
        busy_at = min(self.slots, self._caps[-1])
        if self.estimator.observe(now, in_flight, busy_at):
            self._recompute()

    def _recompute(self) -> None:
        room = self.estimator.rate_per_s * self.budget_s
        self._caps = tuple(max(1, math.floor(share * room + 1e-9)) for share in self._shares)

    # -- what the ingress reads --------------------------------------------------------------

    @property
    def rate_per_s(self) -> float:
        return self.estimator.rate_per_s

    def max_admitted(self, criticality: Criticality = Criticality.CRITICAL) -> int:
        """The most requests in flight at which ``criticality`` is still admitted.

        Critical's cap is the queue cap to size the hops with: behind it no admitted request
        waits past the SLO. Beyond ``slots`` the rest wait for the model (``model_queued``).
        """
        return self._caps[_RANK[criticality]]

    def predicted_e2e_s(self, ahead: int) -> float:
        return self.overhead_s + (ahead + 1) / self.estimator.rate_per_s

    def signals(self, in_flight: int) -> dict[str, float]:
        """This replica's early signals for the policy actor (names from policies.config.SIGNALS).

        ``predicted_wait_ms``: how long the work admitted and unfinished takes to drain at the
        measured rate, i.e. the queueing delay a request arriving now would see. It is 0 when
        nothing is in flight, so a level raised on it can always recover when the load is gone
        (a prediction that included the request's own service time would stay at the unloaded
        latency, above the recover threshold wherever that latency is a large part of the SLO).
        """
        return {
            "predicted_wait_ms": round(in_flight / self.estimator.rate_per_s * 1000.0, 1),
            "model_queued": float(max(0, in_flight - self.slots)),
        }


def default_prior_rate(slo: SloConfig, slots: int) -> float:
    """The cold-start rate when none is configured: a full batch completes in half the SLO.

    An SLO is set so that one request alone meets it comfortably; half of it for a full batch
    admits about two batches' worth before the first measurement, and the measured rate takes
    over within a few busy seconds.
    """
    return slots / (slo.e2e_p99_ms / 2000.0)


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
    "RateEstimator",
    "STATUS",
    "classify",
    "default_prior_rate",
    "queue_caps",
    "should_drop",
]
