"""The ingress pipeline: optional stages around the core model call, gated by the level.

Stages, in declared order:

- pre (before the model): ``prompt_rewrite``, ``personalization``, ``ab_test``,
  ``semantic_cache_lookup``. They read the client's own request, so the enabled ones are called
  concurrently; their results are applied in the declared order, so the outcome is the same as
  running them one by one.
- post (on the answer): ``response_polish`` (whole responses; a stream is sent as generated).
- side effects (after the response is sent): ``semantic_cache_write``, ``audit_log``,
  ``feature_stats``, ``debug_capture``, ``light_metrics``. Never on the client's critical path.

A disabled stage is not called at all; its off-mode says what happens instead: ``skip`` (the
stage's effect is absent), ``default`` (a configured value stands in), ``defer`` (the record is
appended to a durable spool and written out, in order, once the level allows). A called stage
that fails or exceeds its timeout is bypassed for that request and counted; the core answer
still goes out. A bypassed A/B stage puts the request in the control arm, tagged ``excluded``
so that analyses leave it out.

The level is a `LevelSnapshot` the ingress refreshes in the background; the pipeline never calls
the policy actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deployments.enrichments.ab_test import CONTROL, EXCLUDED
from deployments.enrichments.spool import DurableSpool

logger = logging.getLogger("ray.serve")

PRE_STAGES = ("prompt_rewrite", "personalization", "ab_test", "semantic_cache_lookup")
POST_STAGES = ("response_polish",)
SIDE_EFFECTS = ("semantic_cache_write", "audit_log", "feature_stats", "debug_capture", "light_metrics")
OPTIONAL = PRE_STAGES + POST_STAGES + SIDE_EFFECTS

# A stage call: (feature, payload) -> result. The ingress binds it to deployment handles.
StageCall = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class LevelSnapshot:
    """The policy's view as the ingress holds it (refreshed in the background)."""

    level: int = 0
    enabled: frozenset[str] = frozenset(OPTIONAL)
    modes: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    config_version: int = 0
    fetched_at: float = 0.0

    @classmethod
    def from_view(cls, view: Mapping[str, Any], fetched_at: float) -> LevelSnapshot:
        return cls(
            level=int(view["level"]),
            enabled=frozenset(view["enabled"]),
            modes=dict(view.get("modes", {})),
            defaults=dict(view.get("defaults", {})),
            config_version=int(view.get("config_version", 0)),
            fetched_at=fetched_at,
        )

    def mode(self, feature: str) -> str:
        return self.modes.get(feature, "skip")


@dataclass
class RequestContext:
    """One request's way through the pipeline."""

    request_id: str
    user: str | None
    messages: list[dict[str, str]] | None
    prompt: str | None
    sampling: dict[str, Any]
    explicit: frozenset[str]  # sampling keys the client set itself: enrichments never override them
    snapshot: LevelSnapshot
    key_text: str = ""
    bypassed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)
    experiment: str | None = None
    variant: str | None = None
    cache_answer: str | None = None
    personalized: bool = False  # a profile shaped the prompt: the answer is this user's own
    started: float = field(default_factory=time.monotonic)

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {"request_id": self.request_id, "user": self.user}
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        return body

    def headers(self) -> dict[str, str]:
        h = {
            "X-Brownout-Level": str(self.snapshot.level),
            "X-Brownout-Bypassed": ",".join(self.bypassed + [f for f in self.failed if f not in self.bypassed]),
        }
        if self.deferred:
            h["X-Brownout-Deferred"] = ",".join(self.deferred)
        if self.experiment:
            h["X-Brownout-Experiment"] = f"{self.experiment}={self.variant}"
        if self.cache_answer is not None:
            h["X-Brownout-Cache"] = "hit"
        return h

    def _fill_sampling(self, sampling: Mapping[str, Any] | None) -> None:
        for key, value in (sampling or {}).items():
            if key not in self.explicit:
                self.sampling[key] = value

    def _add_system(self, text: str, prepend: bool) -> None:
        if not text:
            return
        if self.messages is None:
            self.prompt = f"{text}\n{self.prompt}" if prepend else f"{self.prompt}\n{text}"
            return
        if self.messages and self.messages[0]["role"] == "system":
            old = self.messages[0]["content"]
            merged = f"{text}\n{old}" if prepend else f"{old}\n{text}"
            self.messages = [{"role": "system", "content": merged}, *self.messages[1:]]
        else:
            self.messages = [{"role": "system", "content": text}, *self.messages]

    def apply(self, feature: str, result: Mapping[str, Any]) -> None:
        """Apply one pre stage's result (see the Enrichment contract)."""
        if feature == "prompt_rewrite":
            if "messages" in result and self.messages is not None:
                self.messages = list(result["messages"])
            if "prompt" in result and self.prompt is not None:
                self.prompt = result["prompt"]
        elif feature == "personalization":
            self.personalized = bool(result.get("system_prefix") or result.get("sampling"))
            self._add_system(result.get("system_prefix", ""), prepend=True)
            self._fill_sampling(result.get("sampling"))
        elif feature == "ab_test":
            self.experiment = result.get("experiment")
            self.variant = result.get("variant", CONTROL)
            self._add_system(result.get("system_suffix", ""), prepend=False)
            self._fill_sampling(result.get("sampling"))
        elif feature == "semantic_cache_lookup":
            if result.get("hit"):
                self.cache_answer = result.get("answer")


