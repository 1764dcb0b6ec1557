"""A CPU engine's cores to itself (`deployments/cpu_placement.py`), measured side by side.

    python bench/cpu_isolation.py [--phases xAIAI] [--levels 3,0] [--seconds 30] \
        [--out bench/results/cpu_isolation.json]

One private Ray cluster, `serve_config.yaml` deployed as shipped (``model.cpu_isolation: auto``),
admission off, each level pinned in turn; at each level a closed loop of ``--concurrency`` (16:
one full batch) streamed chat completions of 16 tokens (``ignore_eos``, new prompts) runs for
``--seconds`` per phase, phases in the order given:

* ``x``: the placement as the model replica made it (nothing touched by this command);
* ``A``: every process of the Ray node (the raylet and its tree) and the engine-core process
  back on every CPU of the node (no isolation);
* ``I``: the model replica's placement again (the CPUs it reports in ``/healthz``).

Per phase: completed requests per second, their median latency, and for the engine-core's main
thread (the one that runs the forward pass) the CPU it used and the time it waited runnable on
the run queue (``/proc/<pid>/schedstat``), per second of the phase. Alternating phases on one
deployment compares the two placements on the same server minutes apart; a machine this noisy
needs that, not two runs an hour apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repository importable
    sys.path.insert(0, str(ROOT))

from bench import overload as ov  # noqa: E402
from bench.loadgen import make_prompt  # noqa: E402
from deployments import cpu_placement as cp  # noqa: E402

MODEL = "brownout-tiny"


def schedstat(pid: int, tid: int | None = None) -> tuple[int, int]:
    """(ns on a CPU, ns waiting on a run queue) of the thread ``tid`` of process ``pid`` (its
    main thread by default)."""
    with open(f"/proc/{pid}/task/{pid if tid is None else tid}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu), int(waiting)


async def closed_loop(base: str, concurrency: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    """``concurrency`` clients, each sending its next request when the last one ended."""
    url = base + "/v1/chat/completions"
    rng = random.Random(time.time_ns())
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=60, headers=ov.HEADERS, limits=limits) as client:
        async def worker() -> None:
            nonlocal errors
            while time.monotonic() < stop:
                body = {"model": MODEL, "messages": [{"role": "user", "content": make_prompt(rng)}],
                        "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
                t0 = time.monotonic()
                async with client.stream("POST", url, json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass
                if time.monotonic() >= stop:
                    break
                if r.status_code == 200:
                    latencies.append(time.monotonic() - t0)
                else:
                    errors += 1

        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return {"rps": round(len(latencies) / seconds, 2),
            "p50_s": round(statistics.median(latencies), 3) if latencies else None,
            "errors": errors}


def place(raylet: int, engine: int, engine_cpus: list[int] | None, service_cpus: list[int] | None) -> None:
    """The raylet's tree on ``service_cpus`` and the engine-core on ``engine_cpus`` (None: the node's)."""
    node = list(cp.node_cpus())
    for pid in cp.descendants(cp.parent_map(), raylet) - {engine}:
        cp.set_process_cpus(pid, service_cpus or node)
    cp.set_process_cpus(engine, engine_cpus or node)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="xAIAI", help="x: as deployed, A: no isolation, I: isolation")
    ap.add_argument("--levels", default="3,0", help="levels to pin, in order")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu_isolation.json"))
    args = ap.parse_args()
    if set(args.phases) - set("xAI"):
        raise SystemExit(f"--phases: {args.phases!r}; use x, A and I")
    levels = [int(x) for x in args.levels.split(",")]

    cluster = ov.Cluster(None, "CPU isolation, side by side")
    results: list[dict[str, Any]] = []
    try:
        ov.deploy_brownout(cluster.dashboard, cluster.config, cluster.tmp)
        ov.wait_healthy(cluster.base, "/healthz")
        ov.set_admission(cluster.base, cluster.policy_doc, enabled=False)
        engine_stats = httpx.get(cluster.base + "/healthz", headers=ov.HEADERS, timeout=30).json()["engine"]
        iso = engine_stats["cpu_isolation"]
        ov.log(f"placement as deployed: {iso}")
        if not iso["active"]:
            raise SystemExit(f"no CPU isolation to compare with: {iso['reason']}")
        engine = iso["engine_pids"][0]
        raylet = cp.parent_map()[engine_stats["pid"]]
        for level in levels:
            ov.pin_level(cluster.base, level)
            asyncio.run(closed_loop(cluster.base, args.concurrency, 20.0, args.max_tokens))  # warm up
            for phase in args.phases:
                if phase == "A":
                    place(raylet, engine, None, None)
                elif phase == "I":
                    place(raylet, engine, iso["engine_cpus"], iso["service_cpus"])
                ticks0, t0 = schedstat(engine), time.monotonic()
                out = asyncio.run(closed_loop(cluster.base, args.concurrency, args.seconds, args.max_tokens))
                ticks1, dt = schedstat(engine), time.monotonic() - t0
                row = {"level": level, "phase": phase, **out,
                       "engine_thread_cores": round((ticks1[0] - ticks0[0]) / 1e9 / dt, 3),
                       "engine_thread_runq_wait_s_per_s": round((ticks1[1] - ticks0[1]) / 1e9 / dt, 3)}
                ov.log(json.dumps(row))
                results.append(row)
            place(raylet, engine, iso["engine_cpus"], iso["service_cpus"])
    finally:
        cluster.close()

    def med(level: int, phase: str) -> float | None:
        xs = [r["rps"] for r in results if r["level"] == level and r["phase"] in phase]
        return statistics.median(xs) if xs else None

    summary = {f"level{lvl}": {"rps_isolated_median": med(lvl, "xI"), "rps_not_isolated_median": med(lvl, "A"),
                               "ratio": (round(med(lvl, "xI") / med(lvl, "A"), 3)
                                         if med(lvl, "xI") and med(lvl, "A") else None)}
               for lvl in levels}
    argv, shown = sys.argv[1:], []
    while argv:  # the command without --out (no machine path in a stored result)
        a = argv.pop(0)
        if a == "--out":
            argv = argv[1:]
        elif not a.startswith("--out="):
            shown.append(a)
    doc = {"meta": {"command": " ".join(["bench/cpu_isolation.py", *shown]),
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": ov.machine(),
                    "request": {"stream": True, "max_tokens": args.max_tokens, "ignore_eos": True,
                                "closed_loop_concurrency": args.concurrency, "seconds_per_phase": args.seconds},
                    "placement": iso},
           "summary": summary, "phases": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
