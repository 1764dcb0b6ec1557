"""The control path, live: from the model's queue crossing a trigger to every ingress replica
serving the new level.

    .venv/bin/python bench/control_latency.py [--bursts 8] [--ingress-replicas 2] [--trigger 4]

It starts its own Ray cluster (private temp dir, free ports; ``ray.shutdown()`` at the end),
deploys ``serve_config.yaml`` with ``serve deploy`` changed in: the HTTP port, the data folder,
a private API key and admin token, the ``Ingress`` deployment's ``num_replicas`` and its policy,
which raises level 1 on vLLM's waiting queue alone (``queue_length >= --trigger``, recover below
1 after 2 s, no cooldown; no SLO, so no admission; levels 2 and 3 only on ``gpu_util``, which
a CPU machine never reports). Then, ``--bursts`` times, with the level back at 0 on every ingress
replica and the engine idle, it sends a burst of ``--burst`` concurrent streamed requests
(``--max-tokens`` each, ``ignore_eos``; more than the engine's batch, so requests wait) and
reads afterwards, on one clock (one machine):

- **crossing**: the wall time of the engine step at which vLLM's waiting count first reached the
  trigger (the engine records every step that changes it: the model deployment's
  ``waiting_changes()``);
- **decision**: the policy actor's transition to level 1 (its history);
- **served**: when each ingress replica started serving level 1 (``level_changes`` in
  ``GET /admin/brownout``'s ``ingress`` part; the admin route is asked until every replica has
  answered).

The figure of issue 14 is ``served_all - crossing`` (the slowest ingress replica), split into
crossing -> decision (the model replica's report interval, 0.25 s, the report call and the
actor's early tick) and decision -> served (the long-poll's answer). Writes
``bench/results/control_latency.json`` and prints the medians, the maximum and PASS/FAIL against
0.5 s.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository importable, bench/ itself not on the path
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import httpx

from bench import overload as ov
from bench.overload import machine

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.5
NEVER = {"level2": 0.98, "level3": 0.99}  # gpu_util triggers: a CPU machine never reports gpu_util


def burst_policy(base: dict[str, Any], trigger: int) -> dict[str, Any]:
    """The deployed policy's features and off-modes, with levels that only the queue raises."""
    doc = copy.deepcopy(base)
    deg = doc["degradation"]
    deg.pop("slo", None)
    deg.pop("admission", None)
    for key in ("level1", "level2", "level3"):
        level = deg.get(key) or {}
        level.update(escalate_after_s=0, recover_dwell_s=2, cooldown_s=0)
        level["trigger"] = {"queue_length": float(trigger)} if key == "level1" else {"gpu_util": NEVER[key]}
        level["recover"] = {"queue_length": 1.0} if key == "level1" else {"gpu_util": 0.5}
        level.pop("shape", None)
        deg[key] = level
    return doc


def first_at_or_after(changes: Sequence[Sequence[float]], since: float, at_least: float) -> float | None:
    """The time of the first ``(t, value)`` with ``t >= since`` and ``value >= at_least``."""
    for t, value in changes:
        if t >= since and value >= at_least:
            return float(t)
    return None


def burst_delays(t_sent: float, waiting: Sequence[Sequence[float]], trigger: float, decided_at: float | None,
                 served: dict[str, Sequence[Sequence[float]]]) -> dict[str, Any]:
    """One burst's figures from the recorded changes (all wall-clock seconds)."""
    crossing = first_at_or_after(waiting, t_sent, trigger)
    per_replica = {name: first_at_or_after(ch, crossing if crossing is not None else t_sent, 1)
                   for name, ch in served.items()}
    out: dict[str, Any] = {"crossing_after_send_s": None if crossing is None else round(crossing - t_sent, 4)}
    if crossing is None or decided_at is None or any(v is None for v in per_replica.values()):
        out["complete"] = False
        out["served_at"] = per_replica
        return out
    last = max(v for v in per_replica.values() if v is not None)
    out.update(
        complete=True,
        crossing_to_decision_s=round(decided_at - crossing, 4),
        decision_to_served_all_s=round(last - decided_at, 4),
        crossing_to_served_all_s=round(last - crossing, 4),
        per_replica_s={k: round(v - crossing, 4) for k, v in per_replica.items() if v is not None},
    )
    return out


