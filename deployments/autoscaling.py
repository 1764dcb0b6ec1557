"""The model deployment's Serve autoscaling policy, fed by the same signals as degradation.

``serve_app.app`` sets it as the VLLMModel deployment's ``autoscaling_config.policy`` when
``args.model.autoscaling`` is given. Serve's controller calls `brownout_autoscaling_policy` every
control-loop period (0.1 s) with an ``AutoscalingContext``; the rule (why refusals count as
demand, why the count never falls while degraded) is `policies.autoscale`'s. Serve then applies
``min_replicas``/``max_replicas``, the up/down-scaling factors and ``upscale_delay_s``/
``downscale_delay_s`` to what it returns.

Both directions of the conversation with the policy actor run here, inside the controller, and
neither may block it (a blocking call would stall every deployment's reconciliation):

- **reading the policy**: `PolicyFeed` keeps at most one ``load()`` call in flight, started at
  most every ``read_s``; each policy call only checks whether it has finished (``ray.wait`` with
  a zero timeout) and keeps the newest answer. An answer older than ``stale_s`` counts as none:
  the count then does not fall (fail static);
- **telling the policy**: ``model_replicas_pending`` (``target - running``: replicas asked for
  that do not serve yet) goes to the actor as a one-way ``report`` from the source
  ``autoscaler:<app>/<deployment>``, on change and at least every ``heartbeat_s`` (1 s, well
  inside the actor's ``stale_after_s``), so the policy hears a scale-up one control-loop period
  after it was decided.

The actor handle is looked up by name (a short blocking lookup), at most every ``resolve_s``
after a failure. Serve pickles this module by value into the controller; what it imports
(`policies.autoscale`, `policies.actor`) must be importable there (the package is installed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from policies.autoscale import PolicyLoad, desired_replicas, pending_replicas

logger = logging.getLogger("ray.serve")

POLICY_FUNCTION = "deployments.autoscaling:brownout_autoscaling_policy"


class PolicyFeed:
    """Non-blocking reads of the policy actor's ``load()`` and one-way pending reports.

    ``resolve()`` returns the actor handle (raises if there is none); ``ready(ref)`` says whether a
    call has finished without waiting; ``get(ref)`` takes its result. Injected so the timing
    rules are tested without Ray.
    """

    def __init__(self, source: str, resolve: Callable[[], Any], ready: Callable[[Any], bool],
                 get: Callable[[Any], Any], read_s: float = 1.0, stale_s: float = 5.0,
                 heartbeat_s: float = 1.0, resolve_s: float = 5.0) -> None:
        self.source = source
        self._resolve, self._ready, self._get = resolve, ready, get
        self.read_s, self.stale_s, self.heartbeat_s, self.resolve_s = read_s, stale_s, heartbeat_s, resolve_s
        self._handle: Any = None
        self._resolve_after = -float("inf")
        self._inflight: Any = None
        self._read_at = -float("inf")  # when the last load() call was started
        self._load: PolicyLoad | None = None
        self._load_at = -float("inf")  # when the newest answer arrived
        self._sent: tuple[int, float] | None = None  # (pending, when) last reported
        self.failures = 0

    def _actor(self, now: float) -> Any:
        if self._handle is None and now >= self._resolve_after:
            try:
                self._handle = self._resolve()
            except Exception as err:  # noqa: BLE001 - no actor yet (or GCS busy): try later
                self._fail(now, "resolve", err)
        return self._handle

    def _fail(self, now: float, what: str, err: BaseException) -> None:
        self.failures += 1
        self._handle = None
        self._resolve_after = now + self.resolve_s
        if self.failures == 1 or self.failures % 100 == 0:
            logger.warning("autoscaling policy: %s of the policy actor failed (%d so far): %r",
                           what, self.failures, err)

    def load(self, now: float) -> PolicyLoad | None:
        """The newest ``PolicyLoad`` no older than ``stale_s``, else None; starts the next read."""
        if self._inflight is not None:
            try:
                if self._ready(self._inflight):
                    ref, self._inflight = self._inflight, None
                    self._load, self._load_at = self._get(ref), now
            except Exception as err:  # noqa: BLE001 - the actor died under the call
                self._inflight = None
                self._fail(now, "load()", err)
        if self._inflight is None and now - self._read_at >= self.read_s:
            actor = self._actor(now)
            if actor is not None:
                self._read_at = now
                try:
                    self._inflight = actor.load.remote()
                except Exception as err:  # noqa: BLE001
                    self._fail(now, "load()", err)
        return self._load if now - self._load_at <= self.stale_s else None

    def report_pending(self, pending: int, now: float) -> bool:
        """Send ``model_replicas_pending`` one-way if it changed or the heartbeat is due."""
        if self._sent is not None and self._sent[0] == pending and now - self._sent[1] < self.heartbeat_s:
            return False
        actor = self._actor(now)
        if actor is None:
            return False
        try:
            actor.report.remote(self.source, {"model_replicas_pending": float(pending)})
        except Exception as err:  # noqa: BLE001
            self._fail(now, "report", err)
            return False
        self._sent = (pending, now)
        return True


def ray_feed(source: str) -> PolicyFeed:
    import ray

    from policies.actor import get_policy_actor

    return PolicyFeed(
        source,
        resolve=get_policy_actor,
        ready=lambda ref: bool(ray.wait([ref], timeout=0)[0]),
        get=ray.get,
    )


_FEEDS: dict[str, PolicyFeed] = {}


def brownout_autoscaling_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve's custom autoscaling policy for the model deployment (``ctx``: an
    ``AutoscalingContext``): reports the pending replicas, returns the desired count."""
    key = f"{ctx.app_name}/{ctx.deployment_name}"
    feed = _FEEDS.get(key)
    if feed is None:
        feed = _FEEDS[key] = ray_feed(f"autoscaler:{key}")
    return decide(ctx, feed, time.monotonic())


def decide(ctx: Any, feed: PolicyFeed, now: float) -> tuple[float, dict[str, Any]]:
    running = int(ctx.current_num_replicas)
    feed.report_pending(pending_replicas(ctx.target_num_replicas, running), now)
    load = feed.load(now)
    if running == 0:
        return float(ctx.target_num_replicas), {}  # Serve's cold start (from zero) decides
    target = float(ctx.config.get_target_ongoing_requests())
    desired = desired_replicas(running, float(ctx.total_num_requests), target, load)
    return desired, {"level": None if load is None else load.level,
                     "refused_ratio": None if load is None else load.refused_ratio}
