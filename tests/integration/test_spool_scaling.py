"""Deferred records survive scaling the Ingress 3 -> 2 -> 3 replicas: count in = count out, no
duplicates.

Real cluster, real vLLM, real files. Level 3 is pinned so the audit log is deferred to each
replica's spool; requests flow while `serve deploy` scales the Ingress down (Serve stops one
replica: its spool becomes an orphan, its lock released by the kernel) and up again (Ray
renumbers ranks, so the new replica may get the rank, and the spool name, of a live one or of
the orphan). Then the level drops: every replica drains its own spool and adopts the orphans it
can lock. Every request answered 200 must be in the audit log exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from deployments.enrichments.audit_log import read_all
from tests.integration.conftest import APP, Cluster, ingress_deployment
from tests.integration.test_brownout import admin, chat, pin, settle_counters

pytestmark = pytest.mark.integration


def scale(deployed: Cluster, replicas: int, timeout_s: float = 180) -> None:
    """`serve deploy` the same config with ``replicas`` Ingress replicas; wait until exactly that
    many run (only num_replicas changes, so no replica restarts)."""
    from ray import serve

    config = deployed.config()
    ingress_deployment(config)["num_replicas"] = replicas
    out = deployed.serve_deploy(config, f"ingress-{replicas}.yaml")
    assert out.returncode == 0, out.stderr + out.stdout
    deadline = time.monotonic() + timeout_s
    while True:
        states: dict[str, Any] = dict(serve.status().applications[APP].deployments["Ingress"].replica_states)
        if states.get("RUNNING") == replicas and sum(states.values()) == replicas:
            return
        assert time.monotonic() < deadline, f"Ingress not at {replicas} replicas: {states}"
        time.sleep(0.5)


class Load:
    """Sequential requests from a thread until stopped; keeps what each answer was."""

    def __init__(self, deployed: Cluster) -> None:
        self.client = deployed.client(timeout=60)
        self.ok: list[str] = []  # x-request-id of every 200
        self.other: Counter[int] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = chat(self.client, user=None)
            except httpx.HTTPError:
                self.other[0] += 1
                continue
            if r.status_code == 200:
                self.ok.append(r.headers["x-request-id"])
            else:
                self.other[r.status_code] += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(90)
        self.client.close()


def test_scaling_ingress_3_2_3_loses_and_duplicates_no_deferred_record(deployed: Cluster, http: httpx.Client) -> None:
    audit_dir = deployed.data_dir / "audit"
    try:
        scale(deployed, 3)
        pin(http, 3)
        with Load(deployed) as load:
            time.sleep(5)
            scale(deployed, 2)
            time.sleep(5)
            scale(deployed, 3)
            time.sleep(5)
        sent = load.ok
        assert len(sent) >= 10, (len(sent), load.other)
        # 5xx would be a request that may have reached the model without being answered
        assert not [s for s in load.other if s == 0 or s >= 500], load.other
        pin(http, 0)  # the level drops: spools drain, orphans are adopted
        deadline = time.monotonic() + 90
        while True:
            mine = Counter(r.get("client_request_id") for r in read_all(audit_dir))
            missing = [i for i in sent if mine[i] == 0]
            left = [p.name for p in (deployed.data_dir / "spool").glob("*.spool") if p.stat().st_size]
            if (not missing and not left) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not missing, f"{len(missing)} of {len(sent)} answered requests never reached the audit log"
        dupes = {i: n for i, n in mine.items() if i in set(sent) and n > 1}
        assert not dupes, f"duplicated in the audit log: {dupes}"
        assert not left, f"records left in spools: {left}"
    finally:
        admin(http, "DELETE", params={"level": "true"})
        scale(deployed, 1)
        settle_counters(http)
