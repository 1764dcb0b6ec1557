"""The ingress pipeline: optional stages around the core model call, gated by the level.

It walks the features it is given (`deployments.enrichments.registry.features()`, in registry
order) and never names one; each `Feature` says what it sends, how its result is applied and
what its bypass means. By stage:

- pre (before the model): the enabled ones read the client's own request, so they are called
  concurrently; their results are applied in registry order, so the outcome is the same as
  running them one by one.
- post (on a whole answer; a stream is sent as generated).
- side effects: on the finished request's record, never on the client's critical path
  except for the one fsync that makes a deferral durable (below).

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

Durable before promised. Nothing names a record as deferred (``X-Brownout-Deferred``, a stream's
notice) before it is appended and fsync'd:

- `decide_side_effects` (before any header) discloses the skipped side effects and notes the
  deferred ones in ``ctx.planned``; it promises nothing.
- `settle` (awaited) appends the planned records (group commit: concurrent requests share one
  fsync), and only then lists them in ``ctx.deferred``, and returns them. A non-streamed response
  awaits it before its headers are built, so its ``X-Brownout-Deferred`` names only records on
  disk. A stream's headers are sent first, so they never carry ``X-Brownout-Deferred``: the
  ingress awaits `settle` at the end of the stream and names the durable deferrals in the
  stream's final event, before ``[DONE]``. A record that cannot be spooled (``spool_full``, a
  write error) is not promised: it is listed as bypassed (when headers are still to come) and
  counted in ``not_spooled``.

Exactly once. A request's record goes to its side effects once (``ctx.settled``): `settle` for a
whole answer, `settle_outcome` / `abandon` for a request that reached the model but ``failed``,
was ``client_dropped`` mid-stream, or was ``refused`` (with its status) - whichever comes first.
Only side effects that take failures (``Feature.audits_failures``: the audit log) get those.
Every record carries a ``record_id`` (request id + feature), so a batch re-sent after a time-out
(the remote call is not cancelled by it) or redelivered by a spool is dropped by the audit log.

Records are made JSON-safe before they go anywhere (`deployments.enrichments.spool.sanitize`):
a value JSON cannot hold is escaped and counted (``escaped``), never raised into a task. A
side-effect task that still fails is logged by type and counted (``task_errors``).

Bounded. At most ``max_background`` side-effect tasks are outstanding. When full, `settle` makes
deferrable records durable inline (the request waits for one group commit: backpressure) and
sheds the others, counted (``shed``).

Spools: one per feature and replica, owned through a file lock (`DurableSpool`); `drain` first
adopts orphaned spools of the feature (a replica that was scaled down, crashed or renumbered)
every ``adopt_every_s``; they drain before the replica's own records. Spools are opened and
recovered in worker threads (`open_spool`), never on the event loop.

The level is a `PolicyView` the ingress refreshes in the background; the pipeline never calls
the policy actor.

Accounting (issue 13). Every stage call is timed as the ingress sees it (send to answer, one
handle call; features sent together share its time) and added, with the CPU time the worker
measured (``Outcome.cpu_s``) and whether it failed, to ``cost`` (`policies.feature_cost.
FeatureCost`: since start and over the last 5 minutes). Every stage not run for a request is
counted by cause (``bypassed_by``; the ``on_bypass(feature, cause)`` hook exports it):

- ``level``: the level's rule turns the feature off; ``override``: an operator forced it off
  while the level allows it (told apart with the policy's ``off_levels``, which the ingress
  sets; without them every disabled stage counts as ``level``);
- ``error``: the call failed; ``timeout``: it exceeded its stage timeout (here, or the
  worker's own);
- ``breaker``: its circuit was open, so no call was made.

A deferred side effect is not bypassed (its record waits in the spool): it is counted as
``deferred`` only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from deployments.enrichments.base import Outcome
from deployments.enrichments.feature import OUTCOMES, Feature, RequestState, record_id
from deployments.enrichments.spool import DurableSpool, SpoolFull, Unencodable, sanitize
from policies import features as feat
from policies.feature_cost import FeatureCost
from policies.features import OffMode, PolicyView, Stage
from serve_app.breaker import Breaker, BreakerSettings

logger = logging.getLogger("ray.serve")

BYPASS_CAUSES = ("level", "override", "error", "timeout", "breaker")

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
        max_background: int = 512,
        adopt_every_s: float = 5.0,
        on_bypass: Callable[[str, str], None] | None = None,
    ) -> None:
        if max_background < 1:
            raise ValueError(f"max_background must be >= 1, got {max_background!r}")
        self.features = tuple(features)
        self.by_name = {f.name: f for f in self.features}
        self._stage = {s: [f for f in self.features if f.stage is s] for s in Stage}
        self._call = call
        # (feature, "bypassed" | "failed" | "deferred"): a metrics hook, so an operator sees how
        # often each feature is degraded (and may reconsider one degraded too often)
        self._on_outcome = on_outcome or (lambda feature, outcome: None)
        # (feature, cause in BYPASS_CAUSES): a stage not run for a request, by why (module docstring)
        self._on_bypass = on_bypass or (lambda feature, cause: None)
        self.bypassed_by: Counter[tuple[str, str]] = Counter()
        # the policy's off level per feature (the ingress sets it): tells level from override
        self.off_levels: Mapping[str, int | None] | None = None
        self.cost = FeatureCost()
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
        self.max_background = max_background
        self.adopt_every_s = adopt_every_s
        self._adopted_at: dict[str, float] = {}
        self._drain_locks: dict[str, asyncio.Lock] = {}
        self._open_locks: dict[str, asyncio.Lock] = {}
        self._recovering: set[str] = set()
        self.audited: Counter[str] = Counter()  # records settled, by outcome
        self.not_spooled: Counter[str] = Counter()  # "feature:reason": spool_full, rejected:..., spool_error
        self.shed: Counter[str] = Counter()  # side effects not run: background tasks at their cap
        self.escaped: Counter[str] = Counter()  # values a record could not hold as they were
        self.task_errors: Counter[str] = Counter()
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
        started = self.clock()
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
            ok = outcome.error is None
            self.breakers[name].record(ok, now)
            self.cost.record(name, now, now - started, outcome.cpu_s if ok else None, ok)
            if not ok:
                self.failures[name] += 1
                self._on_outcome(name, "failed")
                self._bypass(name, "timeout" if outcome.error == "TimeoutError" else "error")
                logger.warning("stage %s bypassed for this request: %s", name, outcome.error)
            results.append(outcome.result if ok else None)
        return results

    def _bypass(self, feature: str, cause: str) -> None:
        self.bypassed_by[(feature, cause)] += 1
        self._on_bypass(feature, cause)

    def off_cause(self, view: PolicyView, feature: str) -> str:
        """Why ``feature`` is off in ``view``: ``override`` if the level alone would run it (an
        operator forced it off), else ``level``."""
        try:
            if self.off_levels is not None and feat.enabled(feature, view.level, self.off_levels, None):
                return "override"
        except KeyError:  # a feature the registry does not know: its level's, as without a policy
            pass
        return "level"

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
                self._bypass(feature.name, "breaker")
                continue
            by_host.setdefault(feature.host, []).append((feature, payload))
        hosts = list(by_host)
        results = await asyncio.gather(*(self._batch(h, by_host[h]) for h in hosts))
        return {**refused, **{f.name: r for h, rs in zip(hosts, results) for (f, _), r in zip(by_host[h], rs)}}

    def _skip(self, ctx: RequestState, feature: Feature) -> None:
        self.bypassed[feature.name] += 1
        self._on_outcome(feature.name, "bypassed")
        self._bypass(feature.name, self.off_cause(ctx.view, feature.name))
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

    def _side_features(self, outcome: str) -> list[Feature]:
        side = self._stage[Stage.SIDE_EFFECT]
        return side if outcome == "ok" else [f for f in side if f.audits_failures]

    def decide_side_effects(self, ctx: RequestState) -> None:
        """Before any header goes out: count and disclose the side effects the level skips, and
        note (``ctx.planned``) those it defers. Promises nothing: `settle` names a deferral
        (``ctx.deferred``, the ``X-Brownout-Deferred`` header) only once its record is on disk.
        Idempotent."""
        if ctx.side_decided:
            return
        ctx.side_decided = True
        for f in self._side_features(ctx.outcome):
            if f.name in ctx.view.enabled:
                continue
            if ctx.view.mode(f.name) is OffMode.DEFER and self._spool_for is not None:
                ctx.planned.append(f.name)
            else:
                self._skip(ctx, f)

    async def settle(self, ctx: RequestState, record: Mapping[str, Any]) -> list[str]:
        """Hand a finished request's record to its side effects, exactly once per request.

        Deferred records are appended and fsync'd (group commit) before this returns, and only
        then named in ``ctx.deferred``; the names are returned (for a stream's final chunk). The
        direct calls run in the background (bounded: `max_background`). Await it BEFORE building
        a non-streamed response, so its headers name only durable deferrals.
        """
        if ctx.settled:
            return []
        ctx.settled = True
        self.decide_side_effects(ctx)
        outcome = str(record.get("outcome", ctx.outcome))
        self.audited[outcome] += 1
        durable: list[str] = []
        direct: list[tuple[Feature, dict[str, Any]]] = []
        behind: list[tuple[Feature, dict[str, Any]]] = []
        for f in self._side_features(outcome):
            if f.name in ctx.planned:
                if await self._commit(f.name, self._prepare(f, record)):
                    durable.append(f.name)
                    if f.name not in ctx.deferred:
                        ctx.deferred.append(f.name)
                elif f.name not in ctx.deferred:  # not promised: say it was not done
                    ctx.bypassed.append(f.name)
            elif f.name in ctx.view.enabled and (outcome != "ok" or f.wants(ctx)):
                rec = self._prepare(f, record)
                if self._deferrable(ctx, f) and self.pending(f.name) > 0:
                    behind.append((f, rec))  # older deferred records wait: this one queues behind them
                else:
                    direct.append((f, rec))
        for f, rec in behind:
            await self._commit(f.name, rec)
        if not direct and not behind:
            return durable
        if len(self._background) >= self.max_background:
            # Full: what may be deferred is made durable here (the caller waits for one group
            # commit: backpressure); the rest is shed, counted.
            for f, rec in direct:
                if self._deferrable(ctx, f):
                    await self._commit(f.name, rec)
                else:
                    self.shed[f.name] += 1
                    self._on_outcome(f.name, "shed")
            return durable
        self._spawn(self._run_direct(ctx, direct, [f for f, _ in behind]))
        return durable

    async def _run_direct(self, ctx: RequestState, direct: list[tuple[Feature, dict[str, Any]]],
                          behind: list[Feature]) -> None:
        results = await self._run([(f, {"records": [rec]}) for f, rec in direct])
        for f, rec in direct:
            if results[f.name] is None and self._deferrable(ctx, f):
                await self._commit(f.name, rec)  # unreachable stage: keep a record that must not be lost
        await asyncio.gather(*(self.drain(f.name) for f in behind))

    async def settle_outcome(self, ctx: RequestState, outcome: str, status: int | None = None,
                             finish: str | None = None, usage: Mapping[str, int] | None = None) -> list[str]:
        """Audit a request that did not end in a whole answer: ``failed`` (the model or the
        stream failed), ``client_dropped`` (the client went away), ``refused`` (with its HTTP
        ``status``). Only side effects that take failures (the audit log) get it; a no-op if the
        request was settled already, so whichever end comes first is the one recorded."""
        if outcome not in OUTCOMES or outcome == "ok":
            raise ValueError(f"outcome must be one of {OUTCOMES[1:]}, got {outcome!r}")
        if ctx.settled:
            return []
        ctx.outcome, ctx.status = outcome, status
        return await self.settle(ctx, ctx.record(finish, usage or {}))

    def abandon(self, ctx: RequestState, outcome: str, status: int | None = None) -> None:
        """`settle_outcome` from synchronous code (a stream's end callback, an error path):
        scheduled on the running loop, bounded like every side effect. When `max_background`
        tasks are outstanding, a feature with an open spool gets the record through its group
        commit (no task of its own); the others are shed, counted."""
        if ctx.settled:
            return
        if len(self._background) >= self.max_background:
            ctx.settled = True
            ctx.outcome, ctx.status = outcome, status
            record = ctx.record(None, {})
            for f in self._side_features(outcome):
                if f.name in self.spools and self._deferrable(ctx, f):
                    self._submit_nowait(f.name, self._prepare(f, record))  # the group commit: no task of its own
                else:
                    self.shed[f.name] += 1
                    self._on_outcome(f.name, "shed")
            return
        self._spawn(self.settle_outcome(ctx, outcome, status))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._guarded(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _guarded(self, coro: Awaitable[Any]) -> None:
        """A side-effect task never dies silently: whatever escapes is logged (type only) and counted."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001
            self.task_errors[type(err).__name__] += 1
            logger.error("side-effect task failed: %s", type(err).__name__)

    def _prepare(self, feature: Feature, record: Mapping[str, Any]) -> dict[str, Any]:
        """The record as ``feature`` receives it: JSON-safe (`sanitize`, escapes counted) and with
        its ``record_id``."""
        safe, escaped = sanitize(dict(record))
        if escaped:
            self.escaped[feature.name] += escaped
            self._on_outcome(feature.name, "escaped")
        safe["record_id"] = record_id(str(record.get("request_id", "")), feature.name)
        return safe

    def _deferrable(self, ctx: RequestState, feature: Feature) -> bool:
        return self._spool_for is not None and (ctx.view.mode(feature.name) is OffMode.DEFER
                                                or feature.name in self.spools)

    async def _commit(self, feature: str, record: dict[str, Any]) -> bool:
        """Append durably (group commit); False, counted with its reason, if it was not written."""
        try:
            spool = await self.open_spool(feature)
            await spool.commit(record)
        except Exception as err:  # noqa: BLE001 - counted by reason; the caller says "not done"
            self._not_spooled(feature, err)
            return False
        self.deferred[feature] += 1
        self._on_outcome(feature, "deferred")
        return True

    def _submit_nowait(self, feature: str, record: dict[str, Any]) -> None:
        try:
            fut = self.spools[feature].submit(record)
        except Exception as err:  # noqa: BLE001
            self._not_spooled(feature, err)
            return

        def done(f: asyncio.Future[None]) -> None:
            if f.cancelled() or f.exception() is not None:
                self._not_spooled(feature, f.exception() if not f.cancelled() else asyncio.CancelledError())
            else:
                self.deferred[feature] += 1
                self._on_outcome(feature, "deferred")

        fut.add_done_callback(done)

    def _not_spooled(self, feature: str, err: BaseException) -> None:
        reason = ("spool_full" if isinstance(err, SpoolFull)
                  else f"rejected:{err.reason}" if isinstance(err, Unencodable) else "spool_error")
        self.not_spooled[f"{feature}:{reason}"] += 1
        self._on_outcome(feature, reason.split(":")[0])
        logger.error("side effect %s: record not spooled (%s: %s)", feature, reason, type(err).__name__)

    def spool(self, feature: str) -> DurableSpool:
        """The feature's spool, opened here if needed. Opening only takes its lock; reading it
        (recovery) runs in a worker thread, started here when called on an event loop. Async
        code should await `open_spool` instead."""
        assert self._spool_for is not None
        if feature not in self.spools:
            self.spools[feature] = self._spool_for(feature)
        sp = self.spools[feature]
        if not sp.recovered:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                sp.recover()
            else:
                if feature not in self._recovering:
                    self._recovering.add(feature)
                    task = loop.create_task(self._guarded(asyncio.to_thread(sp.recover)))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
                    task.add_done_callback(lambda _: self._recovering.discard(feature))
        return sp

    async def open_spool(self, feature: str) -> DurableSpool:
        """The feature's spool, opened and recovered in worker threads (never on the event loop)."""
        assert self._spool_for is not None
        sp = self.spools.get(feature)
        if sp is None or not sp.recovered:
            lock = self._open_locks.setdefault(feature, asyncio.Lock())
            async with lock:
                sp = self.spools.get(feature)
                if sp is None:
                    sp = await asyncio.to_thread(self._spool_for, feature)
                    self.spools[feature] = sp
                if not sp.recovered:
                    await asyncio.to_thread(sp.recover)
        return sp

    def pending(self, feature: str) -> int:
        sp = self.spools.get(feature)
        return sp.pending() if sp is not None else 0

    def deferrable(self, view_modes: Mapping[str, OffMode]) -> list[str]:
        """Features that may have spooled records: deferred now, or spooled before."""
        names = {n for n, m in view_modes.items() if m is OffMode.DEFER and n in self.by_name}
        return sorted(names | set(self.spools))

    async def adopt_orphans(self, feature: str) -> int:
        """Take over the spools of ``feature`` that no live process holds (a replica scaled down,
        crashed or renumbered); they drain before this replica's own records."""
        if self._spool_for is None:
            return 0
        sp = await self.open_spool(feature)
        self._adopted_at[feature] = self.clock()
        return await asyncio.to_thread(sp.adopt_orphans, feature)

    async def drain(self, feature: str, batch: int = 256) -> int:
        """Write a feature's spooled records out, in order, a batch per handle call (call only
        when it is enabled). Looks for orphaned spools to adopt first, every `adopt_every_s`."""
        if self._spool_for is None:
            return 0
        if self.clock() - self._adopted_at.get(feature, float("-inf")) >= self.adopt_every_s:
            await self.adopt_orphans(feature)
        if self.pending(feature) == 0:
            return 0
        lock = self._drain_locks.setdefault(feature, asyncio.Lock())
        f = self.by_name[feature]
        async with lock:
            async def sink(records: list[dict[str, Any]]) -> None:
                if not self.breakers[feature].allow(self.clock()):
                    raise RuntimeError(f"{feature}: circuit open; records stay spooled")
                for r in records:  # spooled before records carried ids
                    if isinstance(r, dict) and "record_id" not in r and "request_id" in r:
                        r["record_id"] = record_id(str(r["request_id"]), feature)
                (result,) = await self._batch(f.host, [(f, {"records": records})])
                if result is None:
                    raise RuntimeError(f"{feature} unavailable; records stay spooled")

            return await self.spools[feature].drain(batch, sink)

    async def close(self) -> None:
        """Shutdown: wait for side effects, then release the spools (their locks: an adopter
        may take what is still pending)."""
        await self.wait_idle()
        for sp in self.spools.values():
            await asyncio.to_thread(sp.close)

    async def wait_idle(self) -> None:
        """Wait for background side effects (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def bypass_counts(self) -> dict[str, dict[str, int]]:
        """``{feature: {cause: n}}``: stages not run for a request, by cause, since start."""
        out: dict[str, dict[str, int]] = {}
        for (feature, cause), n in sorted(self.bypassed_by.items()):
            out.setdefault(feature, {})[cause] = n
        return out

    def costs(self) -> dict[str, dict[str, Any]]:
        """`FeatureCost.snapshot` now, every feature of this pipeline listed."""
        return self.cost.snapshot(self.clock(), [f.name for f in self.features])

    def counters(self) -> dict[str, dict[str, Any]]:
        return {"calls": dict(self.calls), "handle_calls": dict(self.handle_calls),
                "bypassed": dict(self.bypassed), "failures": dict(self.failures),
                "deferred": dict(self.deferred),
                "spool_pending": {f: sp.pending() for f, sp in self.spools.items()},
                "spools": {f: sp.stats() for f, sp in self.spools.items()},
                "audited": dict(self.audited), "not_spooled": dict(self.not_spooled),
                "shed": dict(self.shed), "escaped": dict(self.escaped), "task_errors": dict(self.task_errors),
                "bypassed_by_cause": self.bypass_counts(),
                "background": len(self._background), "max_background": self.max_background,
                "circuits": {name: b.snapshot() for name, b in self.breakers.items()}}
