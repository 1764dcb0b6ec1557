"""PolicyActor: the one Ray actor around the pure policy core, shared by every replica.

Name ``brownout-policy`` in namespace ``brownout`` (`ACTOR_NAME`, `ACTOR_NAMESPACE`), detached,
restarted by Ray without limit. Replicas obtain it with `get_or_create_policy_actor`; Serve
replicas run in namespace "serve", so the namespace is always passed explicitly.

Every replica reports its signals with ``report(source, signals)`` on a timer, to its node's
reporter (`deployments.node_reporter`), which sends the node's reports on with
``report_batch``; the actor keeps the latest report per source (`policies.signals.Aggregator`),
and every ``tick_s`` (250 ms) runs ``decide()``. Each level change is logged as one JSON line
and kept in a bounded history.

The control path is one tick long. A report whose values alone reach a trigger above the
policy level (`PolicyCore.may_escalate`) wakes the loop to decide at once (at most one early
tick per ``MIN_TICK_GAP_S``) instead of at the next tick. Readers (ingress replicas) follow the
view by long-poll, in the background, never per request: ``watch(seq)`` answers as soon as the
view's sequence number moves (a tick's decision, an operator's pin or override, a new policy)
and otherwise after its timeout, so a new level reaches every reader within one call's latency
of the decision rather than after three free-running timers (report, tick, poll).

The behaviour lives in `policies.service.PolicyCore` (no Ray); this module adds the tick loop,
Ray metrics and persistence in Ray's internal KV store.

Durability: the config, the operator overrides and the model's last outages are written to
Ray's internal KV store on every change and read back in ``__init__``, so an actor restarted by
Ray comes back with the same policy, the same pins and the same outage record. Signals and dwell timers are not restored: they rebuild from fresh
reports within ``stale_after_s``, and until then the restored level holds (fail-static).

Remote methods: ``report``, ``report_batch``, ``view``, ``watch``, ``get_state``, ``set_override``, ``clear_override``,
``update_config``, ``get_config``, ``history``, ``record_outage``, ``model_outages`` (the model's
outages as the ingress replicas saw them end, for their ``Retry-After`` while it is down).

Metrics (Ray's metrics export; Prometheus adds the ``ray_`` prefix; ``docs/OPERATIONS.md`` lists
them with their tags). Gauges are set every tick, counters grow by what each tick observed
(an operator's override or pin is accounted at once, in ``set_override``/``clear_override``):

- ``brownout_level``, ``brownout_policy_level`` (what the rules say, under a pin),
  ``brownout_level_pinned`` (1 while an operator pin holds);
- ``brownout_level_transitions_total{from,to,direction,reason}``;
- ``brownout_feature_enabled{feature}``, ``brownout_feature_disabled_seconds_total{feature}``,
  ``brownout_feature_turned_off_total{feature,cause}`` (cause: ``level`` or ``override``);
- ``brownout_signal{signal}`` (the aggregated value the policy decided on; a signal no fresh
  report carries is no longer updated, so read it with ``brownout_signal_stale``),
  ``brownout_signal_stale{signal}`` (1: stale, blocks recovery), ``brownout_stale_signals``
  (how many), ``brownout_policy_sources`` (replicas with a fresh report);
- ``brownout_signal_threshold{level,signal,bound}`` (bound ``trigger`` or ``recover``; NaN once
  for one a new policy dropped), and ``brownout_slo_ms{objective}``
  (``e2e_p99`` and, where set, ``ttft_p99``: what latency panels draw as the line to stay under);
- ``brownout_policy_tick_ms`` (histogram: one tick's ``decide()`` and bookkeeping),
  ``brownout_policy_tick_errors_total``;
- ``brownout_report_errors_total{reason}``: reports the actor rejected (``rejected``: unknown
  signal or bad value) or that carried a signal its replica failed to read (``failed_read``).
  Reports that never reached the actor are counted by the sender (`deployments.reporting`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import ray

from policies.autoscale import PolicyLoad
from policies.config import SIGNALS, default_policy, parse_policy
from policies.controller import Transition
from policies.features import REGISTRY, PolicyView
from policies.service import PolicyCore, threshold_table

ACTOR_NAME = "brownout-policy"
ACTOR_NAMESPACE = "brownout"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's resource that only the head node has
# brownout_policy_tick_ms buckets: a tick is well under a millisecond at rest; 250 ms is the tick
# a report that may escalate wakes the tick loop early, at most once per this many seconds
MIN_TICK_GAP_S = 0.02
TICK_MS_BOUNDARIES = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0]
KV_KEY = b"brownout-policy/persisted"
KV_NAMESPACE = "brownout"

logger = logging.getLogger("brownout.policy")


def _kv_put(value: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(KV_KEY, value, overwrite=True, namespace=KV_NAMESPACE)


def _kv_get() -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(KV_KEY, namespace=KV_NAMESPACE)


class PolicyMetrics:
    """The actor's Ray metrics (see the module docstring), fed from `PolicyCore` after each tick."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.level = Gauge("brownout_level", "Current degradation level (0-3)")
        self.policy_level = Gauge("brownout_policy_level", "The level the rules decided (the level unless pinned)")
        self.pinned = Gauge("brownout_level_pinned", "1 while an operator's level pin holds")
        self.enabled = Gauge("brownout_feature_enabled", "1 if the feature runs at the current level",
                             tag_keys=("feature",))
        self.transitions = Counter("brownout_level_transitions_total", "Level changes",
                                   tag_keys=("from", "to", "direction", "reason"))
        self.disabled_s = Counter("brownout_feature_disabled_seconds_total",
                                  "Seconds an optional feature was off", tag_keys=("feature",))
        self.turned_off = Counter("brownout_feature_turned_off_total",
                                  "Times an optional feature was turned off, by the level or an override",
                                  tag_keys=("feature", "cause"))
        self.signal = Gauge("brownout_signal", "A load signal as the policy last aggregated it",
                            tag_keys=("signal",))
        self.signal_stale = Gauge("brownout_signal_stale", "1 if the signal is stale (it blocks recovery)",
                                  tag_keys=("signal",))
        self.stale_count = Gauge("brownout_stale_signals", "How many signals are stale")
        self.sources = Gauge("brownout_policy_sources", "Replicas whose latest report is fresh")
        self.threshold = Gauge("brownout_signal_threshold", "A level's trigger or recover value for a signal",
                               tag_keys=("level", "signal", "bound"))
        self.slo_ms = Gauge("brownout_slo_ms", "The policy's latency objective (NaN: none)",
                            tag_keys=("objective",))
        self.tick_ms = Histogram("brownout_policy_tick_ms", "Duration of one policy tick (ms)",
                                 boundaries=TICK_MS_BOUNDARIES)
        self.tick_errors = Counter("brownout_policy_tick_errors_total", "Policy ticks that raised")
        self.report_errors = Counter("brownout_report_errors_total",
                                     "Reports rejected, or carrying a signal the replica failed to read",
                                     tag_keys=("reason",))
        self._config_version: int | None = None
        self._thresholds: set[tuple[str, str, str]] = set()
        self._policy_points: list[tuple[float, dict[str, str]]] = []
        self._slo_points: list[tuple[str, float]] = []

    def transition(self, transition: Transition) -> None:
        direction = "up" if transition.to_level > transition.from_level else "down"
        self.transitions.inc(tags={"from": str(int(transition.from_level)), "to": str(int(transition.to_level)),
                                   "direction": direction, "reason": transition.reason.kind})

    def report(self, ok: bool, failed_read: bool) -> None:
        if not ok:
            self.report_errors.inc(tags={"reason": "rejected"})
        elif failed_read:
            self.report_errors.inc(tags={"reason": "failed_read"})

    def account(self, core: PolicyCore) -> None:
        """Add what the core's `FeatureClock` counted since the last call (ticks and operator
        changes alike) to the counters. Turn-offs first: a failure on one second-count must not
        lose an edge."""
        added, edges = core.take_accounting()
        for feature, cause in edges:
            self.turned_off.inc(tags={"feature": feature, "cause": cause})
        for feature, seconds in added.items():
            if seconds > 0:
                self.disabled_s.inc(seconds, tags={"feature": feature})

    def tick_failed(self) -> None:
        self.tick_errors.inc()

    def tick(self, core: PolicyCore, tick_ms: float) -> None:
        view = core.view()
        self.level.set(int(view.level))
        self.policy_level.set(int(core.state.policy_level))
        self.pinned.set(1 if core.state.pin is not None else 0)
        for feature in REGISTRY:
            self.enabled.set(1 if feature in view.enabled else 0, tags={"feature": feature})
        self.account(core)
        signals = core.signals
        for name, value in signals.values.items():
            self.signal.set(float(value), tags={"signal": name})
        for name in SIGNALS:
            self.signal_stale.set(1 if name in signals.stale else 0, tags={"signal": name})
        self.stale_count.set(len(signals.stale))
        self.sources.set(signals.sources)
        if core.config_version != self._config_version:
            self._policy_changed(core)
        # Set every tick, like the other gauges: a gauge recorded once (at the actor's start, or
        # at a policy change) was not on the metrics endpoint later (seen in the integration test).
        for value, tags in self._policy_points:
            self.threshold.set(value, tags=tags)
        for objective, value in self._slo_points:
            self.slo_ms.set(value, tags={"objective": objective})
        self.tick_ms.observe(tick_ms)

    def _policy_changed(self, core: PolicyCore) -> None:
        """On a policy change: the (level, signal, bound) thresholds and the SLO to export. One a
        new policy dropped reads NaN once (Prometheus' "no value": a line at 0 would read as a
        threshold always crossed), then is no longer set."""
        self._config_version = core.config_version  # once per version, even if a set fails
        points: list[tuple[float, dict[str, str]]] = []
        for signal, levels in threshold_table(core.config).items():
            for level, bounds in levels.items():
                for bound, value in bounds.items():
                    points.append((value, {"level": level, "signal": signal, "bound": bound}))
        seen = {(t["level"], t["signal"], t["bound"]) for _, t in points}
        for level, signal, bound in self._thresholds - seen:
            self.threshold.set(math.nan, tags={"level": level, "signal": signal, "bound": bound})
        self._thresholds = seen
        self._policy_points = points
        slo = core.config.slo
        ttft = None if slo is None else slo.ttft_p99_ms
        self._slo_points = [("e2e_p99", math.nan if slo is None else slo.e2e_p99_ms),
                            ("ttft_p99", math.nan if ttft is None else ttft)]


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class PolicyActor:
    """The Ray actor: a `PolicyCore`, a tick loop and Ray metrics. See the module docstring."""

    def __init__(self, config: Mapping[str, Any] | None = None, tick_s: float = 0.25) -> None:
        logging.basicConfig(level=logging.INFO)
        self.tick_s = tick_s
        self.metrics = PolicyMetrics()
        initial = parse_policy(config) if config else default_policy()
        self.core = PolicyCore(initial, persist=_kv_put, restore=_kv_get, on_transition=self.metrics.transition)
        self._task: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None  # set (and replaced) whenever the view changes
        self._wake: asyncio.Event | None = None  # a report that may escalate: tick now
        self.early_ticks = 0

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            started = time.perf_counter()
            try:
                self.core.tick()
                self.metrics.tick(self.core, (time.perf_counter() - started) * 1000.0)
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad tick
                self.metrics.tick_failed()
                logger.exception("policy tick failed")
            self._published()
            # the next tick after tick_s, or sooner when a report may escalate (at most one
            # early tick per MIN_TICK_GAP_S, so a storm of hot reports costs few ticks)
            await asyncio.sleep(MIN_TICK_GAP_S)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, self.tick_s - MIN_TICK_GAP_S))
                self.early_ticks += 1
            except asyncio.TimeoutError:
                pass

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._changed = self._changed or asyncio.Event()
            self._wake = self._wake or asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def _published(self) -> None:
        """Wake every reader waiting in `watch` if the view changed."""
        if self.core.publish() and self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def _reported(self, ok: bool, signals: Mapping[str, float], stale: list[str] | None) -> bool:
        self.metrics.report(ok, bool(stale))
        if ok and self._wake is not None and self.core.may_escalate(signals):
            self._wake.set()
        return ok

    async def report(self, source: str, signals: dict[str, float], stale: list[str] | None = None) -> bool:
        self._ensure_loop()
        return self._reported(self.core.report(source, signals, stale or ()), signals, stale)

    async def report_batch(self, batch: list[tuple[str, dict[str, float], list[str]]]) -> dict[str, Any]:
        """Many replicas' reports in one call (a node's `deployments.reporting.ReportBatcher`),
        each kept under its own source. Returns ``kept`` (how many were) and ``escalate_at``
        (`PolicyCore.escalation_floor`: values at which a report may raise the level, which
        the batcher then sends at once)."""
        self._ensure_loop()
        kept = 0
        for source, signals, stale in batch:
            kept += self._reported(self.core.report(source, signals, stale or ()), signals, stale)
        return {"kept": kept, "escalate_at": dict(self.core.escalation_floor())}

    async def view(self) -> PolicyView:
        self._ensure_loop()
        return self.core.view()

    async def watch(self, seq: int, timeout_s: float = 5.0) -> tuple[int, PolicyView]:
        """Long-poll: ``(view_seq, view)`` as soon as ``view_seq`` differs from ``seq`` (at once if
        it already does), else after ``timeout_s`` (at most 30 s) with the view unchanged. A
        reader passes back the seq it got, so a change reaches it within one tick of the
        decision, instead of after its own poll interval. A restarted actor counts from 1 again:
        any seq not its own is answered at once."""
        self._ensure_loop()
        assert self._changed is not None
        if self.core.view_seq == seq:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), min(max(float(timeout_s), 0.0), 30.0))
            except asyncio.TimeoutError:
                pass
        return self.core.view_seq, self.core.view()

    async def load(self) -> PolicyLoad:
        """The level in force and the refused share, for the model's autoscaling policy
        (`deployments.autoscaling`, in the Serve controller)."""
        self._ensure_loop()
        return self.core.load()

    async def get_state(self) -> dict[str, Any]:
        self._ensure_loop()
        return self.core.get_state()

    async def set_override(self, level: int | None = None, feature: str | None = None,
                           enabled: bool | None = None, ttl_s: float | None = None, note: str = "") -> dict[str, Any]:
        self._ensure_loop()
        result = self.core.set_override(level=level, feature=feature, enabled=enabled, ttl_s=ttl_s, note=note)
        self.metrics.account(self.core)  # an override's turn-off is counted now, not at the next tick
        self._published()
        return result

    async def clear_override(self, level: bool = False, feature: str | None = None) -> dict[str, Any]:
        self._ensure_loop()
        result = self.core.clear_override(level=level, feature=feature)
        self.metrics.account(self.core)
        self._published()
        return result

    async def update_config(self, document: dict[str, Any], batch_slots: int | None = None,
                            origin: str = "operator") -> dict[str, Any]:
        """See `PolicyCore.update_config`: an operator's call always applies; a deployed
        document (``origin="deploy"``) only when it changed since the last deploy."""
        self._ensure_loop()
        result = self.core.update_config(document, batch_slots, origin)
        self._published()
        return result

    async def get_config(self) -> dict[str, Any]:
        return {"config": self.core.config.model_dump(mode="json"), "config_version": self.core.config_version,
                "origin": self.core.config_origin}

    async def history(self, n: int = 100) -> list[dict[str, Any]]:
        return self.core.history(n)

    async def record_outage(self, ended_at: float, duration_s: float) -> list[float]:
        """An ingress replica saw the model down for ``duration_s`` until ``ended_at``: kept
        (`PolicyCore.record_outage`, persisted); returns the outages' durations, oldest first."""
        return self.core.record_outage(ended_at, duration_s)

    async def model_outages(self) -> list[float]:
        """The durations of the model's last outages, oldest first (`PolicyCore.model_outages`)."""
        return self.core.model_outages()


def get_or_create_policy_actor(config: Mapping[str, Any] | None = None) -> Any:
    """The shared actor handle, creating it (detached) if no replica has yet."""
    handle = PolicyActor.options(  # type: ignore[attr-defined]
        name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, lifetime="detached", get_if_exists=True,
        # On the head node, wherever the replica that creates it runs: the head lives as long
        # as the cluster, a worker node (a GPU node scaled away, a spot instance) may not.
        resources={HEAD_RESOURCE: 0.001},
    ).remote(dict(config) if config else None)
    return handle


def get_policy_actor() -> Any:
    return ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
