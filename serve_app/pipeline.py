"""The ingress pipeline: optional stages around the core model call, gated by the level.

It walks the features it is given (`deployments.enrichments.registry.features()`, in registry
order) and never names one; each `Feature` says what it sends, how its result is applied and
what its bypass means. By stage:

- pre (before the model): the enabled ones read the client's own request, so they are called
  concurrently; their results are applied in registry order, so the outcome is the same as
  running them one by one.
- post (on a whole answer; a stream is sent as generated).
- side effects (after the response is sent), never on the client's critical path.

Calls are grouped by where the feature runs (`Worker.host`): everything one request phase sends
to one deployment goes in ONE handle call (``call_many``), and features that run in the ingress
process cost no handle call at all. `handle_calls` counts the handle calls per deployment.

Each feature has a circuit breaker (`serve_app.breaker`): after several failures in a row its
stage is bypassed at once, with no call and no timeout to wait out, until probes find it well
again (outcome ``circuit_open``).

A disabled stage is not called at all; its off-mode says what happens instead: ``skip`` (the
stage's effect is absent, and its ``on_bypass`` runs), ``default`` (the configured result is
applied as if the stage had returned it), ``defer`` (the record is appended to a durable spool
and written out, in order, once the level allows). A called stage that fails or exceeds its
timeout is bypassed for that request and counted; the core answer still goes out.

The level is a `PolicyView` the ingress refreshes in the background; the pipeline never calls
the policy actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from deployments.enrichments.base import Outcome
from deployments.enrichments.feature import Feature, RequestState
from deployments.enrichments.spool import DurableSpool
from policies.features import OffMode, Stage
from serve_app.breaker import Breaker, BreakerSettings

logger = logging.getLogger("ray.serve")

# One batch of stage calls to one place: (host, [(feature, payload), ...]) -> one outcome per
# call. ``host`` None means the ingress process itself. The ingress binds it to its handles.
BatchCall = Callable[[str | None, list[tuple[str, dict[str, Any]]]], Awaitable[list[Outcome]]]


class Pipeline:
    """Runs the optional stages for the ingress. Plain logic: the batch caller and spool injected."""

    def __init__(
        self,
        features: Sequence[Feature],
        call: BatchCall,
        spool_for: Callable[[str], DurableSpool] | None,
        timeouts_s: Mapping[str, float] | None = None,
        default_timeout_s: float = 1.0,
        settings: Mapping[str, Mapping[str, Any]] | None = None,
        on_outcome: Callable[[str, str], None] | None = None,
        breaker: BreakerSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.features = tuple(features)
        self.by_name = {f.name: f for f in self.features}
        self._stage = {s: [f for f in self.features if f.stage is s] for s in Stage}
        self._call = call
        # (feature, "bypassed" | "failed" | "deferred"): a metrics hook, so an operator sees how
        # often each feature is degraded (and may reconsider one degraded too often)
        self._on_outcome = on_outcome or (lambda feature, outcome: None)
        self._settings = {k: dict(v) for k, v in (settings or {}).items()}  # worker kind -> settings
        self._spool_for = spool_for
        self.spools: dict[str, DurableSpool] = {}
        self.timeouts_s = dict(timeouts_s or {})
        self.default_timeout_s = default_timeout_s
        self.calls: Counter[str] = Counter()
        self.handle_calls: Counter[str] = Counter()
        self.bypassed: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.deferred: Counter[str] = Counter()
        self._background: set[asyncio.Task[Any]] = set()
        self._drain_locks: dict[str, asyncio.Lock] = {}
        self.clock = clock
        settings_b = breaker or BreakerSettings()
        self.breakers = {f.name: Breaker(settings_b) for f in self.features}

    # -- stage calls ---------------------------------------------------------------------------

    async def _batch(self, host: str | None, batch: list[tuple[Feature, dict[str, Any]]]) -> list[dict[str, Any] | None]:
        """One call to ``host`` for ``batch``; a result per stage, None (counted) where it failed."""
        names = [f.name for f, _ in batch]
        self.calls.update(names)
        if host is not None:
            self.handle_calls[host] += 1
        timeout_s = max(self.timeouts_s.get(n, self.default_timeout_s) for n in names)
        try:
            outcomes = await asyncio.wait_for(self._call(host, [(n, p) for n, (_, p) in zip(names, batch)]),
                                              timeout=timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a failed optional stage never fails the request
            outcomes = [Outcome(error=type(err).__name__)] * len(batch)  # logged: no request text
        results: list[dict[str, Any] | None] = []
        now = self.clock()
        for name, outcome in zip(names, outcomes):
            self.breakers[name].record(outcome.error is None, now)
            if outcome.error is not None:
                self.failures[name] += 1
                self._on_outcome(name, "failed")
                logger.warning("stage %s bypassed for this request: %s", name, outcome.error)
            results.append(outcome.result if outcome.error is None else None)
        return results

    async def _run(self, calls: list[tuple[Feature, dict[str, Any]]]) -> dict[str, dict[str, Any] | None]:
        """Run ``calls`` concurrently, one batch per host; feature name -> result (None: failed)."""
        by_host: dict[str | None, list[tuple[Feature, dict[str, Any]]]] = {}
        refused: dict[str, dict[str, Any] | None] = {}
        now = self.clock()
        for feature, payload in calls:
            if not self.breakers[feature.name].allow(now):
                refused[feature.name] = None  # bypassed at once, as a failure would be
                self.failures[feature.name] += 1
                self._on_outcome(feature.name, "circuit_open")
                continue
            by_host.setdefault(feature.host, []).append((feature, payload))
        hosts = list(by_host)
        results = await asyncio.gather(*(self._batch(h, by_host[h]) for h in hosts))
        return {**refused, **{f.name: r for h, rs in zip(hosts, results) for (f, _), r in zip(by_host[h], rs)}}

    def _skip(self, ctx: RequestState, feature: Feature) -> None:
        self.bypassed[feature.name] += 1
        self._on_outcome(feature.name, "bypassed")
        ctx.bypassed.append(feature.name)

    def _settings_of(self, feature: Feature) -> Mapping[str, Any]:
        return self._settings.get(feature.worker.kind, {})

    async def _transform(self, ctx: RequestState, stage: Stage) -> None:
        """Run a pre or post stage's features; apply results, defaults and bypasses in order."""
        features = self._stage[stage]
        on = [f for f in features if f.name in ctx.view.enabled]
        results = await self._run([(f, f.payload(ctx)) for f in on])
        for f in features:
            if f.name in results:
                result = results[f.name]
                if result is None:
                    ctx.failed.append(f.name)
                    f.on_bypass(ctx, self._settings_of(f))
                else:
                    f.apply(ctx, result)
                continue
            self._skip(ctx, f)
            default = ctx.view.defaults.get(f.name)
            if ctx.view.mode(f.name) is OffMode.DEFAULT and isinstance(default, Mapping):
                f.apply(ctx, default)
            else:
                f.on_bypass(ctx, self._settings_of(f))

    async def pre(self, ctx: RequestState) -> None:
        await self._transform(ctx, Stage.PRE)

    async def post(self, ctx: RequestState) -> None:
        """Post stages on ``ctx.text`` (a whole answer)."""
        await self._transform(ctx, Stage.POST)

    # -- side effects --------------------------------------------------------------------------

    def plan_side_effects(self, ctx: RequestState) -> None:
        """Decide, before the response goes out, which side effects run (for the headers)."""
        for f in self._stage[Stage.SIDE_EFFECT]:
            if f.name in ctx.view.enabled:
                continue
            if ctx.view.mode(f.name) is OffMode.DEFER and self._spool_for is not None:
                ctx.deferred.append(f.name)
            else:
                self._skip(ctx, f)

    def side_effects(self, ctx: RequestState, record: dict[str, Any]) -> None:
        """Run the planned side effects in the background: the response is already out."""
        task = asyncio.get_running_loop().create_task(self._side_effects(ctx, record))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _deferrable(self, ctx: RequestState, feature: Feature) -> bool:
        return self._spool_for is not None and (ctx.view.mode(feature.name) is OffMode.DEFER
                                                or feature.name in self.spools)

    async def _side_effects(self, ctx: RequestState, record: dict[str, Any]) -> None:
        direct: list[tuple[Feature, dict[str, Any]]] = []
        behind: list[Feature] = []
        for f in self._stage[Stage.SIDE_EFFECT]:
            if f.name in ctx.deferred:
                await self._defer(f.name, record)
            elif f.name in ctx.view.enabled and f.wants(ctx):
                if self._deferrable(ctx, f) and self.pending(f.name) > 0:
                    behind.append(f)  # older deferred records wait: this one queues behind them
                else:
                    direct.append((f, {"records": [record]}))
        for f in behind:
            await self._defer(f.name, record)
        results = await self._run(direct)
        for f, _ in direct:
            if results[f.name] is None and self._deferrable(ctx, f):
                await self._defer(f.name, record)  # unreachable stage: keep a record that must not be lost
        await asyncio.gather(*(self.drain(f.name) for f in behind))

    def spool(self, feature: str) -> DurableSpool:
        assert self._spool_for is not None
        if feature not in self.spools:
            self.spools[feature] = self._spool_for(feature)
        return self.spools[feature]

    def pending(self, feature: str) -> int:
        return self.spool(feature).pending() if self._spool_for is not None else 0

    def deferrable(self, view_modes: Mapping[str, OffMode]) -> list[str]:
        """Features that may have spooled records: deferred now, or spooled before."""
        names = {n for n, m in view_modes.items() if m is OffMode.DEFER and n in self.by_name}
        return sorted(names | set(self.spools))

    async def _defer(self, feature: str, record: dict[str, Any]) -> None:
        await asyncio.to_thread(self.spool(feature).append, record)
        self.deferred[feature] += 1
        self._on_outcome(feature, "deferred")

    async def drain(self, feature: str, batch: int = 256) -> int:
        """Write a feature's spooled records out, in order, a batch per handle call (call only
        when it is enabled)."""
        if self._spool_for is None or self.pending(feature) == 0:
            return 0
        lock = self._drain_locks.setdefault(feature, asyncio.Lock())
        f = self.by_name[feature]
        async with lock:
            async def sink(records: list[dict[str, Any]]) -> None:
                if not self.breakers[feature].allow(self.clock()):
                    raise RuntimeError(f"{feature}: circuit open; records stay spooled")
                (result,) = await self._batch(f.host, [(f, {"records": records})])
                if result is None:
                    raise RuntimeError(f"{feature} unavailable; records stay spooled")

            return await self.spool(feature).drain(batch, sink)

    async def wait_idle(self) -> None:
        """Wait for background side effects (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def counters(self) -> dict[str, dict[str, Any]]:
        return {"calls": dict(self.calls), "handle_calls": dict(self.handle_calls),
                "bypassed": dict(self.bypassed), "failures": dict(self.failures),
                "deferred": dict(self.deferred),
                "spool_pending": {f: sp.pending() for f, sp in self.spools.items()},
                "circuits": {name: b.snapshot() for name, b in self.breakers.items()}}
