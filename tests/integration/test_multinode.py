"""Multi-node: a head and a second Ray node on this machine, the Brownout app across both (issue 14, item 1).

The test starts its own two-node cluster as subprocesses, ``ray start --head --block`` and
``ray start --address=<head> --block``, each with its own ports, temp dir, ``--resources``
(``node_head`` / ``node_b``) and ``--labels`` (``brownout-node=head`` / ``b``), and the cluster
token in their environment (Ray 2.60's token auth, as `make serve` runs it). It deploys
serve_config.yaml with `serve deploy` (conftest's `test_config`, with this test's ports, keys and
data folder) and four options only this test sets, in its own copy of the config:

- Ingress: ``num_replicas: 2`` and ``max_replicas_per_node: 1``, so one ingress replica per node;
- VLLMModel: ``resources: {node_head: 1}``: one vLLM engine is all 2 cores hold, and it stays on
  the head;
- the policy's ``forget_after_s: 15`` (default 60 s): how long a dead replica's source is kept;
- the second node's proxy binds a port of its own (``RAY_SERVE_WORKER_PROXY_HTTP_PORT`` in that
  node's environment): two proxies on one machine otherwise share one port, and the kernel, not
  the test, would pick the node. Serve's proxies prefer a replica on their own node, so each
  node's port reaches that node's ingress replica first; the tests still identify the replica
  that answered by the ``pid`` the admin view reports, never by the port.

The second node joins only once the app runs on the head, so the policy actor (created by the
first ingress replica) and the single-replica deployments are on the head: killing the second
node takes away an ingress replica and its reports, not the actor (the chaos test kills the
actor). What is checked, in file order:

1. an ingress replica on each node, the model on the head only, the policy actor on the head;
2. the named policy actor lists report sources from both nodes, every one fresh;
3. every ingress replica follows a pinned level (two levels in turn): its own copy of the level,
   and the ``X-Brownout-Level`` of the requests it answered (counted per replica);
4. the second node's raylet killed by PID: the level holds (no pin appears, the level never rises
   above what the policy decided before, and stays what the policy decides), the dead replica's
   signals are reported stale (not hidden) while its report is young enough, its source is then
   forgotten (``forget_after_s``, set to 15 s here: policies/signals.py) and nothing is left stale, and
   requests keep succeeding through the head's replica.

Ordering: this module runs first of the whole session (conftest's `pytest_collection_modifyitems`),
before the session cluster is started, so the two clusters (each with its own vLLM engine) never
share the machine's 2 cores and memory. Teardown ends the test's own processes only: SIGTERM to
each ``ray start --block`` (which ends its node's processes), then any process that still carries
this cluster's marker (``BROWNOUT_CLUSTER_ID``, set to the test's own temp dir) in its
environment, by PID, as `make stop` does. Never a plain ``ray stop``: it cannot target one
cluster and would end every Ray cluster on the machine.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.integration.conftest import APP, ROOT, Secrets, free_port, ingress_deployment, make_secrets
from tests.integration.conftest import test_config as session_test_config  # (not a test here)

pytestmark = pytest.mark.integration

MODEL = "brownout-tiny"
FORGET_S = 15  # the policy's forget_after_s here (stale_after_s stays 5)
LABEL = "brownout-node"
BIN = Path(sys.executable).parent
GiB = 1024**3


@dataclass
class RayNode:
    """One ``ray start --block`` subprocess: it stays up while its node runs, and on SIGTERM (or
    when one of its node's processes dies) ends every process of its node."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def raylet_pid(self) -> int:
        (pid,) = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True) if p.name() == "raylet"]
        return pid


