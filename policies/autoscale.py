"""Autoscaling the model deployment with degradation: how many model replicas the load asks for.

Two loops answer one overload. Serve's autoscaler adds model replicas: real capacity, but late
(its ``upscale_delay_s``, then a replica that loads a model: tens of seconds, minutes on a large
GPU model). Brownout's policy switches optional work off and refuses at the door what cannot
finish within the SLO: within a tick, but it creates no capacity beyond level 3's. So the
autoscaler adds capacity and degradation buys the time until it arrives. Left alone they fight
in two ways; the rule here prevents both:

1. **Admission hides demand from a queue-based autoscaler.** Serve's default policy scales on
   the requests ongoing at the model (running + queued). Brownout's admission refuses at the
   ingress whatever would wait past the SLO, so the model's queue stays short exactly when
   demand is highest, and a queue-based autoscaler would never add a replica (on a small
   machine the SLO admits three requests per replica, far below any sensible
   ``target_ongoing_requests``). But the door refuses for capacity only when what it admitted
   has reached its cap: a replica set that refuses is saturated, and the demand it sees is what
   it serves over the share it admits. So the desired count is the larger of the queue-based
   figure (``ongoing / target_ongoing_requests``) and ``running / (1 - refused_ratio)`` once
   ``refused_ratio`` (the policy actor's, `policies.admission.RefusalWindow`) is above
   ``SCALE_UP_REFUSED`` (5%: a lone refusal, which reads exactly 5% of a 20-decision floor, is
   not a reason; two of them are, and so is more than 5% of a busy window). It counts at most
   ``MAX_REFUSED`` (90%) of the window as refused: a burst of refusals asks for at most ten
   times the replicas, and Serve's ``upscaling_factor`` and ``max_replicas`` bound the step.
2. **Degradation lowers the load the autoscaler sees.** At level 1 and above optional work is
   off and requests may be refused, so the measured load under-states demand; scaling down then
   would remove capacity that recovery (features back on, refusals ended) needs at once, the
   level would rise again, and the loops would oscillate. So the count never falls while the
   level is above 0 or any request was refused in the window: scale-down waits until the
   policy has fully recovered, and then Serve's ``downscale_delay_s``. Where the policy cannot
   be read (actor restarting), the count does not fall either (fail static, as the policy does
   with a stale signal).

And the policy hears the autoscaler: the adapter (`deployments.autoscaling`) reports
``model_replicas_pending``, replicas the autoscaler asked for that do not serve yet. The derived
policy (`policies.slo`) raises level 1 while any is pending: the capacity is on its way, and the
cheapest optional work is switched off until it arrives; the level recovers with its dwell once
every replica serves.

Pure: no Ray, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

SCALE_UP_REFUSED = 0.05  # refused_ratio above which refusals count as unserved demand (a lone refusal: 0.05)
MAX_REFUSED = 0.9  # refused_ratio counted at most this high: demand at most 10x what is served


@dataclass(frozen=True)
class PolicyLoad:
    """What the autoscaler reads of the policy: the level in force and the share of requests
    refused at the door over the refusal window (`PolicyCore.load`)."""

    level: int
    refused_ratio: float


def desired_replicas(
    running: int, ongoing: float, target_ongoing: float, policy: PolicyLoad | None
) -> float:
    """The model replicas this load asks for, before Serve's bounds, factors and delays.

    ``running``: replicas serving now; ``ongoing``: requests running or queued at them (Serve's
    ``total_num_requests``); ``target_ongoing``: Serve's ``target_ongoing_requests`` per
    replica; ``policy``: the policy's load, None where it could not be read.
    """
    if target_ongoing <= 0:
        raise ValueError(f"target_ongoing must be > 0, got {target_ongoing!r}")
    if running <= 0:
        return max(0.0, ongoing / target_ongoing)
    desired = max(0.0, ongoing) / target_ongoing
    if policy is None:
        return max(desired, float(running))  # cannot tell that the policy has recovered
    refused = min(max(policy.refused_ratio, 0.0), MAX_REFUSED)
    if refused > SCALE_UP_REFUSED:
        desired = max(desired, running / (1.0 - refused))
    if policy.level > 0 or refused > 0.0:
        desired = max(desired, float(running))
    return desired


def pending_replicas(target: int, running: int) -> int:
    """Replicas the autoscaler asked for that do not serve yet (starting, or not yet placed)."""
    return max(0, int(target) - int(running))
