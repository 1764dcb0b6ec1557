"""The first seconds of an overload from calm: the engine's speed reading beside its CPU time.

    .venv/bin/python bench/onset.py --rate 17.5 --onsets auto,auto,pin3,auto --out bench/results/onset.json

In the overload benchmark the engine's speed reading (`policies.engine_speed`) often read 1.5-2.6
x slower in the first seconds of a load step from calm, and each such reading cut every cap of
the door (`policies.admission.AdmissionController.set_speed`). This deploys Brownout as the
overload benchmark does (a private Ray cluster, admission on, the shipped policy at ``--slo-ms``),
and for each onset in ``--onsets`` brings the policy back to level 0 (`bench.overload.reset_policy`),
waits ``--calm-s`` with no load, then sends ``--rate`` req/s (open-loop Poisson, the benchmark's
20/50/30 mix) for ``--seconds``: ``auto`` lets the policy raise the level, ``pin3`` pins level 3
first (no level change, no optional work). Beside the door's polls (its in-flight count, the speed
reading and what it applied) it samples every ``--sample-s`` the engine-core process's CPU time and
run-queue wait, summed over its threads (``/proc/<pid>/task/*/schedstat``), and how busy the
engine's CPUs were (``/proc/stat``): whatever ran there besides the engine shows as the
difference. And every other sample the model's own reading with the kinds of step it rests on
(``/healthz``'s ``engine.engine_speed_window``: each kind's batch, its fewest prompt tokens,
steps, time, ratio weighed by time and reference). So a reading of 2 x with the engine on its CPU
all the time and nothing else there is the engine's own steps (or the references they are
compared with), not a neighbour's; a reading with the engine waiting on its run queue is a
neighbour.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import overload as ov  # noqa: E402
from bench import provenance  # noqa: E402
from bench.cpu_isolation import schedstat  # noqa: E402
from bench.loadgen import constant  # noqa: E402
from deployments.cpu_placement import thread_ids  # noqa: E402

MODES = ("auto", "pin3")


@dataclass(frozen=True)
class CpuSample:
    """Cumulative seconds at ``t``: the engine's threads on a CPU and waiting runnable, and the
    engine's CPUs busy (anyone's work)."""

    t: float
    engine_on_s: float
    engine_wait_s: float
    cpus_busy_s: float


def shares(prev: CpuSample, now: CpuSample) -> dict[str, float]:
    """Per second between two samples: cores the engine used, seconds it waited on the run queue,
    and cores of its CPUs that other processes used (never below 0: the two counters tick apart)."""
    dt = now.t - prev.t
    if dt <= 0:
        raise ValueError(f"samples out of order: {prev.t} then {now.t}")
    on = (now.engine_on_s - prev.engine_on_s) / dt
    return {"engine_cores": round(on, 3),
            "engine_runq_wait_s_per_s": round((now.engine_wait_s - prev.engine_wait_s) / dt, 3),
            "others_cores": round(max(0.0, (now.cpus_busy_s - prev.cpus_busy_s) / dt - on), 3)}


def sample(pid: int, cpus: list[int], t: float) -> CpuSample:
    on = wait = 0
    for tid in thread_ids(pid):
        try:
            a, b = schedstat(pid, tid)
        except OSError:  # a thread that ended between the listing and the read
            continue
        on += a
        wait += b
    hz = os.sysconf("SC_CLK_TCK")
    busy = 0
    names = {f"cpu{c}" for c in cpus}
    with open("/proc/stat") as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] in names:
                ticks = [int(x) for x in parts[1:]]
                busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return CpuSample(t, on / 1e9, wait / 1e9, busy / hz)


class Sampler(threading.Thread):
    def __init__(self, pid: int, cpus: list[int], every_s: float) -> None:
        super().__init__(name="onset-sampler", daemon=True)
        self.pid, self.cpus, self.every_s = pid, cpus, every_s
        self.stop = threading.Event()
        self.rows: list[dict[str, float]] = []

    def run(self) -> None:
        t0 = time.monotonic()
        prev = sample(self.pid, self.cpus, 0.0)
        while not self.stop.wait(self.every_s):
            now = sample(self.pid, self.cpus, time.monotonic() - t0)
            self.rows.append({"t_s": round(now.t, 2), **shares(prev, now)})
            prev = now


class WindowPoller(threading.Thread):
    """Every ``every_s``, the model's speed reading and the kinds of step it rests on
    (``/healthz``: ``engine.engine_speed_window``, `policies.engine_speed.EngineSpeed.window`)."""

    def __init__(self, base: str, every_s: float) -> None:
        super().__init__(name="onset-window", daemon=True)
        self.base, self.every_s = base, every_s
        self.stop = threading.Event()
        self.rows: list[dict[str, Any]] = []

    def run(self) -> None:
        import httpx

        t0 = time.monotonic()
        with httpx.Client(base_url=self.base, headers=ov.HEADERS, timeout=5.0) as client:
            while not self.stop.wait(self.every_s):
                try:
                    engine = client.get("/healthz").json().get("engine") or {}
                except (httpx.HTTPError, ValueError):
                    continue
                self.rows.append({"t_s": round(time.monotonic() - t0, 2),
                                  "slowdown": (engine.get("engine_speed") or {}).get("slowdown"),
                                  "window": engine.get("engine_speed_window")})


def summary(polls: list[dict[str, Any]], cpu: list[dict[str, float]], first_s: float) -> dict[str, Any]:
    """The largest speed reading in the first ``first_s`` and after, and the engine's CPU figures
    over the same spans (means of the samples)."""
    def mean(rows: list[dict[str, float]], key: str) -> float | None:
        return round(sum(r[key] for r in rows) / len(rows), 3) if rows else None

    out: dict[str, Any] = {}
    for span, keep in ((f"first_{first_s:g}_s", lambda t: t < first_s), ("after", lambda t: t >= first_s)):
        ps = [p for p in polls if keep(p["t_s"])]
        cs = [c for c in cpu if keep(c["t_s"])]
        out[span] = {"max_reading": max((p["engine_slowdown"] for p in ps), default=None),
                     "min_reading": min((p["engine_slowdown"] for p in ps), default=None),
                     **{k: mean(cs, k) for k in ("engine_cores", "engine_runq_wait_s_per_s", "others_cores")}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, required=True, help="req/s of each onset (3 x C0: 17.5 on the 2-core Xeon)")
    ap.add_argument("--onsets", default="auto,auto,pin3,auto", help=f"comma-separated, each one of {', '.join(MODES)}")
    ap.add_argument("--calm-s", type=float, default=20.0, help="no load for this long before each onset")
    ap.add_argument("--seconds", type=float, default=12.0, help="load per onset")
    ap.add_argument("--first-s", type=float, default=3.0, help="the span the summary calls the onset")
    ap.add_argument("--sample-s", type=float, default=0.25)
    ap.add_argument("--slo-ms", type=float, default=2000.0)
    ap.add_argument("--seed", type=int, default=214)
    ap.add_argument("--out", default=str(ROOT / "bench/results/onset.json"))
    args = ap.parse_args(argv)
    onsets = [m.strip() for m in args.onsets.split(",") if m.strip()]
    bad = [m for m in onsets if m not in MODES]
    if bad or not onsets:
        ap.error(f"--onsets {args.onsets!r}: each must be one of {', '.join(MODES)}")
    if args.rate <= 0 or args.seconds <= 0 or args.calm_s < 0 or args.sample_s <= 0:
        ap.error("--rate, --seconds and --sample-s must be > 0, --calm-s >= 0")

    plan = ov.Plan(ov.build_parser().parse_args(
        ["--slo-ms", str(args.slo_ms), "--only", "adaptive", "--seed", str(args.seed), "--no-progress"]))
    bench = ov.Bench(plan)
    cluster = ov.Cluster(plan, f"onsets {','.join(onsets)} at {args.rate:g} req/s")
    t_start = time.monotonic()
    code = provenance.code_state()  # before anything is deployed: the code this run measures
    runs: list[dict[str, Any]] = []
    try:
        ov.deploy_unprotected(bench, cluster)
        iso = bench.cpu_placement["brownout"] or {}
        if not iso.get("active"):
            raise SystemExit(f"the engine has no CPUs of its own here ({iso.get('reason')}): nothing to tell apart")
        pid, cpus = iso["engine_pids"][0], list(iso["engine_cpus"])
        ov.warm_up(cluster.base, plan, True, "level 0", first=True)
        for k, mode in enumerate(onsets):
            ov.reset_policy(cluster.base, cluster.policy_doc)
            if mode == "pin3":
                ov.pin_level(cluster.base, 3)
            time.sleep(args.calm_s)
            sampler = Sampler(pid, cpus, args.sample_s)
            windows = WindowPoller(cluster.base, 2 * args.sample_s)
            sampler.start()
            windows.start()
            try:
                doc = bench.run(f"onset {k + 1} {mode}", "brownout-adaptive", cluster.base,
                                constant(args.rate, args.seconds), True)
            finally:
                sampler.stop.set()
                windows.stop.set()
                sampler.join()
                windows.join()
                if mode == "pin3":
                    ov.pin_level(cluster.base, None)
            polls = [{"t_s": a["t_s"], "in_flight": a["in_flight"], "engine_slowdown": a["engine_slowdown"],
                      "slowdown_applied": a["slowdown_applied"]} for a in doc["admission"]]
            o = doc["overall"]
            runs.append({"onset": k + 1, "mode": mode, "summary": summary(polls, sampler.rows, args.first_s),
                         "status_counts": o["status_counts"], "good_ratio": o["good_ratio"],
                         "e2e_p99_ms": o["e2e_ms"]["p99"],
                         "level_changes": [(t["t_s"], t["from"], t["to"]) for t in doc.get("transitions", [])],
                         "polls": polls, "cpu": sampler.rows, "speed_windows": windows.rows})
            ov.log(f"  onset {k + 1} {mode}: {json.dumps(runs[-1]['summary'])}")
    finally:
        from ray import serve

        serve.shutdown()
        cluster.close()
    out = {"meta": provenance.run_meta("bench/onset.py", sys.argv[1:] if argv is None else argv, code, t_start,
                                       ov.machine(), slo_ms=args.slo_ms, rate_rps=args.rate, calm_s=args.calm_s,
                                       seconds=args.seconds, engine_cpus=cpus),
           "onsets": runs}
    provenance.write_result(Path(args.out), out)
    ov.log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
