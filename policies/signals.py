"""Load signals: per-replica reports, and their aggregation into one snapshot.

Every replica (model, ingress, enrichments) reports the signals it can see, stamped with the time
it took them. The aggregator keeps the latest report per source and folds the fresh ones into a
`Signals` snapshot. Aggregation per signal:

- ``sum`` for counts of work (``inflight``, ``model_queued``, ``model_replicas_pending``): work
  anywhere in the cluster is work the cluster must do; replicas each see only their own share.
- ``max`` for one engine's queue (``queue_length``: a request waits behind the engine it was
  routed to) and for utilisation and latency (``gpu_util``, ``gpu_mem_ratio``, ``kv_cache_usage``,
  ``avg_latency_ms``, ``p95_latency_ms`` (end to end, at the ingress),
  ``engine_p95_latency_ms``, ``enrichment_p95_latency_ms``, ``ttft_p95_ms``,
  ``predicted_wait_ms``): one name per meaning, each reported by one kind of replica; requests routed
  to the hottest replica wait behind it, so the worst replica is the one that breaks the SLO. A
  mean would hide one saturated GPU among idle ones; a max across replicas' p95s over-states the cluster p95 only
  when replicas differ, which is exactly when shedding is warranted.

A replica that tried to read a signal and failed (an NVML error on a GPU machine) says so in its
report's ``stale`` names: the signal is stale, exactly as if the report were old, never silently
missing (a missing signal would stop blocking recovery).

Freshness: a report older than ``stale_after_s`` is left out of the values. A signal that any
stale report carries is *stale*, even where fresh reports give it a value: a sum missing one
replica under-counts and a max missing one may miss the hottest. The controller still escalates
on the fresh values but will not recover on a blind spot (fail-static). A signal no source has carried within ``forget_after_s`` is *absent* (e.g. no GPU
on a CPU machine): it neither triggers nor blocks recovery. Sources silent for ``forget_after_s``
are dropped, so a replica that was scaled away stops pinning its signals as stale forever.

Reports reach the policy actor batched per node (`deployments.node_reporter`: at 1,000 replicas
the number of calls, not the fold, is what a single actor cannot keep up with), each still under
its own replica's source, so ``sources`` counts replicas and a replica that went silent goes stale
here. ``replicas`` counts the fresh sources per deployment (a source is ``<deployment>:<replica
id>``, `deployments.reporting.replica_source`): the ingress sizes its share of the model's batch
with it. (The node reporter does not fold its replicas' reports into one: staleness and counts
stay per replica.)

No clock is read here: every method takes ``now``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.config import SIGNAL_AGGREGATION as AGGREGATION
from policies.config import SIGNALS


@dataclass(frozen=True)
class Signals:
    """One aggregated snapshot: fresh values, and the names of stale signals."""

    at: float
    values: Mapping[str, float] = field(default_factory=dict)
    stale: frozenset[str] = frozenset()
    sources: int = 0
    replicas: Mapping[str, int] = field(default_factory=dict)  # fresh sources per deployment

    def to_dict(self) -> dict[str, object]:
        return {
            "at": self.at,
            "values": dict(self.values),
            "stale": sorted(self.stale),
            "sources": self.sources,
            "replicas": dict(self.replicas),
        }


@dataclass(frozen=True)
class Report:
    """What one replica saw at ``at``; ``stale``: signals it tried to read and could not.
    Unknown signal names are rejected at construction."""

    source: str
    at: float
    values: Mapping[str, float]
    stale: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in (*self.values, *self.stale):
            if name not in AGGREGATION:
                raise ValueError(
                    f"report from {self.source!r}: unknown signal {name!r}; "
                    f"valid signals: {', '.join(SIGNALS)}"
                )


class Aggregator:
    """Latest report per source, folded into `Signals` on demand."""

    def __init__(self, stale_after_s: float = 5.0, forget_after_s: float = 60.0) -> None:
        if stale_after_s <= 0 or forget_after_s < stale_after_s:
            raise ValueError(
                f"need 0 < stale_after_s <= forget_after_s, got {stale_after_s}, {forget_after_s}"
            )
        self.stale_after_s = stale_after_s
        self.forget_after_s = forget_after_s
        self._latest: dict[str, Report] = {}

    def add(self, report: Report) -> None:
        """Keep ``report`` unless the source already sent a newer one (out-of-order delivery)."""
        held = self._latest.get(report.source)
        if held is None or report.at >= held.at:
            self._latest[report.source] = report

    def sources(self) -> list[str]:
        return sorted(self._latest)

    def aggregate(self, now: float) -> Signals:
        fresh_cutoff = now - self.stale_after_s
        forget_cutoff = now - self.forget_after_s
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        stale_seen: set[str] = set()
        fresh_sources = 0
        replicas: dict[str, int] = {}
        forgotten = []
        for source, report in self._latest.items():
            if report.at < forget_cutoff:
                forgotten.append(source)
                continue
            if report.at < fresh_cutoff:
                stale_seen.update(report.values)
                continue
            fresh_sources += 1
            deployment = source.partition(":")[0]
            replicas[deployment] = replicas.get(deployment, 0) + 1
            stale_seen.update(report.stale)
            for name, value in report.values.items():
                if AGGREGATION[name] == "sum":
                    sums[name] = sums.get(name, 0.0) + value
                elif value > maxes.get(name, float("-inf")):
                    maxes[name] = value
        for source in forgotten:
            del self._latest[source]
        values = {**sums, **maxes}
        return Signals(
            at=now,
            values=values,
            stale=frozenset(stale_seen),
            sources=fresh_sources,
            replicas=replicas,
        )
