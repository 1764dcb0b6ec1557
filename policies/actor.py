"""PolicyActor: the one Ray actor around the pure policy core, shared by every replica.

Name ``brownout-policy`` in namespace ``brownout`` (`ACTOR_NAME`, `ACTOR_NAMESPACE`), detached,
restarted by Ray without limit. Replicas obtain it with `get_or_create_policy_actor`; Serve
replicas run in namespace "serve", so the namespace is always passed explicitly.

Every replica reports its signals with ``report(source, signals)`` on a timer; the actor keeps
the latest report per source (`policies.signals.Aggregator`), and every ``tick_s`` (250 ms)
runs ``decide()``. Each level change is logged as one JSON line and kept in a bounded history.
Readers (ingress replicas) poll ``view()`` in the background, never per request.

The behaviour lives in `policies.service.PolicyCore` (no Ray); this module adds the tick loop,
Ray metrics and persistence in Ray's internal KV store.

Durability: the config and the operator overrides are written to Ray's internal KV store on
every change and read back in ``__init__``, so an actor restarted by Ray comes back with the same
policy and the same pins. Signals and dwell timers are not restored: they rebuild from fresh
reports within ``stale_after_s``, and until then the restored level holds (fail-static).

Remote methods: ``report``, ``view``, ``get_state``, ``set_override``, ``clear_override``,
``update_config``, ``get_config``, ``history``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import ray

from policies.config import default_policy, parse_policy
from policies.controller import Transition
from policies.features import REGISTRY, PolicyView
from policies.service import PolicyCore

ACTOR_NAME = "brownout-policy"
ACTOR_NAMESPACE = "brownout"
KV_KEY = b"brownout-policy/persisted"
KV_NAMESPACE = "brownout"

logger = logging.getLogger("brownout.policy")


def _kv_put(value: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(KV_KEY, value, overwrite=True, namespace=KV_NAMESPACE)


def _kv_get() -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(KV_KEY, namespace=KV_NAMESPACE)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class PolicyActor:
    """The Ray actor: a `PolicyCore`, a tick loop and Ray metrics. See the module docstring."""

    def __init__(self, config: Mapping[str, Any] | None = None, tick_s: float = 0.25) -> None:
        from ray.util.metrics import Counter, Gauge

        logging.basicConfig(level=logging.INFO)
        self.tick_s = tick_s
        self._level_gauge = Gauge("brownout_level", "Current degradation level (0-3)")
        self._feature_gauge = Gauge("brownout_feature_enabled", "1 if the feature runs at the current level",
                                    tag_keys=("feature",))
        self._transitions = Counter("brownout_level_transitions_total", "Level changes",
                                    tag_keys=("direction", "reason"))
        initial = parse_policy(config) if config else default_policy()
        self.core = PolicyCore(initial, persist=_kv_put, restore=_kv_get, on_transition=self._count)
        self._task: asyncio.Task[None] | None = None

    def _count(self, transition: Transition) -> None:
        direction = "up" if transition.to_level > transition.from_level else "down"
        self._transitions.inc(tags={"direction": direction, "reason": transition.reason.kind})

    async def _loop(self) -> None:
        while True:
            try:
                self.core.tick()
                view = self.core.view()
                self._level_gauge.set(int(view.level))
                for feature in REGISTRY:
                    self._feature_gauge.set(1 if feature in view.enabled else 0, tags={"feature": feature})
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad tick
                logger.exception("policy tick failed")
            await asyncio.sleep(self.tick_s)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def report(self, source: str, signals: dict[str, float], stale: list[str] | None = None) -> bool:
        self._ensure_loop()
        return self.core.report(source, signals, stale or ())

    async def view(self) -> PolicyView:
        self._ensure_loop()
        return self.core.view()

    async def get_state(self) -> dict[str, Any]:
        self._ensure_loop()
        return self.core.get_state()

    async def set_override(self, level: int | None = None, feature: str | None = None,
                           enabled: bool | None = None, ttl_s: float | None = None, note: str = "") -> dict[str, Any]:
        return self.core.set_override(level=level, feature=feature, enabled=enabled, ttl_s=ttl_s, note=note)

    async def clear_override(self, level: bool = False, feature: str | None = None) -> dict[str, Any]:
        return self.core.clear_override(level=level, feature=feature)

    async def update_config(self, document: dict[str, Any], batch_slots: int | None = None,
                            origin: str = "operator") -> dict[str, Any]:
        """See `PolicyCore.update_config`: an operator's call always applies; a deployed
        document (``origin="deploy"``) only when it changed since the last deploy."""
        return self.core.update_config(document, batch_slots, origin)

    async def get_config(self) -> dict[str, Any]:
        return {"config": self.core.config.model_dump(mode="json"), "config_version": self.core.config_version,
                "origin": self.core.config_origin}

    async def history(self, n: int = 100) -> list[dict[str, Any]]:
        return self.core.history(n)


def get_or_create_policy_actor(config: Mapping[str, Any] | None = None) -> Any:
    """The shared actor handle, creating it (detached) if no replica has yet."""
    handle = PolicyActor.options(  # type: ignore[attr-defined]
        name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, lifetime="detached", get_if_exists=True,
    ).remote(dict(config) if config else None)
    return handle


def get_policy_actor() -> Any:
    return ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
