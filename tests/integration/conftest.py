"""A real local Ray cluster (with dashboard, for `serve deploy`) and the Brownout app on it.

One cluster and one `serve deploy` of serve_config.yaml serve the whole integration session:
starting the vLLM replica is the slow part (20-30 s here), so every test shares it. The config
deployed is serve_config.yaml itself with only the HTTP port moved to a free one, so a running
`make serve` on this machine does not collide with the tests.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
APP = "brownout"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Secrets:
    """The test cluster's API keys and admin token (serve_app.security, in the cluster's tmp)."""

    api_key: str  # tenant "tests", tier standard, limits far above what any test sends
    other_key: str  # tenant "others": a second tenant
    limited_key: str  # tenant "tests", 3 requests a minute: the rate-limit test's
    critical_key: str  # tenant "tests", tier critical: the admission tests'
    admin_token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "X-Brownout-Admin-Token": self.admin_token}


def secrets_dir(tmp: Path) -> Path:
    return tmp / "secrets"


def make_secrets(tmp: Path) -> Secrets:
    from serve_app.security import RateSettings, add_key, ensure_admin_token

    d = secrets_dir(tmp)
    roomy = RateSettings(requests="10000/second", tokens="10000000/second")
    key, _ = add_key(d / "keys.yaml", "tests", "standard", "tests", roomy)
    other, _ = add_key(d / "keys.yaml", "others", "standard", "others", roomy)
    limited, _ = add_key(d / "keys.yaml", "tests", "standard", "limited",
                         RateSettings(requests="3/minute", tokens="10000/minute"))
    critical, _ = add_key(d / "keys.yaml", "tests", "critical", "critical", roomy)
    token, _ = ensure_admin_token(d / "admin_token")
    return Secrets(key, other, limited, critical, token)


@dataclass
class Cluster:
    dashboard_url: str
    http_port: int
    tmp: Path
    metrics_port: int
    secrets: Secrets

    @property
    def headers(self) -> dict[str, str]:
        """An API key and the admin token: what every test client sends."""
        return self.secrets.headers

    def client(self, timeout: float = 60, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, headers=self.headers, **kw)

    @property
    def data_dir(self) -> Path:
        return self.tmp / "data"

    def config(self) -> dict[str, Any]:
        return test_config(self.http_port, self.data_dir)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def serve_deploy(self, config: dict[str, Any], name: str = "serve_config.yaml") -> subprocess.CompletedProcess:
        path = self.tmp / name
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return subprocess.run(
            [str(Path(sys.executable).parent / "serve"), "deploy", str(path), "--address", self.dashboard_url],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )


def wait_running(timeout_s: float = 300) -> dict[str, Any]:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = serve.status()
        app = status.applications.get(APP)
        if app is not None and app.status == "RUNNING":
            return {"app": app}
        if app is not None and app.status == "DEPLOY_FAILED":
            details = {name: d.message for name, d in app.deployments.items() if d.message}
            raise AssertionError(f"deploy failed: {app.message} {details}")
        time.sleep(1)
    raise AssertionError(f"app not RUNNING after {timeout_s}s: {status}")


def test_config(http_port: int, data_dir: Path) -> dict[str, Any]:
    """serve_config.yaml, unchanged but for the HTTP port, a private data folder and the test
    cluster's own keys file and admin token (next to the data folder)."""
    config = copy.deepcopy(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    config["http_options"]["port"] = http_port
    args = config["applications"][0]["args"]
    args["enrichments"]["data_dir"] = str(data_dir)
    args["auth"]["keys_file"] = str(secrets_dir(data_dir.parent) / "keys.yaml")
    args["auth"]["admin_token_file"] = str(secrets_dir(data_dir.parent) / "admin_token")
    return config


def ingress_deployment(config: dict[str, Any]) -> dict[str, Any]:
    (ingress,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "Ingress"]
    return ingress


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="bo-", dir="/tmp"))
    dash, metrics = free_port(), free_port()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dash,
        _temp_dir=str(tmp / "ray"),
        _system_config={"metrics_report_interval_ms": 1000},
        _metrics_export_port=metrics,
        log_to_driver=False,
    )
    c = Cluster(f"http://127.0.0.1:{dash}", free_port(), tmp, metrics, make_secrets(tmp))
    try:
        yield c
    finally:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def deployed(cluster: Cluster) -> Cluster:
    """serve_config.yaml deployed with `serve deploy`, RUNNING and answering."""
    out = cluster.serve_deploy(cluster.config())
    assert out.returncode == 0, out.stderr + out.stdout
    wait_running()
    r = httpx.get(cluster.base_url + "/healthz", timeout=30)
    assert r.status_code == 200, r.text
    return cluster


@pytest.fixture
def http(deployed: Cluster) -> Iterator[httpx.Client]:
    with deployed.client() as client:
        yield client


def model_handle():  # type: ignore[no-untyped-def]
    from ray import serve

    return serve.get_deployment_handle("VLLMModel", app_name=APP)


def model_stats() -> dict[str, Any]:
    return model_handle().stats.remote().result(timeout_s=10)


def enrichment_stats(http: httpx.Client) -> dict[str, Any]:
    """Each place optional features run (the enrichment deployments, and "Ingress" for the
    features that run in the ingress process), with its own stats and counters."""
    r = http.get("/admin/brownout/enrichments")
    assert r.status_code == 200, r.text
    stats = r.json()
    errors = {name: s["error"] for name, s in stats.items() if "error" in s}
    assert not errors, errors
    return stats


def enrichment_counters(http: httpx.Client) -> dict[str, int]:
    """Calls per feature, as the workers themselves count them."""
    out: dict[str, int] = {}
    for host in enrichment_stats(http).values():
        out.update(host["counters"])
    return out


def kill_replica(deployment: str) -> int:
    """Kill one replica of ``deployment`` (no restart of that actor: Serve starts a new replica);
    returns how many replicas it had."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#")]
    assert names, f"no {deployment} replica"
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return len(names)


def policy_actor():  # type: ignore[no-untyped-def]
    from policies.actor import get_policy_actor

    return get_policy_actor()


os.environ.setdefault("HF_HUB_OFFLINE", "1")


# the tests that run after all others, in this order (`pytest_collection_modifyitems`)
LAST = (
    "tests/integration/test_chaos.py",
    "tests/integration/test_cli.py::test_features_ranks_the_slowed_semantic_cache_first_by_cost",
    "tests/integration/test_autoscaling.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The multi-node test runs first of all: it starts a two-node cluster of its own (with its own
    vLLM engine) and ends it before the session cluster above is started, so the two never share
    the machine's cores and memory.

    The chaos test runs after every other test but two: it kills the policy actor, an enrichment
    replica and the model replica, and what those restarts leave behind (a restarted actor's
    fresh counters, a level still raised) must not be what another test starts from.

    Then the features-cost test (`test_cli`): it redeploys the app with the semantic cache's
    embedding slowed and leaves it so (a redeploy that changes the app's ``args`` restarts every
    replica, the model's too: putting the app back would cost CI another minute or more), and it
    sets the level it measures at itself.

    The autoscaling test runs last of all: it redeploys the app with an autoscaled model and a
    test policy (from the session's config, so the cost test's slowed embedding is gone) and
    leaves them deployed (the session ends the cluster after it), and it waits for level 0
    itself before it starts."""
    def rank(item: pytest.Item) -> int:
        node = item.nodeid
        if node.startswith("tests/integration/test_multinode.py"):
            return 0
        for i, last in enumerate(LAST, start=2):
            if node.startswith(last):
                return i
        return 1

    items.sort(key=rank)  # stable: within a rank, the collected order