class Pipeline:
    """Runs the optional stages for the ingress. Plain logic: stage calls and spool injected."""

    def __init__(
        self,
        call: StageCall,
        spool_for: Callable[[str], DurableSpool] | None,
        timeouts_s: Mapping[str, float] | None = None,
        default_timeout_s: float = 1.0,
        experiment: str | None = None,
        available: frozenset[str] | None = None,
        on_outcome: Callable[[str, str], None] | None = None,
    ) -> None:
        self._call = call
        # (feature, "bypassed" | "failed" | "deferred"): a metrics hook, so an operator sees how
        # often each feature is degraded (and may reconsider one degraded too often)
        self._on_outcome = on_outcome or (lambda feature, outcome: None)
        # features this deployment has an enrichment for; others are simply not part of it
        self.available = frozenset(OPTIONAL) if available is None else frozenset(available)
        self._spool_for = spool_for
        self.spools: dict[str, DurableSpool] = {}
        self.timeouts_s = dict(timeouts_s or {})
        self.default_timeout_s = default_timeout_s
        self.experiment = experiment
        self.calls: Counter[str] = Counter()
        self.bypassed: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.deferred: Counter[str] = Counter()
        self._background: set[asyncio.Task[Any]] = set()
        self._drain_locks: dict[str, asyncio.Lock] = {}

    # -- stage calls ---------------------------------------------------------------------------

    async def _stage(self, feature: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        """Call one stage with its timeout; None (and counted) on failure or timeout."""
        self.calls[feature] += 1
        try:
            return await asyncio.wait_for(self._call(feature, payload),
                                          timeout=self.timeouts_s.get(feature, self.default_timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a failed optional stage never fails the request
            self.failures[feature] += 1
            self._on_outcome(feature, "failed")
            logger.warning("stage %s bypassed for this request: %r", feature, err)
            return None

    def _skip(self, ctx: RequestContext, feature: str) -> None:
        self.bypassed[feature] += 1
        self._on_outcome(feature, "bypassed")
        ctx.bypassed.append(feature)

    # -- pre -----------------------------------------------------------------------------------

    async def pre(self, ctx: RequestContext) -> None:
        enabled = [f for f in PRE_STAGES if f in ctx.snapshot.enabled and f in self.available]
        for f in PRE_STAGES:
            if f not in enabled and f in self.available:
                self._skip(ctx, f)
        payloads = {f: ({"key_text": ctx.key_text, "request_id": ctx.request_id}
                        if f == "semantic_cache_lookup" else ctx.payload()) for f in enabled}
        results = await asyncio.gather(*(self._stage(f, payloads[f]) for f in enabled))
        for feature, result in zip(enabled, results):
            if result is None:
                ctx.failed.append(feature)
                continue
            ctx.apply(feature, result)
        if "ab_test" in self.available and ("ab_test" not in enabled or "ab_test" in ctx.failed):
            # Bypassed: the control arm's behaviour, and out of the experiment's analysis.
            ctx.experiment, ctx.variant = self.experiment, EXCLUDED
        for feature in PRE_STAGES:
            if feature not in enabled and feature in self.available and ctx.snapshot.mode(feature) == "default":
                ctx.apply(feature, ctx.snapshot.defaults.get(feature) or {})

    # -- post ----------------------------------------------------------------------------------

    async def post(self, ctx: RequestContext, text: str) -> str:
        if "response_polish" not in self.available:
            return text
        if "response_polish" not in ctx.snapshot.enabled:
            self._skip(ctx, "response_polish")
            return text
        result = await self._stage("response_polish", {"text": text, "request_id": ctx.request_id})
        if result is None:
            ctx.failed.append("response_polish")
            return text
        return str(result.get("text", text))

    # -- side effects --------------------------------------------------------------------------

    def plan_side_effects(self, ctx: RequestContext) -> None:
        """Decide, before the response goes out, which side effects run (for the headers)."""
        for feature in SIDE_EFFECTS:
            if feature in ctx.snapshot.enabled or feature not in self.available:
                continue
            if ctx.snapshot.mode(feature) == "defer" and self._spool_for is not None:
                ctx.deferred.append(feature)
            else:
                self._skip(ctx, feature)

    def record(self, ctx: RequestContext, text: str, finish: str | None,
               usage: Mapping[str, int]) -> dict[str, Any]:
        """The finished request, as side effects receive it (see the Enrichment contract)."""
        return {
            "request_id": ctx.request_id, "at": time.time(), "user": ctx.user, "key_text": ctx.key_text,
            "prompt": ctx.prompt if ctx.messages is None else ctx.messages,
            "sampling": ctx.sampling, "response": {"text": text, "finish_reason": finish},
            "usage": dict(usage), "latency_ms": (time.monotonic() - ctx.started) * 1000.0,
            "level": ctx.snapshot.level, "variant": ctx.variant, "experiment": ctx.experiment,
            "cache_hit": ctx.cache_answer is not None, "bypassed": list(ctx.bypassed),
        }

    def side_effects(self, ctx: RequestContext, record: dict[str, Any]) -> None:
        """Run the planned side effects in the background: the response is already out."""
        task = asyncio.get_running_loop().create_task(self._side_effects(ctx, record))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _side_effects(self, ctx: RequestContext, record: dict[str, Any]) -> None:
        jobs = []
        for feature in SIDE_EFFECTS:
            if feature in ctx.deferred:
                await self._defer(feature, record)
            elif feature in ctx.snapshot.enabled and feature in self.available:
                if feature == "semantic_cache_write" and not self._shareable(ctx):
                    continue
                deferrable = ctx.snapshot.mode(feature) == "defer" or feature in self.spools
                jobs.append(self._write_through(feature, record) if deferrable else self._deliver(feature, [record]))
        await asyncio.gather(*jobs)

    def spool(self, feature: str) -> DurableSpool:
        assert self._spool_for is not None
        if feature not in self.spools:
            self.spools[feature] = self._spool_for(feature)
        return self.spools[feature]

    def pending(self, feature: str) -> int:
        return self.spool(feature).pending() if self._spool_for is not None else 0

    @staticmethod
    def _shareable(ctx: RequestContext) -> bool:
        """Whether an answer may go into the cache that every user reads from.

        The cache key is the client's own text, so only answers that text alone shaped are
        stored: not a cache hit (nothing new), not personalized, not an A/B treatment arm.
        """
        return ctx.cache_answer is None and not ctx.personalized and ctx.variant in (None, CONTROL, EXCLUDED)

    async def _defer(self, feature: str, record: dict[str, Any]) -> None:
        await asyncio.to_thread(self.spool(feature).append, record)
        self.deferred[feature] += 1
        self._on_outcome(feature, "deferred")

    async def _deliver(self, feature: str, records: list[dict[str, Any]]) -> bool:
        """Hand records to the stage: the audit log takes a batch, the others one at a time."""
        if feature == "audit_log":
            return await self._stage(feature, {"records": records}) is not None
        for record in records:
            if await self._stage(feature, record) is None:
                return False
        return True

    async def _write_through(self, feature: str, record: dict[str, Any]) -> None:
        """Run an enabled side effect. If older deferred records of the same feature wait in
        its spool, this one queues behind them, so records come out in order."""
        if self._spool_for is None:
            await self._deliver(feature, [record])
            return
        if self.pending(feature) > 0:
            await self._defer(feature, record)
            await self.drain(feature)
            return
        if not await self._deliver(feature, [record]):
            await self._defer(feature, record)  # unreachable stage: keep a record that must not be lost

    async def drain(self, feature: str, batch: int = 256) -> int:
        """Write a feature's spooled records out, in order (call only when it is enabled)."""
        if self._spool_for is None or self.pending(feature) == 0:
            return 0
        lock = self._drain_locks.setdefault(feature, asyncio.Lock())
        async with lock:
            async def sink(records: list[dict[str, Any]]) -> None:
                if not await self._deliver(feature, records):
                    raise RuntimeError(f"{feature} unavailable; records stay spooled")

            return await self.spool(feature).drain(batch, sink)

    async def wait_idle(self) -> None:
        """Wait for background side effects (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def counters(self) -> dict[str, dict[str, int]]:
        return {"calls": dict(self.calls), "bypassed": dict(self.bypassed),
                "failures": dict(self.failures), "deferred": dict(self.deferred),
                "spool_pending": {f: sp.pending() for f, sp in self.spools.items()}}
