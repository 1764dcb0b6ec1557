"""Replica statistics are read on the replica's event loop, not in Serve's thread pool.

Serve runs a sync deployment method in a thread pool; a sync ``stats()`` would read deques and
counters while the event loop writes them. The integration tests call both through handles
(`model_stats`, `enrichment_stats` in tests/integration/conftest.py).
"""

from __future__ import annotations

import inspect

from deployments.enrichments.host import EnrichmentHost
from deployments.model import VLLMModel


def test_replica_stats_methods_are_async() -> None:
    for cls in (VLLMModel, EnrichmentHost):
        assert inspect.iscoroutinefunction(cls.stats), cls.__name__
