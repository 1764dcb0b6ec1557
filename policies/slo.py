"""Derive a degradation policy from the SLO and the engine's batch size.

``derive_policy(config, max_num_seqs)`` fills in the levels of a policy that has an ``slo``
section, so that a user sets ``slo: {e2e_p99_ms: 2000}`` and gets triggers that fit it. Pure: no
I/O; the result is validated like any policy.

The rule, and why:

- **Rise on early signals, before latency is lost.** Latency percentiles move only after many
  requests have already been slow; the queue in front of the model and the admission
  controller's predicted queueing delay (`policies.admission`) move as soon as work piles up.
  So every level triggers on those first and on latency only as a backstop:

  ========  ==============================  =====================  ===============  ======================
  level     requests waiting for the model  ``predicted_wait_ms``  ``refused_ratio``  backstop
            (``model_queued``,
            ``queue_length``)
  ========  ==============================  =====================  ===============  ======================
  1         >= 1/4 of the waiting room      >= 35% of              >= 2%            kv_cache_usage 0.80
                                            ``e2e_p99_ms``
  2         >= 1/2                          >= 50%                 >= 5%            kv 0.90, p95 >= 90% SLO
  3         >= 3/4                          >= 70%                 >= 10%           p95 >= SLO, ttft_p95 >=
                                                                                    ``ttft_p99_ms``
  ========  ==============================  =====================  ===============  ======================

  ``predicted_wait_ms`` (`policies.admission.AdmissionController.signals`) is the queueing delay
  a request arriving now would see, on the SLO's scale: it reaches ``e2e_p99_ms`` when that
  request would finish exactly at the SLO, so a fraction of the SLO here is the same fraction of
  the room that the unloaded latency leaves for queueing, on a fast model and a slow one alike.
  Where one request alone takes little of the SLO (2 s SLO, 0.3 s alone), standard and
  sheddable work reach their default shares (0.9 of the budget) at about 88% of the room, so
  all three levels come before a share refuses anything; the room kept for critical work
  (`policies.admission`) refuses the classes below it earlier while critical work arrives,
  and such refusals raise the level at once (``refused_ratio``, below). Where
  one request alone takes much of it (4 s SLO, 1.5 s alone on 2 CPU cores, each request in
  flight adding about 0.8 s), the room holds three requests: one in flight on average stays
  at level 0, two raise level 2 and three level 3, which is what such a machine needs. The
  count is averaged over ``admission.wait_smoothing_s`` (by default twice the measured
  latency of one request alone: about 1.5 s with the embedded model on 2 AVX-512 cores, 3.6 s
  on 2 AVX2 cores), so a moment of two Poisson arrivals at half the capacity does not switch
  features off for a whole dwell; sustained, the levels come within seconds (and refusals at
  the door raise them at once). Level 1 sits at 35% rather than lower so that a single
  request in flight on such a machine (about a third of the room) does not hold level 1 for
  as long as any traffic lasts. The wait falls
  to 0 once nothing is in flight, so every level can recover when load is gone.
  ``refused_ratio`` is the share of requests the ingress refused for capacity over the last
  ``admission.refusal_window_s`` (`policies.admission.RefusalWindow`). Admission holds the
  in-flight count, and so the predicted wait, under the SLO by refusing; past capacity those
  two stop rising while demand still does, and only the refusals show it. A refusal while
  optional work still runs is the wrong order (core traffic turned away to keep extras), so
  refusals raise the level at once: a few percent refused (sheddable work only, typically)
  switch off level 1's features; a tenth refused means demand is well past this level's
  capacity and goes to level 3 in one step (escalation takes the highest level triggered). A
  window with fewer than 20 decisions counts as 20, so a lone refusal at low traffic reads 5%
  (level 2), not 50%; and a refusal of the door's ramp into unmeasured concurrency counts only
  while arrivals press it (`policies.admission.AdmissionController.ramp_pressed`), so a clump at
  half the capacity just after calm raises nothing. It recovers below 0.5%: at a few requests
  per second, a window with no refusal at all.
- **Autoscaling: degrade while capacity is on its way.** Where the model deployment autoscales
  (`policies.autoscale`), ``model_replicas_pending`` counts the replicas the autoscaler asked for
  that do not serve yet. Level 1 triggers while any is pending and recovers (with its dwell)
  once all serve: the load already exceeded what the running replicas are meant to carry, and
  the cheapest optional work is switched off until the new capacity arrives. Higher levels are
  left to the other signals. Without autoscaling the signal is absent and changes nothing.
- **Reachable by construction.** The waiting room is ``max_waiting`` requests (default
  ``max_num_seqs``: the model deployment admits twice its batch, so at most one batch waits in
  vLLM); a queue threshold above it could never fire (the old level 3's ``queue_length: 48``
  against at most 16 waiting), so none is derived above it, and a level whose quarter-steps do
  not fit keeps only its other triggers. The predicted time reaches the SLO at the admission cap.
- **Fall with the existing hysteresis.** Queue triggers recover below a quarter of their value
  (4 -> 1: the queue must essentially empty), the prediction below 60% of its trigger, the rest
  at the policy's ``recover_ratio``; dwell, cooldown and flap damping are the controller's.
- **Explicit values win.** A signal the document names at any level is left entirely to the
  document (its thresholds at every level); only signals it does not name are derived. A level
  the document leaves out gets the default features to turn off (level 1: cache writes, debug
  capture, light metrics; level 2: personalization, A/B, feature statistics; level 3: every
  optional feature) and a 30 s dwell with a 15 s cooldown. Deriving twice changes nothing.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from policies.config import LEVEL_KEYS, DegradationConfig, PolicyError, SloConfig, _format
from policies.features import DEFAULT_DISABLE

QUEUE_FRACTIONS = (0.25, 0.5, 0.75)  # of the waiting room, per level
PREDICTED_FRACTIONS = (0.35, 0.5, 0.7)  # of e2e_p99_ms, per level
QUEUE_RECOVER_RATIO = 0.25
PREDICTED_RECOVER_RATIO = 0.6
REFUSED_FRACTIONS = (0.02, 0.05, 0.10)  # of the requests decided on in the refusal window, per level
REFUSED_RECOVER = 0.005
PENDING_TRIGGER = 1.0  # level 1 while any model replica the autoscaler asked for is not serving
PENDING_RECOVER = 0.5  # recover once none is pending (a value at or above it is not calm)
DEFAULT_DWELL_S = 30.0
DEFAULT_COOLDOWN_S = 15.0


def queue_thresholds(max_waiting: int) -> tuple[int | None, int | None, int | None]:
    """Per level, the waiting-request count that triggers it; None where it cannot fit.

    Strictly ascending integers, each at most ``max_waiting`` (reachable).
    """
    out: list[int | None] = []
    prev = 0
    for fraction in QUEUE_FRACTIONS:
        value = max(prev + 1, math.ceil(fraction * max_waiting))
        if value > max_waiting:
            out.append(None)
            continue
        out.append(value)
        prev = value
    return out[0], out[1], out[2]


def derived_levels(
    slo: SloConfig, max_num_seqs: int, max_waiting: int | None = None
) -> dict[str, dict[str, dict[str, float]]]:
    """``{"level1": {"trigger": {...}, "recover": {...}}, ...}`` for an SLO and a batch size."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs!r}")
    waiting = max_num_seqs if max_waiting is None else max_waiting
    if waiting < 0:
        raise ValueError(f"max_waiting must be >= 0, got {max_waiting!r}")
    e2e = slo.e2e_p99_ms
    queues = queue_thresholds(waiting)
    levels: dict[str, dict[str, dict[str, float]]] = {}
    for i, key in enumerate(LEVEL_KEYS):
        trigger: dict[str, float] = {}
        recover: dict[str, float] = {}
        q = queues[i]
        if q is not None:
            for name in ("model_queued", "queue_length"):
                trigger[name] = float(q)
                recover[name] = q * QUEUE_RECOVER_RATIO
        predicted = round(PREDICTED_FRACTIONS[i] * e2e, 1)
        trigger["predicted_wait_ms"] = predicted
        recover["predicted_wait_ms"] = round(predicted * PREDICTED_RECOVER_RATIO, 1)
        trigger["refused_ratio"] = REFUSED_FRACTIONS[i]
        recover["refused_ratio"] = REFUSED_RECOVER
        if i == 0:
            trigger["kv_cache_usage"] = 0.80
            trigger["model_replicas_pending"] = PENDING_TRIGGER
            recover["model_replicas_pending"] = PENDING_RECOVER
        elif i == 1:
            trigger["kv_cache_usage"] = 0.90
            trigger["p95_latency_ms"] = round(0.9 * e2e, 1)
        else:
            trigger["p95_latency_ms"] = float(e2e)
            if slo.ttft_p99_ms is not None:
                trigger["ttft_p95_ms"] = float(slo.ttft_p99_ms)
        levels[key] = {"trigger": trigger, "recover": recover}
    return levels