def ingress_states(base: str, replicas: int, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """``GET /admin/brownout``'s ingress part from every ingress replica (asked until each answered)."""
    seen: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    with ov.http(base) as c:
        while len(seen) < replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {sorted(seen)} of {replicas} ingress replicas answered")
            r = c.get("/admin/brownout")
            r.raise_for_status()
            ing = r.json()["ingress"]
            seen[ing["replica"]] = ing
    return seen


def wait_level0(base: str, replicas: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = ingress_states(base, replicas)
        if all(s["snapshot_level"] == 0 for s in st.values()) and ov.admin_state(base)["level"] == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"level 0 not back within {timeout_s:g} s")


def send_burst(base: str, n: int, max_tokens: int, tag: str) -> list[int]:
    statuses: list[int] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"model": ov.MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"{tag} request {i}: a story of {max_tokens} words"}]}
        try:
            with httpx.Client(base_url=base, timeout=120, headers=ov.HEADERS) as c, \
                    c.stream("POST", "/v1/chat/completions", json=body) as r:
                for _ in r.iter_bytes():
                    pass
                code = r.status_code
        except httpx.HTTPError:
            code = -1
        with lock:
            statuses.append(code)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    return statuses


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from policies.actor import get_policy_actor

    cluster = ov.Cluster(None, f"control path, {args.bursts} bursts")
    base, config = cluster.base, cluster.config
    t_start = time.monotonic()
    try:
        app = config["applications"][0]
        (ingress,) = [d for d in app["deployments"] if d["name"] == "Ingress"]
        ingress["num_replicas"] = args.ingress_replicas
        ingress["user_config"]["policy"] = burst_policy(ingress["user_config"]["policy"], args.trigger)
        ov.log(f"deploying: {args.ingress_replicas} ingress replicas, level 1 at queue_length >= {args.trigger}")
        ov.deploy_brownout(cluster.dashboard, config, cluster.tmp)
        ov.wait_healthy(base, "/healthz")
        model = serve.get_deployment_handle("VLLMModel", app_name=ov.APP)
        send_burst(base, 4, 8, "warm-up")
        bursts: list[dict[str, Any]] = []
        for i in range(args.bursts):
            wait_level0(base, args.ingress_replicas)
            ov.wait_idle(base, True)
            t_sent = time.time()
            statuses = send_burst(base, args.burst, args.max_tokens, f"burst {i}")
            waiting = model.waiting_changes.remote().result()
            history = ray.get(get_policy_actor().history.remote(50))
            ups = [t["at"] for t in history if t["from"] == 0 and t["to"] >= 1 and t["at"] >= t_sent]
            served = {name: s["level_changes"] for name, s in ingress_states(base, args.ingress_replicas).items()}
            row = {"burst": i, "statuses": sorted(set(statuses)), "ok": statuses.count(200),
                   "peak_waiting": max((n for t, n in waiting if t >= t_sent), default=0),
                   **burst_delays(t_sent, waiting, args.trigger, ups[0] if ups else None, served)}
            bursts.append(row)
            ov.log(f"burst {i}: " + json.dumps({k: v for k, v in row.items() if k != "per_replica_s"}))
    finally:
        cluster.close()
    done = [b for b in bursts if b.get("complete")]
    total = [b["crossing_to_served_all_s"] for b in done]
    summary = {
        "bursts": len(bursts), "complete": len(done),
        "crossing_to_decision_s_median": _med([b["crossing_to_decision_s"] for b in done]),
        "decision_to_served_all_s_median": _med([b["decision_to_served_all_s"] for b in done]),
        "crossing_to_served_all_s_median": _med(total),
        "crossing_to_served_all_s_max": max(total) if total else None,
        "target_s": TARGET_S,
        "pass": bool(total) and len(done) == len(bursts) and max(total) < TARGET_S,
    }
    return {
        "what": "live control path: from vLLM's waiting queue reaching a level-1 trigger (the engine "
                "step) to every ingress replica serving level 1",
        "meta": {"command": "bench/control_latency.py " + " ".join(sys.argv[1:]),
                 "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "machine": machine(),
                 "args": vars(args), "wall_s": round(time.monotonic() - t_start, 1),
                 "pipeline": {"report_s": app["args"]["pipeline"].get("report_s"),
                              "refresh_s": app["args"]["pipeline"].get("refresh_s")}},
        "summary": summary,
        "bursts": bursts,
    }


def _med(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bursts", type=int, default=8)
    ap.add_argument("--burst", type=int, default=28, help="concurrent requests per burst (batch is 16)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--trigger", type=int, default=4, help="level 1 at this many requests waiting in vLLM")
    ap.add_argument("--ingress-replicas", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "control_latency.json"))
    args = ap.parse_args(argv)
    doc = run(args)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    s = doc["summary"]
    print(f"bursts {s['complete']}/{s['bursts']} complete; median crossing -> decision "
          f"{s['crossing_to_decision_s_median']} s, decision -> every ingress {s['decision_to_served_all_s_median']} s, "
          f"crossing -> every ingress {s['crossing_to_served_all_s_median']} s (max {s['crossing_to_served_all_s_max']} s): "
          f"{'PASS' if s['pass'] else 'FAIL'} (< {TARGET_S} s)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
