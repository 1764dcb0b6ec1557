"""The Enrichment contract: one optional feature's real work, behind a plain async interface.

An `Enrichment` is a plain object (no Ray). Where its features say so it runs inside the ingress
process (pure, cheap work: no RPC); otherwise `deployments/enrichments/host.py` puts it behind a
thin Serve deployment, and the ingress sends it every call of one request phase in one
``host.call_many.remote([(feature, payload), ...])``. Contract:

- ``features``: the registered feature names (``policies.features.REGISTRY``) it serves. One
  object may serve several (the semantic cache serves lookup and write).
- ``await call(feature, payload) -> dict``: do the work for ``feature``. ``payload`` and the
  result are plain JSON-able dicts (they may cross process boundaries). Each feature's
  `deployments.enrichments.feature.Feature` builds its payload and applies its result; side
  effects always receive ``{"records": [record, ...]}`` (see
  `deployments.enrichments.feature.RequestState.record`) and return ``{"ok": True, ...}``.
- It raises on failure; the pipeline times each call out, counts failures and goes on without
  the stage. It must never block the event loop for long: CPU-heavy work (embeddings) and
  blocking I/O (fsync, SQLite) run in a worker thread (``asyncio.to_thread``).
- ``counters() -> dict[str, int]``: calls per feature since start (the acceptance tests use
  these to prove a bypassed feature received no call); `Enrichment.call` counts them.
- ``stats() -> dict``: anything else worth showing an operator (sizes, hit rates).
- ``warmup()``: load what the first call would otherwise load (a model): the host awaits it
  before the replica reports ready, so no request pays for it.
- ``close()``: release files and connections.
"""

from __future__ import annotations

import abc
import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


class Enrichment(abc.ABC):
    features: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._calls: Counter[str] = Counter()

    async def call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        if feature not in self.features:
            raise ValueError(f"{type(self).__name__} does not serve feature {feature!r}; it serves {self.features}")
        self._calls[feature] += 1
        return await self._call(feature, payload)

    @abc.abstractmethod
    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Do the work of ``feature`` (already checked to be one of ``features``)."""

    def counters(self) -> dict[str, int]:
        return {f: self._calls.get(f, 0) for f in self.features}

    def stats(self) -> dict[str, Any]:
        return {}

    async def warmup(self) -> None:
        return None

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class Outcome:
    """One stage call's outcome, as it crosses back from a host: a result or an error text."""

    result: dict[str, Any] | None = None
    error: str | None = None


async def run_calls(by_feature: Mapping[str, Enrichment], calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Outcome]:
    """Run a batch of ``(feature, payload)`` calls concurrently; one failure fails only its call."""

    async def one(feature: str, payload: dict[str, Any]) -> Outcome:
        enrichment = by_feature.get(feature)
        if enrichment is None:
            return Outcome(error=f"no enrichment here serves {feature!r}; served: {sorted(by_feature)}")
        try:
            return Outcome(result=await enrichment.call(feature, payload))
        except Exception as err:  # noqa: BLE001 - reported to the caller, who bypasses the stage
            # the type only: an exception's text may quote the request (prompt, user), and this
            # string is logged
            return Outcome(error=type(err).__name__)

    return list(await asyncio.gather(*(one(f, p) for f, p in calls)))