def derive_policy(
    config: DegradationConfig, max_num_seqs: int, max_waiting: int | None = None
) -> DegradationConfig:
    """``config`` with its levels filled in from its ``slo`` (unchanged when it has none).

    ``max_num_seqs``: the engine's batch size; ``max_waiting``: how many requests can wait for
    the model (default ``max_num_seqs``). Raises `PolicyError` if the result does not validate.
    """
    if config.slo is None:
        return config
    derived = derived_levels(config.slo, max_num_seqs, max_waiting)
    doc: dict[str, Any] = config.model_dump(mode="json", exclude_none=True)
    named = {
        name
        for key in LEVEL_KEYS
        for name in (doc.get(key) or {}).get("trigger", {})
    }
    for i, key in enumerate(LEVEL_KEYS):
        level = doc.get(key)
        if level is None:
            level = {
                "disable": list(DEFAULT_DISABLE[i]),
                "recover_dwell_s": DEFAULT_DWELL_S,
                "cooldown_s": DEFAULT_COOLDOWN_S,
            }
        trigger = dict(level.get("trigger", {}))
        recover = dict(level.get("recover", {}))
        for name, value in derived[key]["trigger"].items():
            if name in named:
                continue  # the document owns this signal
            trigger[name] = value
            if name in derived[key]["recover"]:
                recover[name] = derived[key]["recover"][name]
        doc[key] = {**level, "trigger": trigger, "recover": recover}
    try:
        return DegradationConfig.model_validate(doc)
    except ValidationError as err:
        raise PolicyError(f"derived policy: {_format(err)}") from None