@dataclass
class MultiNode:
    """The test's own cluster: where it listens, its token and secrets, and its nodes."""

    tmp: Path
    token: str
    secrets: Secrets
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    head_http: int = field(default_factory=free_port)
    b_http: int = field(default_factory=free_port)
    nodes: dict[str, RayNode] = field(default_factory=dict)

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every process of this cluster: its token, and the marker that
        teardown finds its processes by."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0",
                   # teardown: no 30 s drain of a node that is going away anyway
                   RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
                   BROWNOUT_CLUSTER_ID=str(self.tmp), HF_HUB_OFFLINE="1", **extra)
        return env

    def start_node(self, name: str, args: list[str], **env: str) -> RayNode:
        log = self.tmp / f"ray-{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(BIN / "ray"), "start", "--block", "--node-ip-address", "127.0.0.1",
                 "--temp-dir", str(self.tmp / f"ray-{name}"), "--object-store-memory", str(200 * 1024**2),
                 "--min-worker-port", "0", "--max-worker-port", "0",
                 "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port()),
                 "--labels", f"{LABEL}={name}", "--disable-usage-stats", *args],
                stdout=out, stderr=subprocess.STDOUT, env=self.env(**env), cwd=ROOT, start_new_session=True)
        node = self.nodes[name] = RayNode(name, proc, log)
        return node

    def dashboard(self, path: str, **params: Any) -> Any:
        r = httpx.get(self.dashboard_url + path, params=params, timeout=30,
                      headers={"Authorization": f"Bearer {self.token}"})
        r.raise_for_status()
        return r.json()

    def state_rows(self, kind: str, **params: Any) -> list[dict[str, Any]]:
        """Ray's state API (``ray list <kind>``) through the dashboard."""
        body = self.dashboard(f"/api/v0/{kind}", limit=1000, **params)
        assert body["result"], body
        return body["data"]["result"]["result"]

    def alive_nodes(self) -> dict[str, dict[str, Any]]:
        """The alive nodes by their label (head / b)."""
        return {n["labels"].get(LABEL, "?"): n for n in self.state_rows("nodes") if n["state"] == "ALIVE"}

    def app(self) -> dict[str, Any] | None:
        return self.dashboard("/api/serve/applications/")["applications"].get(APP)

    def running(self, deployment: str) -> list[dict[str, Any]]:
        app = self.app()
        if app is None or deployment not in app["deployments"]:
            return []
        return [r for r in app["deployments"][deployment]["replicas"] if r["state"] == "RUNNING"]

    def serve_deploy(self, config: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        path = self.tmp / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return subprocess.run([str(BIN / "serve"), "deploy", str(path), "--address", self.dashboard_url],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, env=self.env())

    def client(self, port: int) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=self.secrets.headers, timeout=60)

    def diagnostics(self) -> str:
        try:
            app = self.app()
            status = {name: (d["status"], d["message"][:300]) for name, d in (app or {}).get("deployments", {}).items()}
        except Exception as err:  # noqa: BLE001 - a diagnostic, for a failure message
            status = {"error": repr(err)}
        logs = "\n".join(f"--- {n.name} (exit {n.proc.poll()}):\n{n.tail()}" for n in self.nodes.values())
        return f"serve: {status}\n{logs}"


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, cluster: MultiNode | None = None,
             every_s: float = 1.0) -> Any:
    """Poll ``check`` until it returns something truthy; errors while polling count as not yet."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, KeyError, AssertionError) as err:
            last = err
        time.sleep(every_s)
    extra = cluster.diagnostics() if cluster else ""
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})\n{extra}")


def healthy(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200


def multinode_config(cluster: MultiNode) -> dict[str, Any]:
    """serve_config.yaml as the session's tests deploy it, plus the placement this test needs."""
    config = session_test_config(cluster.head_http, cluster.tmp / "data")
    ingress = ingress_deployment(config)
    ingress["num_replicas"] = 2
    ingress["max_replicas_per_node"] = 1
    # the dead node's replica is forgotten FORGET_S after its last report (default 60 s)
    ingress["user_config"]["policy"]["degradation"]["forget_after_s"] = FORGET_S
    config["applications"][0]["deployments"].append(
        {"name": "VLLMModel", "ray_actor_options": {"num_cpus": 1, "resources": {"node_head": 1}}})
    return config


