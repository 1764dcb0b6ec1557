"""Brownout's metrics on the running app's Prometheus endpoint (Ray's metrics export).

Acceptance (issue 13): during a pinned level the level gauge reads the pin and the bypass
counters rise for exactly the features the level turns off; every metric the Grafana dashboard
(configs/grafana/brownout.json) queries is exported, scraped from a running app. Some series
exist only once recorded, so the test first causes each event (requests, a pin, an operator's
feature override, a refused API key, refused admission, a rejected report) and then polls the
endpoint (metrics are exported every second, scraped on demand) for up to 30 s.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import defaultdict
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from policies.config import parse_policy
from policies.features import OffMode
from tests.integration.conftest import Cluster, ingress_deployment, policy_actor
from tests.integration.test_brownout import CHAT, MODEL, admin, chat, gibberish, wait_level
from tests.unit.test_grafana_dashboard import metric_names

pytestmark = pytest.mark.integration
Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(cluster: Cluster) -> Samples:
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).text
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name].append((dict(sample.labels), sample.value))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of ``name`` with these labels (replicas, nodes)."""
    return sum(v for tags, v in samples.get(name, []) if all(tags.get(k) == x for k, x in labels.items()))


def by_feature(samples: Samples, name: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for tags, v in samples.get(name, []):
        if all(tags.get(k) == x for k, x in labels.items()):
            out[tags["feature"]] += v
    return out


def poll(cluster: Cluster, done: Any, timeout_s: float = 30) -> Samples:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(cluster)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(1)


def test_pinned_level_shows_in_the_gauge_and_bypass_counters_rise_for_exactly_its_features(
        deployed: Cluster, http: httpx.Client) -> None:
    policy = parse_policy(ingress_deployment(deployed.config())["user_config"]["policy"])
    off = {f for f, lv in policy.off_levels().items() if lv is not None and lv <= 2}
    bypassed = {f for f in off if policy.off_mode(f) is not OffMode.DEFER}  # a deferred one is "deferred"
    assert bypassed, off
    before = by_feature(scrape(deployed), "ray_brownout_stage_outcomes_total", outcome="bypassed")
    admin(http, "POST", json={"level": 2, "ttl_s": 120, "note": "metrics test"})
    try:
        wait_level(http, 2)
        for _ in range(3):
            r = chat(http, user=None)
            assert r.status_code == 200, r.text
            assert r.headers["X-Brownout-Level"] == "2"

        def rose(samples: Samples) -> set[str]:
            after = by_feature(samples, "ray_brownout_stage_outcomes_total", outcome="bypassed")
            return {f for f, n in after.items() if n > before.get(f, 0)}

        samples = poll(deployed, lambda s: total(s, "ray_brownout_level") == 2 and rose(s) == bypassed)
        levels = [v for _, v in samples["ray_brownout_level"]]
        assert levels and set(levels) == {2.0}, levels
        assert rose(samples) == bypassed
        enabled = by_feature(samples, "ray_brownout_feature_enabled")
        assert {f for f in bypassed if enabled.get(f) != 0} == set(), enabled
        assert all(enabled[f] == 1 for f in policy.off_levels() if f not in off), enabled
        assert total(samples, "ray_brownout_level_pinned") == 1
    finally:
        admin(http, "DELETE", params={"level": "true"})


def policy_features(deployed: Cluster) -> set[str]:
    """The optional features the shipped policy names (each has a circuit breaker)."""
    policy = parse_policy(ingress_deployment(deployed.config())["user_config"]["policy"])
    return set(policy.features)


def refuse_some_admission(deployed: Cluster, http: httpx.Client) -> None:
    """Concurrent sheddable requests, 8, then 16, then 32 at once, until the door refuses one
    (429/503). Sheddable work may use 90% of the SLO; how many requests in flight that admits
    follows the machine's speed (on a fast hour 8 fitted: seen in CI). 32 is twice the engine's
    batch: admitted, the last of them would wait for a whole batch of 32-token answers to finish
    first and then run its own, which the door's Little's-law bound refuses past the budget."""
    def send(_: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": gibberish()}], "max_tokens": 32,
                "ignore_eos": True}
        with deployed.client() as c:
            return c.post(CHAT, json=body, headers={"X-Brownout-Criticality": "sheddable"}).status_code

    codes: list[int] = []
    for n in (8, 16, 32):
        with cf.ThreadPoolExecutor(n) as pool:
            codes = list(pool.map(send, range(n)))
        if {429, 503} & set(codes):
            return
    raise AssertionError(f"up to 32 concurrent sheddable requests were never refused at the door: {codes}")


def test_every_metric_the_dashboard_queries_is_exported(deployed: Cluster, http: httpx.Client) -> None:
    wanted = metric_names()
    assert len(wanted) >= 15
    # the events that create series only once recorded
    assert chat(http).status_code == 200
    bad_key = httpx.post(deployed.base_url + CHAT, json={"model": MODEL, "messages": []},
                         headers={"Authorization": "Bearer not-a-key"}, timeout=30)
    assert bad_key.status_code == 401
    # from level 0 (earlier tests may leave the level raised, ab_test already off by it)
    admin(http, "POST", json={"level": 0, "ttl_s": 30, "note": "metrics test"})
    wait_level(http, 0)
    admin(http, "POST", json={"feature": "ab_test", "enabled": False, "ttl_s": 30})
    # one policy tick with the override alone in force, so the turn-off is counted as the
    # override's (pinning level 1 first would turn ab_test off by the level)
    deadline = time.monotonic() + 10
    while "ab_test" in admin(http, "GET", "/admin/brownout")["enabled"]:
        assert time.monotonic() < deadline, "the ab_test override never took effect"
        time.sleep(0.2)
    time.sleep(0.5)
    admin(http, "POST", json={"level": 1, "ttl_s": 30, "note": "metrics test"})
    try:
        wait_level(http, 1)
        time.sleep(1.0)  # a few ticks with features off: seconds disabled are counted
    finally:
        admin(http, "DELETE", params={"level": "true", "feature": "ab_test"})
    import ray

    assert ray.get(policy_actor().report.remote("test:metrics", {"no_such_signal": 1.0})) is False
    refuse_some_admission(deployed, http)

    samples = poll(deployed, lambda s: wanted <= set(s))
    missing = wanted - set(samples)
    assert not missing, f"queried by configs/grafana/brownout.json but not exported: {sorted(missing)}"
    # and they carry what the dashboard's legends name
    assert total(samples, "ray_brownout_feature_turned_off_total", feature="ab_test", cause="override") >= 1
    assert total(samples, "ray_brownout_report_errors_total", reason="rejected") >= 1
    # every feature's circuit is exported, closed here (0)
    circuits = by_feature(samples, "ray_brownout_circuit_state")
    assert set(circuits) >= {f for f in policy_features(deployed)} and set(circuits.values()) == {0.0}, circuits
    assert {t["bound"] for t, _ in samples["ray_brownout_signal_threshold"]} == {"trigger", "recover"}
    assert total(samples, "ray_brownout_slo_ms", objective="e2e_p99") > 0
    assert any(t.get("from") and t.get("to") for t, _ in samples["ray_brownout_level_transitions_total"])
