"""The `brownout` command line against the real app: a subprocess, as an operator runs it.

Acceptance (issue 13): ``brownout status`` prints the level and its reason; ``brownout override
--level 2 --ttl 30s`` is in force at once (within one policy tick) and gone after 30 s;
``--json`` output parses; the exit codes say what went wrong; with the semantic cache's
embedding slowed (``embed_delay_ms``, a test setting), ``brownout features`` ranks a cache
feature first by cost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.integration.conftest import ROOT, Cluster, free_port, wait_running

pytestmark = pytest.mark.integration


def brownout(cluster: Cluster, *args: str, token: str | None = None, url: str | None = None,
             timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROWNOUT_")}
    env["BROWNOUT_ADMIN_TOKEN"] = token if token is not None else cluster.secrets.admin_token
    env["BROWNOUT_URL"] = url or cluster.base_url
    return subprocess.run([sys.executable, "-m", "serve_app.cli", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout_s)


def status_json(cluster: Cluster) -> dict[str, Any]:
    out = brownout(cluster, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_status_prints_the_level_and_its_reason(deployed: Cluster) -> None:
    brownout(deployed, "release")
    out = brownout(deployed, "status", "--plain")
    assert out.returncode == 0, out.stderr
    state = status_json(deployed)
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"level {state['level']}"), lines[0]
    assert lines[1].startswith("reason: "), lines[1]
    last = (state["recent_transitions"] or [None])[-1]
    if last is not None:
        assert last["reason"]["kind"] in lines[1]
    assert "signals (" in out.stdout and "features (" in out.stdout
    # with rich (the default), the same facts
    rich = brownout(deployed, "status")
    assert rich.returncode == 0 and f"level {state['level']}" in rich.stdout and "reason: " in rich.stdout


def test_override_is_in_force_within_one_tick_and_gone_after_its_ttl(deployed: Cluster) -> None:
    out = brownout(deployed, "override", "--level", "2", "--ttl", "30s", "--note", "cli acceptance")
    assert out.returncode == 0, out.stderr
    assert "level pinned at 2 for 30s" in out.stdout
    state = status_json(deployed)
    assert state["level"] == 2, state["level"]
    pin = state["pin"]
    assert pin["level"] == 2 and pin["note"] == "cli acceptance"
    assert 28 <= pin["expires_at"] - time.time() <= 30.5
    # one policy tick (250 ms) plus the ingress's refresh (250 ms) later, requests are served at 2
    deadline = time.monotonic() + 1.0
    while status_json(deployed)["ingress"]["snapshot_level"] != 2:
        assert time.monotonic() < deadline, "the ingress did not follow the pin within a second"
    listed = brownout(deployed, "status", "--plain").stdout
    assert "PINNED by an operator" in listed and "cli acceptance" in listed

    time.sleep(max(0.0, pin["expires_at"] - 2 - time.time()))
    assert status_json(deployed)["pin"] is not None, "the pin went before its TTL"
    time.sleep(max(0.0, pin["expires_at"] + 1 - time.time()))
    state = status_json(deployed)
    assert state["pin"] is None, "the pin outlived its TTL by more than a second"
    history = json.loads(brownout(deployed, "history", "-n", "50", "--json").stdout)
    pinned = [t for t in history if t["reason"].get("detail") == "level pinned at 2"]
    assert pinned, history
    if state["level"] != 2:  # the pin's end changed the level: the history says why
        assert any(t["reason"]["kind"] == "override_expired" and t["at"] >= pin["expires_at"] for t in history)


def test_feature_override_and_release(deployed: Cluster) -> None:
    out = brownout(deployed, "override", "--feature", "debug_capture", "--off", "--ttl", "1m")
    assert out.returncode == 0, out.stderr
    state = status_json(deployed)
    assert state["feature_overrides"]["debug_capture"]["enabled"] is False
    assert "debug_capture" not in state["enabled"]
    out = brownout(deployed, "release", "--feature", "debug_capture", "--json")
    assert out.returncode == 0, out.stderr
    assert "debug_capture" not in json.loads(out.stdout)["state"]["feature_overrides"]


@pytest.mark.parametrize("verb", [["status"], ["history", "-n", "5"], ["features"], ["watch", "--count", "2",
                                                                                  "--interval", "0.5s"]])
def test_json_output_parses(deployed: Cluster, verb: list[str]) -> None:
    out = brownout(deployed, *verb, "--json")
    assert out.returncode == 0, out.stderr
    docs = [json.loads(line) for line in out.stdout.splitlines()]
    assert docs and all(isinstance(d, (dict, list)) for d in docs)


def test_exit_codes_say_what_went_wrong(deployed: Cluster) -> None:
    refused = brownout(deployed, "status", token="not-the-token")
    assert refused.returncode == 4 and "admin token refused" in refused.stderr
    nobody = brownout(deployed, "status", url=f"http://127.0.0.1:{free_port()}")
    assert nobody.returncode == 3 and "make serve" in nobody.stderr
    bad = brownout(deployed, "override", "--feature", "no_such_feature", "--on", "--ttl", "1m")
    assert bad.returncode == 2 and "no_such_feature" in bad.stderr
    too_long = brownout(deployed, "override", "--level", "1", "--ttl", "2h")
    assert too_long.returncode == 2 and "ttl_s" in too_long.stderr


def _cache_delay(cluster: Cluster) -> float | None:
    """The running SemanticCache replica's embed_delay_ms (0.0: off; None: no answer yet, which
    includes no answer within 30 s: while Serve replaces the app's replicas after a redeploy the
    ingress may not answer at all, seen in CI on a slow machine)."""
    import httpx

    try:
        r = httpx.get(cluster.base_url + "/admin/brownout/enrichments", headers=cluster.headers, timeout=30)
    except httpx.TransportError:
        return None
    if r.status_code != 200:
        return None
    stats = ((r.json().get("SemanticCache") or {}).get("enrichments") or {}).get("semantic_cache") or {}
    return stats.get("embed_delay_ms", 0.0)


def _deploy_and_wait(cluster: Cluster, config: dict[str, Any], name: str, delay_ms: float) -> None:
    out = cluster.serve_deploy(config, name)
    assert out.returncode == 0, out.stderr + out.stdout
    deadline = time.monotonic() + 300
    while _cache_delay(cluster) != delay_ms:  # the new SemanticCache replica answers
        assert time.monotonic() < deadline, f"embed_delay_ms={delay_ms} never took effect"
        time.sleep(2)
    wait_running()


def test_features_ranks_the_slowed_semantic_cache_first_by_cost(deployed: Cluster) -> None:
    """Runs after the chaos test and before the autoscaling test (conftest), and leaves the app
    with its slowed embedding: putting it back would restart every replica once more."""
    import httpx

    from tests.integration.test_brownout import CHAT, MODEL

    config = deployed.config()
    config["applications"][0]["args"]["enrichments"]["settings"] = {"semantic_cache": {"embed_delay_ms": 300}}
    _deploy_and_wait(deployed, config, "slow-embedding.yaml", 300.0)
    try:
        assert brownout(deployed, "override", "--level", "0", "--ttl", "120s", "--note", "cost test").returncode == 0
        body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8, "user": "user-0007"}
        with deployed.client(timeout=120) as http:
            for _ in range(8):
                r = http.post(CHAT, json=body)
                assert r.status_code == 200, r.text
                assert r.headers["X-Brownout-Level"] == "0"
        out = brownout(deployed, "features", "--json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        rows = doc["features"]
        first = rows[0]
        assert first["feature"].startswith("semantic_cache"), [(r["feature"], r["window"]["cost_ms"]) for r in rows]
        assert first["rank"] == 1 and first["window"]["calls"] >= 8
        assert first["window"]["latency_ms_per_call"] >= 300, first
        assert [r["window"]["cost_ms"] for r in rows] == sorted((r["window"]["cost_ms"] for r in rows), reverse=True)
        lookup = next(r for r in rows if r["feature"] == "semantic_cache_lookup")
        assert lookup["cpu_calls"] >= 1  # the worker reported its CPU time
        # the table: the same first line
        table = brownout(deployed, "features", "--plain")
        assert table.returncode == 0, table.stderr
        numbered = [line.split() for line in table.stdout.splitlines() if line.split() and line.split()[0] == "1"]
        assert numbered and numbered[0][1] == first["feature"], table.stdout
        # the route is admin-only, as every /admin route
        assert httpx.get(deployed.base_url + "/admin/brownout/features", timeout=30).status_code in (401, 403)
    finally:
        brownout(deployed, "release")
        # the slowed embedding stays: this test runs after every other but the autoscaling test,
        # which deploys its own config (conftest's `pytest_collection_modifyitems`)
