"""Autoscaling with degradation, on the real cluster: the model deployment scales on its queue with
Brownout's policy function, the policy degrades while the new replica is pending and recovers
once it serves, and the count falls again only after the policy is back at level 0.

The session's app is redeployed with ``model.autoscaling`` (one to two replicas, two requests per
replica as the target, no upscale delay, a 3 s downscale delay and look-back, the queue
pushed to Serve's autoscaler every second: ``metrics_interval_s`` 1) and an SLO of 120 s: with that
budget nothing is refused and no queue, predicted-wait or latency trigger fires or holds at
this load, so the only signal that can raise the level is ``model_replicas_pending``. Six
clients keep streamed answers of 48 tokens going until the second replica serves.

It runs last (after the chaos test and the features-cost test, conftest): it leaves the
autoscaled app deployed, which no other test expects, and the session ends the cluster after it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import ray

from tests.integration.conftest import Cluster, policy_actor, wait_running
from tests.integration.test_brownout import CHAT, MODEL


def model_replicas() -> dict[str, int]:
    from ray import serve

    app = serve.status().applications["brownout"]
    return {str(state): n for state, n in app.deployments["VLLMModel"].replica_states.items()}


def running(states: dict[str, int]) -> int:
    return sum(n for s, n in states.items() if s.endswith("RUNNING"))


def actor_state() -> dict[str, Any]:
    return ray.get(policy_actor().get_state.remote(), timeout=30)


def wait_for(what: str, check: Any, timeout_s: float, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    st = actor_state()
    why = {k: st.get(k) for k in ("level", "recovery_blocked_by", "calm_since", "recent_transitions")}
    why["signals"] = st["signals"]
    why["level1_recover"] = {sig: lv["1"]["recover"] for sig, lv in (st.get("thresholds") or {}).items() if "1" in lv}
    raise AssertionError(f"{what}: not within {timeout_s:g} s (last: {last!r}); policy: {why}; "
                         f"model replicas: {model_replicas()}")


def autoscaled_config(cluster: Cluster) -> dict[str, Any]:
    config = cluster.config()
    app = config["applications"][0]
    app["args"]["model"]["autoscaling"] = {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
        "upscale_delay_s": 0, "downscale_delay_s": 3, "metrics_interval_s": 1, "look_back_period_s": 3,
    }
    (ingress,) = [d for d in app["deployments"] if d["name"] == "Ingress"]
    policy = ingress["user_config"]["policy"]["degradation"]
    policy["slo"]["e2e_p99_ms"] = 120000
    for key in ("level1", "level2", "level3"):
        policy[key].update(recover_dwell_s=3, cooldown_s=1)
    return config


def admission(cluster: Cluster) -> dict[str, Any]:
    """The admission state of the ingress replica that answers (``/admin/brownout``)."""
    with cluster.client() as http:
        r = http.get("/admin/brownout")
    assert r.status_code == 200, r.text
    return r.json()["ingress"]["admission"]


class Clients:
    """``n`` clients each sending streamed answers one after another until stopped."""

    def __init__(self, cluster: Cluster, n: int) -> None:
        self.cluster, self.stop = cluster, threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": 48, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"client {i}: tell a story"}]}
        with self.cluster.client(timeout=120) as http:
            while not self.stop.is_set():
                try:
                    with http.stream("POST", CHAT, json=body) as r:
                        for _ in r.iter_bytes():
                            pass
                        self.statuses.append(r.status_code)
                except httpx.HTTPError:
                    self.statuses.append(-1)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


def test_model_autoscales_while_the_policy_degrades_and_recovers(deployed: Cluster) -> None:
    out = deployed.serve_deploy(autoscaled_config(deployed), "autoscaled.yaml")
    assert out.returncode == 0, out.stderr + out.stdout
    wait_running()
    # what Serve runs: its replicas and handles push every metrics_interval_s (Ray 2.60)
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient  # `serve deploy`'s client: the token too

    details = ServeSubmissionClient(deployed.dashboard_url).get_serve_details()
    serve_auto = details["applications"]["brownout"]["deployments"]["VLLMModel"]["deployment_config"]["autoscaling_config"]
    assert (serve_auto["metrics_interval_s"], serve_auto["look_back_period_s"]) == (1, 3), serve_auto
    wait_for("one model replica running", lambda: running(model_replicas()) == 1, 300, 2)
    ray.get(policy_actor().clear_override.remote(level=True), timeout=30)
    wait_for("level 0 before the load", lambda: actor_state()["level"] == 0, 180, 1)
    one = admission(deployed)  # the ingress's share of one engine's batch
    assert one["model_replicas"] == 1, one

    seen_pending: dict[str, Any] = {}
    started = time.time()  # the actor's clock is the wall clock of this machine

    def pending_and_degraded() -> bool:
        st = actor_state()
        if st["signals"]["values"].get("model_replicas_pending", 0) >= 1 and st["level"] >= 1:
            seen_pending.update(st)
            return True
        return False

    with Clients(deployed, 6) as clients:
        # Serve's replicas push their queue every second here; the replica is asked for after that
        wait_for("a pending replica raising the level", pending_and_degraded, 120, 0.25)
        trigger = [t for t in seen_pending["recent_transitions"] if t["to"] > t["from"]]
        assert trigger and trigger[-1]["reason"]["signal"] == "model_replicas_pending", trigger
        assert "autoscaler:brownout/VLLMModel" in seen_pending["sources"]
        # A vLLM engine starting beside one serving six clients: on a slow 2-core machine this
        # took over 300 s once (the new replica still STARTING), so the bound is generous.
        wait_for("two model replicas running", lambda: running(model_replicas()) == 2, 600, 1)
        # every replica serves: none pending, and the level recovers after its dwell
        wait_for("no replica pending", lambda: actor_state()["signals"]["values"].get(
            "model_replicas_pending") == 0, 30, 0.5)
        wait_for("level 0 with both replicas serving", lambda: actor_state()["level"] == 0, 60, 1)
        # admission counts both engines' batches (the policy actor's view names who reports)
        wait_for("the ingress sized for two engines", lambda: (lambda a: a["model_replicas"] == 2
                 and a["slots"] == 2 * one["slots"])(admission(deployed)), 30, 0.5)
        assert running(model_replicas()) == 2  # under load at level 0: the count holds
    assert clients.statuses and set(clients.statuses) == {200}, sorted(set(clients.statuses))
    # the load is gone and the policy is at level 0: the count may fall (downscale delay 3 s,
    # behind the 3 s look-back)
    wait_for("back to one model replica", lambda: running(model_replicas()) == 1
             and sum(model_replicas().values()) == 1, 180, 2)
    wait_for("the ingress sized for one engine again", lambda: admission(deployed)["slots"] == one["slots"], 30, 1)
    # nothing but the pending replica raised the level during the whole run
    history = ray.get(policy_actor().history.remote(50), timeout=30)
    raised = [t for t in history if t["to"] > t["from"] and t["at"] >= started]
    assert raised and all(t["reason"]["signal"] == "model_replicas_pending" for t in raised), raised
