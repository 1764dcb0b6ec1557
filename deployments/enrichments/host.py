"""EnrichmentHost: a thin Serve deployment holding one or more plain `Enrichment` objects.

``app.py`` binds one host per deployment the features name (`Worker.host`), each built from
``{kind: settings}`` by `deployments.enrichments.registry.build`. The ingress sends every call
of one request phase in one ``call_many([(feature, payload), ...])`` (one RPC, not one per
feature); ``counters()`` gives calls per feature, which is how the tests prove that a bypassed
deployment received no call. Each host reports its own call latency to the policy actor like
every other replica.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from deployments.enrichments.base import Enrichment, Outcome, run_calls
from deployments.enrichments.registry import build
from deployments.reporting import ReportLink, replica_source, signal_reporter
from deployments.window import SlidingWindow


class EnrichmentHost:
    async def __init__(
        self,
        kinds: Mapping[str, Mapping[str, Any]],
        report_interval_s: float = 0.5,
        reports: ReportLink | None = None,
    ) -> None:
        self.enrichments: dict[str, Enrichment] = {kind: build(kind, dict(s)) for kind, s in kinds.items()}
        self.by_feature: dict[str, Enrichment] = {
            f: e for e in self.enrichments.values() for f in e.features
        }
        for enrichment in self.enrichments.values():
            await enrichment.warmup()
        self.latency_ms = SlidingWindow(time.monotonic, 30.0, 2048)
        self.errors = 0
        if reports is None:  # through this node's reporter, batched with its neighbours'
            from deployments.node_reporter import report_link

            reports = report_link()
        self.reporter = signal_reporter(
            reports, replica_source("EnrichmentHost"), self._signals, report_interval_s
        )
        self.reporter.start()

    def _signals(self) -> dict[str, float]:
        p95 = self.latency_ms.percentile(95)
        return {} if p95 is None else {"enrichment_p95_latency_ms": p95}

    async def call_many(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Outcome]:
        """Run one request phase's calls, concurrently; each gets its own `Outcome`."""
        t0 = time.monotonic()
        try:
            outcomes = await run_calls(self.by_feature, calls)
        finally:
            self.latency_ms.add((time.monotonic() - t0) * 1000.0)
        self.errors += sum(o.error is not None for o in outcomes)
        return outcomes

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.enrichments.values():
            out.update(e.counters())
        return out

    async def stats(self) -> dict[str, Any]:
        """Async on purpose: Serve runs a sync method in a thread pool, where it would read the
        counters and windows the event loop is writing; an async one runs on the event loop."""
        return {
            "pid": os.getpid(),
            "counters": self.counters(),
            "errors": self.errors,
            "latency_p95_ms": self.latency_ms.percentile(95),
            # CPU seconds per feature, measured around its work here (base.Enrichment.call_metered)
            "cpu_s": {f: s for e in self.enrichments.values() for f, s in e.cpu_seconds().items()},
            "enrichments": {kind: e.stats() for kind, e in self.enrichments.items()},
            "report_failures": self.reporter.failures,
        }

    async def __del__(self) -> None:
        await self.reporter.stop()
        for e in self.enrichments.values():
            await e.close()
