"""The Enrichment contract: one optional feature's real work, behind a plain async interface.

An `Enrichment` is a plain object (no Ray): `deployments/enrichments/host.py` puts one or more
of them behind a thin Serve deployment, and the ingress pipeline calls
``host.call.remote(feature, payload)``. Contract:

- ``features``: the registered feature names (``policies.features.REGISTRY``) it serves. One
  object may serve several (the semantic cache serves lookup and write).
- ``await call(feature, payload) -> dict``: do the work for ``feature``. ``payload`` and the
  result are plain JSON-able dicts (they cross process boundaries). What each stage receives and
  returns:

  =====================  ========================================  ===============================
  feature                payload                                   result
  =====================  ========================================  ===============================
  prompt_rewrite         {messages | prompt, user, request_id}     {messages | prompt} (rewritten)
  personalization        {messages | prompt, user, request_id}     {system_prefix?, sampling?}
  ab_test                {user, request_id}                        {experiment, variant,
                                                                    system_suffix?, sampling?}
  semantic_cache_lookup  {key_text, request_id}                    {hit, answer?, similarity?}
  response_polish        {text, request_id}                        {text}
  semantic_cache_write   record (below)                            {ok}
  audit_log              {records: [record, ...]}                  {ok, written}
  feature_stats          record                                    {ok}
  debug_capture          record                                    {ok}
  light_metrics          record                                    {ok}
  =====================  ========================================  ===============================

  A *record* describes one finished request: ``request_id``, ``at`` (unix s), ``user``,
  ``key_text`` (the cache key: the client's own messages/prompt, before enrichment), ``prompt``
  (what the model saw), ``sampling``, ``response`` (``text``, ``finish_reason``), ``usage``,
  ``latency_ms``, ``level``, ``variant`` (or ``"excluded"``), ``cache_hit``, ``bypassed``.

- It raises on failure; the pipeline times each call out, counts failures and goes on without
  the stage. It must never block the event loop for long: CPU-heavy work (embeddings) and
  blocking I/O (fsync, SQLite) run in a worker thread (``asyncio.to_thread``).
- ``counters() -> dict[str, int]``: calls per feature since start (the acceptance tests use
  these to prove a bypassed feature received no call). `Enrichment.call` wrappers count via
  `_count`.
- ``stats() -> dict``: anything else worth showing an operator (sizes, hit rates).
- ``warmup()``: load what the first call would otherwise load (a model): the host awaits it
  before the replica reports ready, so no request pays for it.
- ``close()``: release files and connections.
"""

from __future__ import annotations

import abc
from collections import Counter
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