def check_reachable(config: DegradationConfig, max_waiting: int) -> None:
    """Reject a ``queue_length`` trigger the engine can never reach.

    vLLM's waiting queue holds at most ``max_waiting`` requests per model replica (the model
    deployment admits ``max_ongoing_requests``, and ``max_num_seqs`` of them run): a trigger
    above that never fires and its level would never be reached on that signal (the old level
    3's ``queue_length: 48`` against at most 16 waiting). Raises `PolicyError` naming the key,
    its value and the limit.
    """
    for key in LEVEL_KEYS:
        level = getattr(config, key)
        if level is None:
            continue
        value = level.trigger.get("queue_length")
        if value is not None and value > max_waiting:
            raise PolicyError(
                f"{key}.trigger.queue_length: {value:g} can never fire: at most {max_waiting} requests "
                f"wait in vLLM (the model deployment's max_ongoing_requests minus max_num_seqs)"
            )


def fit_policy(config: DegradationConfig, max_num_seqs: int, max_waiting: int | None = None) -> DegradationConfig:
    """The policy as it runs on an engine with batch ``max_num_seqs``: every queue trigger
    checked against the waiting room (`check_reachable`), then levels derived from the ``slo``
    (`derive_policy`). ``max_waiting`` defaults to ``max_num_seqs`` (the model deployment admits
    twice its batch)."""
    check_reachable(config, max_num_seqs if max_waiting is None else max_waiting)
    return derive_policy(config, max_num_seqs, max_waiting)


__all__ = ["check_reachable", "derive_policy", "derived_levels", "fit_policy", "queue_thresholds"]