def end_processes(marker: str, grace_s: float = 10) -> list[str]:
    """SIGTERM, then SIGKILL after ``grace_s``, every process whose environment carries
    ``BROWNOUT_CLUSTER_ID=marker`` (this cluster's, and only those); returns "PID name" of each."""
    ours = []
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get("BROWNOUT_CLUSTER_ID") == marker:
                ours.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    for proc in ours:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(ours, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return [f"{p.pid} {p.info['name']}" for p in ours]


@pytest.fixture(scope="module")
def multinode() -> Iterator[MultiNode]:
    tmp = Path(tempfile.mkdtemp(prefix="bo-mn-"))
    cluster = MultiNode(tmp, secrets.token_hex(32), make_secrets(tmp))
    try:
        cluster.start_node("head", [
            "--head", "--port", str(cluster.gcs_port), "--num-cpus", "2", "--resources", '{"node_head": 100}',
            "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(cluster.dashboard_port), "--ray-client-server-port", str(free_port())])
        wait_for("head node up", lambda: set(cluster.alive_nodes()) == {"head"}, 90, cluster)
        out = cluster.serve_deploy(multinode_config(cluster))
        assert out.returncode == 0, out.stderr + out.stdout

        def head_serving() -> bool:
            app = cluster.app()
            if app is not None and app["status"] == "DEPLOY_FAILED":
                pytest.fail(f"deploy failed: {app['message']}\n{cluster.diagnostics()}")
            return bool(cluster.running("VLLMModel") and cluster.running("Ingress")) and healthy(cluster.head_http)

        # one ingress replica runs; the second waits for a node (max_replicas_per_node: 1)
        wait_for("the app serving on the head", head_serving, 300, cluster, every_s=2)
        cluster.start_node("b", [
            "--address", f"127.0.0.1:{cluster.gcs_port}", "--num-cpus", "1", "--resources", '{"node_b": 1}'],
            RAY_SERVE_WORKER_PROXY_HTTP_PORT=str(cluster.b_http))
        wait_for("two alive nodes", lambda: set(cluster.alive_nodes()) == {"head", "b"}, 90, cluster)
        wait_for("both ingress replicas running, the app RUNNING",
                 lambda: len(cluster.running("Ingress")) == 2 and cluster.app()["status"] == "RUNNING", 180, cluster)
        wait_for("the second node's proxy answering", lambda: healthy(cluster.b_http), 120, cluster)
        mem = psutil.virtual_memory()
        print(f"\nmultinode: with this cluster up, memory used {(mem.total - mem.available) / GiB:.1f} GiB "
              f"of {mem.total / GiB:.1f} GiB", flush=True)
        yield cluster
    finally:
        for node in reversed(list(cluster.nodes.values())):
            if node.proc.poll() is None:
                node.proc.terminate()
        for node in cluster.nodes.values():
            try:
                node.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.proc.kill()
        left = end_processes(str(tmp))
        if left:
            print(f"multinode: ended {len(left)} leftover process(es) of the test cluster: {left}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)


# -- helpers over the app's own API --------------------------------------------------------------


def admin_state(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/admin/brownout")
    assert r.status_code == 200, r.text
    return r.json()


def replica_states(cluster: MultiNode, pids: set[int], timeout_s: float = 15,
                   accept: Callable[[dict[str, Any]], bool] = lambda s: True) -> dict[int, dict[str, Any]]:
    """The admin view as each ingress replica (by its ``pid``) answers it, one accepted answer per
    replica, asking through both nodes' ports in turn until every replica in ``pids`` answered."""
    got: dict[int, dict[str, Any]] = {}
    ports = [cluster.head_http, cluster.b_http]
    deadline = time.monotonic() + timeout_s
    i = 0
    with cluster.client(ports[0]) as a, cluster.client(ports[1]) as b:
        while set(got) != pids and time.monotonic() < deadline:
            state = admin_state((a, b)[i % 2])
            i += 1
            pid = state["ingress"]["pid"]
            if pid in pids and accept(state):
                got[pid] = state
            elif not accept(state):
                time.sleep(0.1)
    assert set(got) == pids, f"answered: {sorted(got)}, replicas: {sorted(pids)}"
    return got


def ingress_by_node(cluster: MultiNode) -> dict[str, dict[str, Any]]:
    """The running ingress replicas, by the label of the node each runs on."""
    label_of = {n["node_id"]: label for label, n in cluster.alive_nodes().items()}
    return {label_of.get(r["node_id"], r["node_id"]): r for r in cluster.running("Ingress")}


def source_replica(source: str, replicas: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The Serve replica a report source names (``Ingress:<replica unique id>``)."""
    uid = source.split(":", 1)[-1]
    return next((r for r in replicas if uid in (r["replica_id"], r["actor_name"].rsplit("#", 1)[-1])), None)


def node_reporters(cluster: MultiNode) -> list[dict[str, Any]]:
    """The per-node report batchers (`deployments.node_reporter.NodeReporter`), any state."""
    return cluster.state_rows("actors", filter_keys="class_name", filter_predicates="=",
                              filter_values="NodeReporter")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def chat(client: httpx.Client, note: str) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": f"multinode {note}"}], "max_tokens": 4})


def admitted(state: dict[str, Any]) -> int:
    return sum(state["ingress"]["admission"]["admitted"].values())


# -- the tests, in order --------------------------------------------------------------------------


def test_an_ingress_replica_on_each_node_the_model_and_the_policy_actor_on_the_head(multinode: MultiNode) -> None:
    nodes = multinode.alive_nodes()
    assert set(nodes) == {"head", "b"}
    assert nodes["head"]["is_head_node"] and not nodes["b"]["is_head_node"]
    assert "node_head" in nodes["head"]["resources_total"] and "node_b" in nodes["b"]["resources_total"]
    ingress = ingress_by_node(multinode)
    assert set(ingress) == {"head", "b"}, ingress
    models = multinode.running("VLLMModel")
    assert [m["node_id"] for m in models] == [nodes["head"]["node_id"]], models
    (actor,) = [a for a in multinode.state_rows("actors", filter_keys="name", filter_predicates="=",
                                                filter_values="brownout-policy") if a["state"] == "ALIVE"]
    assert actor["node_id"] == nodes["head"]["node_id"], actor


def test_the_policy_actor_hears_from_both_nodes(multinode: MultiNode) -> None:
    replicas = multinode.running("Ingress")
    label_of = {n["node_id"]: label for label, n in multinode.alive_nodes().items()}

    def both_fresh() -> dict[str, Any] | None:
        with multinode.client(multinode.head_http) as http:
            state = admin_state(http)
        ingress_sources = [s for s in state["sources"] if s.startswith("Ingress:")]
        nodes = {label_of[r["node_id"]] for s in ingress_sources if (r := source_replica(s, replicas))}
        # every source the actor keeps is fresh, and both nodes' ingress replicas are among them
        if nodes == {"head", "b"} and state["signals"]["sources"] == len(state["sources"]):
            return state
        return None

    state = wait_for("reports from both nodes' ingress replicas, all fresh", both_fresh, 15, multinode, every_s=0.5)
    assert len([s for s in state["sources"] if s.startswith("Ingress:")]) == 2, state["sources"]
    assert any(s.startswith("VLLMModel:") for s in state["sources"]), state["sources"]
    # they came through one reporter per node (deployments/node_reporter.py), each on its node
    reporters = node_reporters(multinode)
    assert {label_of.get(r["node_id"]) for r in reporters if r["state"] == "ALIVE"} == {"head", "b"}, reporters
    assert all(r["name"] == f"brownout-reporter-{r['node_id']}" for r in reporters), reporters


def test_every_ingress_replica_follows_the_level(multinode: MultiNode) -> None:
    pids = {r["pid"] for r in multinode.running("Ingress")}
    assert len(pids) == 2
    with multinode.client(multinode.head_http) as head, multinode.client(multinode.b_http) as b:
        try:
            for level in (2, 1):  # a change, then another: followed, not a coincidence
                r = head.post("/admin/brownout/override", json={"level": level, "ttl_s": 300, "note": f"multinode {level}"})
                assert r.status_code == 200, r.text
                before = replica_states(multinode, pids, accept=lambda s, lv=level: s["level"] == lv
                                        and s["ingress"]["snapshot_level"] == lv)
                for i in range(4):
                    for client in (head, b):
                        answer = chat(client, f"{level}-{i}")
                        assert answer.status_code == 200, answer.text
                        assert answer.headers["X-Brownout-Level"] == str(level)
                after = replica_states(multinode, pids)
                served = {pid: admitted(after[pid]) - admitted(before[pid]) for pid in pids}
                # every replica answered some of them, each at the pinned level
                assert all(n > 0 for n in served.values()), served
                assert sum(served.values()) == 8, served
                assert all(s["ingress"]["snapshot_level"] == level for s in after.values())
        finally:
            head.delete("/admin/brownout/override", params={"level": "true"})


def test_the_level_holds_when_the_second_node_dies(multinode: MultiNode) -> None:
    replicas = multinode.running("Ingress")
    nodes = multinode.alive_nodes()
    (dead_replica,) = [r for r in replicas if r["node_id"] == nodes["b"]["node_id"]]
    with multinode.client(multinode.head_http) as http:
        admin = http.delete("/admin/brownout/override", params={"level": "true"})
        assert admin.status_code == 200, admin.text

        def settled() -> dict[str, Any] | None:
            """Unpinned, and the same level on three reads in a row over a second."""
            states = []
            for _ in range(3):
                states.append(admin_state(http))
                time.sleep(0.5)
            ok = all(s["pin"] is None and s["level"] == s["policy_level"] == states[0]["level"]
                     and s["signals"]["sources"] == len(s["sources"]) for s in states)
            return states[-1] if ok else None

        baseline = wait_for("an unpinned, steady level with every source fresh", settled, 30, multinode)
        before = baseline["level"]
        baseline_stale = set(baseline["signals"]["stale"])
        (dead_source,) = [s for s in baseline["sources"] if source_replica(s, [dead_replica])]
        node_b = multinode.nodes["b"]

        os.kill(node_b.raylet_pid(), signal.SIGKILL)
        killed_at = time.monotonic()

        answers: list[tuple[float, int, str, int]] = []  # (s after the kill, status, level header, level read)
        seen_stale: dict[str, Any] | None = None
        forgotten: dict[str, Any] | None = None
        levels: list[tuple[float, int, int, Any]] = []
        last_chat = -10.0
        while time.monotonic() - killed_at < 100 and forgotten is None:
            t = time.monotonic() - killed_at
            state = admin_state(http)  # the head's replica answers: the only one left
            levels.append((round(t, 1), state["level"], state["policy_level"], state["pin"]))
            # the level holds: nothing pins it, it is what the policy decides, and the dead node
            # never raises it
            assert state["pin"] is None, levels[-3:]
            # on a failure, what raised it: the signals and the policy's reasons (seen once in CI:
            # level 3 within 15 s of the kill, with no cause recorded)
            assert state["level"] == state["policy_level"] <= before, (
                levels[-3:], answers[-2:], state["signals"],
                {k: state.get(k) for k in ("recent_transitions", "recovery_blocked_by")})
            stale = set(state["signals"]["stale"]) - baseline_stale
            if dead_source in state["sources"] and stale and state["signals"]["sources"] == len(state["sources"]) - 1:
                seen_stale = seen_stale or {**state, "at_s": round(t, 1)}
            if dead_source not in state["sources"] and set(state["signals"]["stale"]) == baseline_stale:
                forgotten = {**state, "at_s": round(t, 1)}
            if t - last_chat >= 2:  # the surviving replica keeps answering, at the level in force
                last_chat = t
                answer = chat(http, f"after kill {t:.0f}")
                answers.append((round(t, 1), answer.status_code, answer.headers.get("X-Brownout-Level", ""),
                                {str(state["level"]), str(admin_state(http)["level"])}))
            time.sleep(0.5)

    assert seen_stale is not None, f"the dead replica's signals were never reported stale; levels {levels[-5:]}"
    # stale: the dead replica's report is kept, and flagged, once older than stale_after_s
    assert seen_stale["at_s"] >= 4, seen_stale["at_s"]
    assert forgotten is not None, f"the dead replica's source was not forgotten within 100 s; levels {levels[-5:]}"
    assert forgotten["at_s"] >= FORGET_S - 3, forgotten["at_s"]  # forget_after_s after its last report
    print(f"\nmultinode: level {before} before the kill; the dead replica's signals stale at "
          f"{seen_stale['at_s']} s ({sorted(set(seen_stale['signals']['stale']) - baseline_stale)}), "
          f"its source forgotten at {forgotten['at_s']} s; levels seen {sorted({lv for _, lv, _, _ in levels})}; "
          f"{len(answers)} requests after the kill: {[(t, s, h) for t, s, h, _ in answers]}", flush=True)
    assert all(status == 200 for _, status, _, _ in answers), answers
    assert all(header in levels_around for _, _, header, levels_around in answers), answers
    assert len(answers) >= 5, answers
    # the node is gone: its `ray start --block` ended its processes, Ray marked it dead
    assert node_b.proc.wait(timeout=30) != 0
    wait_for("the second node marked dead", lambda: set(multinode.alive_nodes()) == {"head"}, 30, multinode)
    wait_for("the dead node's ingress replica process gone", lambda: gone(dead_replica["pid"]), 30, multinode)
    # its node's reporter died with it and is not waiting to be restarted on a node that is gone
    (b_reporter,) = [r for r in node_reporters(multinode) if r["node_id"] == nodes["b"]["node_id"]]
    assert b_reporter["state"] == "DEAD", b_reporter
    with multinode.client(multinode.head_http) as http:
        final = admin_state(http)
    assert final["level"] <= before and final["pin"] is None
    assert [s for s in final["sources"] if s.startswith("Ingress:")] == [
        s for s in baseline["sources"] if s.startswith("Ingress:") and s != dead_source]
