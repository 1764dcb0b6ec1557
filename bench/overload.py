"""The overload benchmark: Brownout adaptive, pinned at level 0, pinned at level 3, and Ray's
built-in ``ray.serve.llm`` OpenAI app, each alone on the machine in turn, in one command.

    .venv/bin/python bench/overload.py            # the whole comparison (25-30 min on 2 cores)
    .venv/bin/python bench/overload.py --quick    # the same, short (about 15 min): a smoke test
    .venv/bin/python bench/overload.py --only pinned0,adaptive    # some runs only
    .venv/bin/python bench/overload.py --url http://127.0.0.1:8000 --profile step --capacity 3.4
    .venv/bin/python bench/overload.py --calibrate-only --slo-ms 4000   # C0, C3 twice: repeatability.json
    .venv/bin/python bench/overload.py --adaptive-repeats 3   # adaptive 1.5x, 3x three times, C3 beside each
    .venv/bin/python bench/overload.py --only adaptive --step-only --step-repeats 6 --c3 12 --no-vllm-bench

It starts its own Ray cluster (``ray.init(address="local")``, a private temp dir, ended with
``ray.shutdown()``), deploys ``serve_config.yaml`` with ``serve deploy`` (only the HTTP port and
the data folder moved), and measures, with the open-loop generator of `bench.loadgen` (streamed
chat, ``max_tokens`` 16 with ``ignore_eos``, a 20/50/30 critical/standard/sheddable mix):

1. C0, the capacity at level 0 (pinned through the admin API: every optional feature on), then
   fixed loads of 1.5 x C0 and 3 x C0 at level 0;
2. C3, the capacity at level 3 (the minimal path), and the same fixed loads at level 3;
3. the adaptive policy (no pin) at 1.5 x C0 and 3 x C0, a step 0.5x -> 3x -> 0.5x of C0 (reaction
   time) and, without ``--quick``, a sine wave around C0 (level changes);
4. Ray's built-in OpenAI app (``build_openai_app``) on the same model folder and the engine
   settings of ``serve_config.yaml`` (max_num_seqs, max_model_len, enforce_eager, KV cache), after
   Brownout is shut down: its capacity and the same fixed loads.

One request at a time (ten, after each warm-up) is measured for each system; Brownout at level
0 once more just before it is shut down (`one_at_a_time_last`), and the level-0 / built-in
ratio takes that one, minutes from the built-in app's instead of the whole run (the first one
beside it). `bench/overhead.py` measures the same interleaved, the three apps in one cluster.

Capacity is the highest Poisson rate whose p99 end to end stays within the SLO (default
2000 ms) with at most 1% errors. Every calibration probe replays one fixed Poisson trace scaled
to its rate (common random numbers: probes and repeated calibrations differ by rate and server
only; prompts are new). A geometric ramp and a bisection to 25% with short probes (the first 12
arrivals, which hold the trace's worst burst; a probe passes when none of its requests is late
or failed) give a first guess; four whole-trace probes (24 arrivals, or what fits in 75 s) at
0.75-1.2 x that guess each measure a p99 as mean + 2.33 sd of their latencies (a normal fit:
of 24 latencies the empirical p99 is the largest, one request, as noisy as it), and the capacity
is where a least-squares line through those (rate, p99) points reaches the SLO. The first 2
arrivals of a probe are not judged; a probe that failed while other processes used > 0.3 CPU
cores is run again. ``--calibrate-only`` measures how well that repeats.

Before each adaptive run the policy is brought back to level 0 as on a fresh deploy: once no
trigger holds (the latency windows have emptied), a copy of the policy with zero dwell and
cooldown is applied until level 0 holds, then the deployed policy is restored; the run itself
uses the deployed policy unchanged. Level 0 must hold for three time constants of the
ingress's arrival-rate estimates (``admission.reserve_window_s``, 10 s: 30 s), so that what
the previous run offered has decayed to 5% and the run starts from a quiet service, not with
the previous run's demand still counted (a step run that began 9 s after a 3x run started at
level 2).

With ``--adaptive-repeats N`` the adaptive 1.5x and 3x loads run N times, each repeat after C3
is calibrated again beside it (`repeat_figures`: per repeat, medians, the 3x classes pooled);
with ``--c0-each-repeat`` C0 too, and each repeat's loads are 1.5 and 3 x its own C0. With
``--step-repeats N`` the step profile runs N times (a fresh draw each, after its own reset), and
``--step-only`` leaves out the other adaptive runs: whether the level stays at 0 through the
0.5 x C0 phase, and how soon it rises after the step, vary from one draw to the next
(`bench/step_levels.py` reads every step run of a result file).

Writes ``bench/results/overload.json`` (``overload_quick.json`` with ``--quick``) and one figure
next to it, and prints a table and the ratios the admission work is judged by.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import json
import logging
import math
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository importable, bench/ itself not on the
    # path (its secrets.py would shadow the standard library's `secrets`, which starlette imports)
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import httpx
import yaml

from bench import provenance
from bench import report as rep
from bench.loadgen import (
    DEFAULT_MIX,
    Calibration,
    Probe,
    Profile,
    RunResult,
    SloRule,
    calibrate_fit,
    constant,
    decisive_prefix,
    fit_p99,
    median_trace_seed,
    oscillate,
    parse_mix,
    run_load,
    run_seed,
    step,
    trace,
    unit_trace,
)
from bench.report import percentile

ROOT = Path(__file__).resolve().parents[1]
APP = "brownout"
MODEL = "brownout-tiny"
RUNS = ("pinned0", "pinned3", "adaptive", "builtin")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> dict[str, Any]:
    """The CPU (model, vector extensions: bfloat16 is native only with avx512_bf16 or amx_bf16),
    memory and platform: figures from different machines are not comparable."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model, "cpus": os.cpu_count(), "avx2": "avx2" in flags,
            "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- settings ----------------------------------------------------------------------------------

class Plan:
    """Durations and counts of one benchmark, full or ``--quick``."""

    def __init__(self, args: argparse.Namespace) -> None:
        quick = args.quick
        self.quick = quick
        self.slo = SloRule(slo_ms=args.slo_ms)
        # Budget: the full run must end within 30 min on 2 cores (sized from a --quick run's phases).
        # Calibration (see measure_capacity): every probe replays one fixed Poisson trace scaled
        # to its rate; coarse probes send its first coarse_n arrivals, fine ones all probe_n of
        # them, or as many as fit in max_probe_s (at least probe_s seconds' worth, if given);
        # the first warmup_n are not judged. Fine probes at spread x the coarse capacity.
        self.probe_n = getattr(args, "probe_n", None) or (16 if quick else 24)
        self.warmup_n = 2
        # ... and at least probe_s (fine) or coarse_s (coarse) seconds' worth: on a fast machine 24
        # arrivals at 30 req/s are a burst of 0.8 s that the engine's batch absorbs whole, and the
        # probe measures that transient, not the rate (measured on an AMX Xeon: "C0" 24.6 req/s
        # where vLLM's own benchmark completed 7.4 req/s and 37 req/s got no request within the SLO)
        self.probe_s = getattr(args, "probe_s", None) or (6.0 if quick else 15.0)
        self.coarse_s = getattr(args, "coarse_s", None) or (3.0 if quick else 6.0)
        self.max_probe_s = 40.0 if quick else 75.0
        self.coarse_tol = 0.25  # the coarse guess only centres the fine probes (0.75-1.2 x it)
        self.bisect_steps = args.bisect if getattr(args, "bisect", None) is not None else 4
        self.spread = (0.8, 1.0, 1.2) if quick else (0.75, 0.9, 1.05, 1.2)
        # a probe that failed while other processes used more than noisy_cores CPU cores is run
        # again (noise can only make a probe fail), at most noisy_repeats times per calibration
        self.noisy_cores, self.noisy_repeats = 0.3, 3
        trace_seed = getattr(args, "trace_seed", None)
        self.fresh_trace = bool(getattr(args, "fresh_trace", False))
        self.trace_seed = (None if self.fresh_trace
                           else trace_seed if trace_seed is not None else median_trace_seed(self.probe_n))
        # coarse probes: the shortest prefix of the trace that holds its worst burst
        self.coarse_n = getattr(args, "coarse_n", None) or (
            self.probe_n // 2 if self.trace_seed is None
            else decisive_prefix(unit_trace(self.trace_seed, self.probe_n), self.warmup_n, min_n=10))
        # Fixed-rate runs last 60 s: under overload a backlog grows by (offered - capacity) every
        # second, so what an unprotected service does shows only over time (a 25 s run at
        # 1.5 x C0 left pinned-0's p99 within the SLO); 60 s also gives each class of the 20/50/30
        # mix at 3 x C0 about 20 critical requests, not 9.
        self.run_s = args.run_s or (15.0 if quick else 60.0)
        # ... and long enough that the 3 x C0 run holds `MIN_CRITICAL` critical requests once C0 is
        # known (`size_runs`): on a slow machine (C0 1.26 req/s on a 2-core EPYC, 12-02) 60 s held
        # 45, where one late request is 2.2% and ">= 99% within the SLO" cannot be told from 97.8%.
        # --run-s fixes the length whatever C0 is.
        self.run_floor_s = self.run_s
        self.sizes_runs = not (args.run_s or quick)
        self.drain_s = args.drain_s or (10.0 if quick else 15.0)
        self.step_low_s, self.step_high_s = (10.0, 15.0) if quick else (15.0, 25.0)
        self.warm_s = 8.0 if quick else 10.0
        # The first warm-up after a deploy is longer: right after one, C0 came out about a third
        # below a second calibration on the same deployment while C3, measured later, repeated within 2%
        # (bench/results/repeatability.json): the server gets faster over its first few hundred
        # requests.
        self.first_warm_s = 20.0 if quick else 60.0
        self.oscillate = not quick
        repeats = getattr(args, "adaptive_repeats", None)
        self.adaptive_repeats = 1 if repeats is None else repeats
        if self.adaptive_repeats < 1:
            raise SystemExit(f"--adaptive-repeats: {self.adaptive_repeats}; give 1 or more")
        steps = getattr(args, "step_repeats", None)
        self.step_repeats = 1 if steps is None else steps
        if self.step_repeats < 1:
            raise SystemExit(f"--step-repeats: {self.step_repeats}; give 1 or more")
        self.step_only = bool(getattr(args, "step_only", False))
        if self.step_only and self.adaptive_repeats > 1:
            raise SystemExit(f"--step-only with --adaptive-repeats {self.adaptive_repeats}: the repeats are of "
                             "the 1.5x and 3x loads, which --step-only leaves out; give --step-repeats")
        if getattr(args, "c0_each_repeat", False):
            if self.adaptive_repeats < 2:
                raise SystemExit(f"--c0-each-repeat: measures C0 again before repeats 2 and on; "
                                 f"--adaptive-repeats is {self.adaptive_repeats}, give 2 or more")
            if getattr(args, "c0", None) is not None:
                raise SystemExit(f"--c0-each-repeat with --c0 {args.c0}: a given C0 is never measured again; "
                                 "give one or the other")
        self.max_tokens = args.max_tokens
        self.mix = None if args.no_mix else (parse_mix(args.mix) if args.mix else DEFAULT_MIX)
        self.seed = args.seed
        self.progress = not args.no_progress
        self.runs = tuple(x.strip() for x in args.only.split(",")) if args.only else RUNS
        unknown = sorted(set(self.runs) - set(RUNS))
        if unknown:
            raise SystemExit(f"--only: unknown run(s) {unknown}; choose from {list(RUNS)}")
        self._runs_per_label: dict[str, int] = {}  # `next_seed`
        # `schedule_seed`'s base: shared schedules are shared within one benchmark even without --seed
        self._schedule_base = self.seed if self.seed is not None else random.SystemRandom().randrange(2**32)

    def size_runs(self, c0: float) -> float:
        """Set (and return) the fixed-rate runs' length for this C0: `sized_run_s`, unless
        ``--run-s`` or ``--quick`` fixed it."""
        if self.sizes_runs:
            self.run_s = sized_run_s(self.run_floor_s, c0, self.mix)
        return self.run_s

    def next_seed(self, label: str) -> int | None:
        """The seed of one run or probe (its schedule and prompts): from ``--seed``, the run's
        label and how many runs of that label came before it (None without ``--seed``). Not a
        count of all runs so far: the calibration takes as many probes as its search needs, so
        with such a count a named run's schedule moved with the probes before it, and two
        ``--seed`` values one apart gave some runs the same schedule (measured: the first 3 x
        repeat of ``--seed 207`` and of ``--seed 208`` sent the same 499 requests)."""
        count = self._runs_per_label[label] = self._runs_per_label.get(label, 0) + 1
        if self.seed is None:
            return None
        digest = hashlib.sha256(f"{self.seed}\0{label}\0{count}".encode()).digest()
        return int.from_bytes(digest[:4], "big")

    def schedule_seed(self, schedule: str) -> int:
        """The seed of a schedule that several runs share on purpose: from ``--seed`` (without
        it, one drawn for this benchmark) and the schedule's name alone (e.g. ``"1.5x #1"``: the
        load and the repeat), so pinned level 0, pinned level 3, the adaptive policy and the built-in app at
        the same load send the very same requests at the very same times, and their ratios
        compare the systems, not two draws of the arrivals (`next_seed` gives every named run
        its own). Another repeat is another name, so repeats still differ."""
        digest = hashlib.sha256(f"{self._schedule_base}\0schedule\0{schedule}".encode()).digest()
        return int.from_bytes(digest[:4], "big")


MIN_CRITICAL = 100  # critical requests a 3 x C0 run must hold: one late one is then at most 1%
MAX_RUN_S = 300.0


def sized_run_s(floor_s: float, c0: float, mix: Sequence[tuple[str, float]] | None,
                min_critical: int = MIN_CRITICAL, max_s: float = MAX_RUN_S) -> float:
    """Seconds per fixed-rate run: at least ``floor_s``, and long enough that 3 x ``c0`` of
    arrivals holds ``min_critical`` critical requests (the mix's critical share; with no mix,
    every request counts), rounded up to 5 s, at most ``max_s``. The acceptance items are shares
    of requests (>= 99% of critical work, >= 95% at 1.5 x C0): with n requests one miss moves a
    share by 1/n, so n must be large enough for the line to be tellable."""
    share = dict(mix).get("critical", 0.0) if mix else 1.0
    if c0 <= 0 or share <= 0:
        return floor_s
    need = math.ceil(min_critical / (3.0 * c0 * share) / 5.0) * 5.0
    return float(min(max_s, max(floor_s, need)))


# -- other users of the machine ----------------------------------------------------------------

class NoiseMonitor(threading.Thread):
    """Samples, every ``interval_s``, the CPU (in cores) used by processes outside this command's
    own process tree (its Ray cluster included): other work on the machine, which a 2-core
    benchmark cannot ignore. `mean(t0, t1)` is attached to every run in the report."""

    def __init__(self, interval_s: float = 2.0) -> None:
        super().__init__(daemon=True, name="noise-monitor")
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []  # (monotonic s, cores used by others)
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        prev: dict[int, float] = {}
        prev_t = time.monotonic()
        while not self._stop_event.is_set():
            try:
                mine = {me.pid} | {c.pid for c in me.children(recursive=True)}
                now: dict[int, float] = {}
                for proc in psutil.process_iter(["pid", "cpu_times"]):
                    ct = proc.info["cpu_times"]
                    if ct is not None:
                        now[proc.info["pid"]] = ct.user + ct.system
                t = time.monotonic()
                if prev:
                    used = sum(v - prev[pid] for pid, v in now.items() if pid in prev and pid not in mine)
                    self.samples.append((t, max(0.0, used / (t - prev_t))))
                prev, prev_t = now, t
            except Exception:  # noqa: BLE001 - a missed sample is only a gap
                pass
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()

    def mean(self, t0: float, t1: float) -> float | None:
        xs = [v for t, v in self.samples if t0 <= t <= t1]
        return round(sum(xs) / len(xs), 2) if xs else None

    def wait_quiet(self, cores: float, hold_s: float = 6.0, timeout_s: float = 30.0) -> float:
        """Until other processes have used at most ``cores`` for ``hold_s`` (at most
        ``timeout_s``); returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            now = time.monotonic()
            recent = self.mean(now - hold_s, now)
            if recent is not None and recent <= cores and now - t0 >= hold_s:
                break
            time.sleep(1.0)
        return time.monotonic() - t0


NOISE = NoiseMonitor()


# -- talking to a running server ---------------------------------------------------------------

# The API key and admin token every request carries (`bench.credentials`): a private pair for the
# app this command deploys, or the environment's / `make serve`'s for --url. Ray's built-in app
# ignores them.
HEADERS: dict[str, str] = {}


def http(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=30, headers=HEADERS)


def wait_healthy(base: str, path: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    with http(base) as c:
        while time.monotonic() < deadline:
            try:
                r = c.get(path)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as err:
                last = repr(err)
            time.sleep(1)
    raise RuntimeError(f"{base}{path} not healthy after {timeout_s}s: {last}")


def wait_idle(base: str, brownout: bool, timeout_s: float = 30) -> None:
    """Until the model has nothing running or waiting (Brownout's /healthz), so that one probe's
    leftovers do not load the next; a fixed pause for a server without that endpoint."""
    if not brownout:
        time.sleep(3.0)
        return
    deadline = time.monotonic() + timeout_s
    with http(base) as c:
        while time.monotonic() < deadline:
            try:
                eng = c.get("/healthz").json().get("engine") or {}
                if not eng.get("inflight") and not eng.get("num_waiting_reqs") and not eng.get("num_running_reqs"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
    time.sleep(1.0)


def admin_state(base: str) -> dict[str, Any]:
    with http(base) as c:
        r = c.get("/admin/brownout")
        r.raise_for_status()
        return r.json()


def pin_level(base: str, level: int | None, ttl_s: float = 3600) -> None:
    """Pin the level through the admin API (None: release the pin); wait until the ingress has it."""
    with http(base) as c:
        if level is None:
            c.delete("/admin/brownout/override", params={"level": "true"}).raise_for_status()
        else:
            c.post("/admin/brownout/override",
                   json={"level": level, "ttl_s": ttl_s, "note": "overload benchmark"}).raise_for_status()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        st = admin_state(base)
        want = st.get("level") if level is None else level
        if st.get("ingress", {}).get("snapshot_level", st.get("level")) == want and st.get("level") == want:
            return
        time.sleep(0.25)
    raise RuntimeError(f"level pin {level} not in force after 15 s")


def transitions_since(base: str, wall0: float, origin: float) -> list[dict[str, Any]]:
    """The policy's level changes since ``wall0`` (on the actor's wall clock), each with the
    signal, value and threshold that caused it: which early signal raised a level. ``t_s`` counts
    from ``origin`` (the load's t = 0, `RunResult.started_at`), the clock of the run's profile,
    its load steps and its polled levels."""
    with http(base) as c:
        r = c.get("/admin/brownout/history", params={"n": 500})
    if r.status_code != 200:
        return [{"error": f"{r.status_code} {r.text[:200]}"}]
    out = []
    for t in r.json():
        if t["at"] < wall0:
            continue
        reason = t.get("reason") or {}
        out.append({"t_s": round(t["at"] - origin, 3), "from": t["from"], "to": t["to"],
                    **{k: reason[k] for k in ("kind", "signal", "value", "threshold") if k in reason}})
    return out


def set_admission(base: str, policy_doc: dict[str, Any], enabled: bool) -> None:
    """Apply the deployed policy with admission switched on or off (through the policy actor,
    which every ingress follows); wait until the ingress has it."""
    from policies.actor import get_policy_actor

    import ray

    doc = copy.deepcopy(policy_doc)
    doc["degradation"].setdefault("admission", {})["enabled"] = enabled
    result = ray.get(get_policy_actor().update_config.remote(doc))
    if not result.get("ok"):
        raise RuntimeError(f"policy with admission {'on' if enabled else 'off'} rejected: {result}")
    deadline = time.monotonic() + 15
    while admin_state(base).get("ingress", {}).get("admission", {}).get("enabled") is not enabled:
        if time.monotonic() > deadline:
            raise RuntimeError(f"admission not {'on' if enabled else 'off'} after 15 s")
        time.sleep(0.25)


def quiet_s(policy_doc: dict[str, Any]) -> float:
    """How long level 0 must hold before an adaptive run: three time constants of the arrival
    rates admission measures (the policy's ``admission.reserve_window_s``, else its default)."""
    from policies.config import AdmissionConfig

    admission = (policy_doc.get("degradation") or {}).get("admission") or {}
    return 3.0 * float(admission.get("reserve_window_s", AdmissionConfig().reserve_window_s))


def reset_policy(base: str, policy_doc: dict[str, Any], timeout_s: float = 180) -> float:
    """Bring the adaptive policy back to level 0 (see the module docstring); returns seconds taken."""
    from policies.actor import get_policy_actor

    import ray

    t0 = time.monotonic()
    pin_level(base, None)
    actor = get_policy_actor()
    fast = copy.deepcopy(policy_doc)
    for key, lvl in fast["degradation"].items():
        if key.startswith("level") and isinstance(lvl, dict):
            lvl["recover_dwell_s"] = 0
            lvl["cooldown_s"] = 0
    result = ray.get(actor.update_config.remote(fast))
    if not result.get("ok"):
        raise RuntimeError(f"fast-recovery policy rejected: {result}")
    hold_s = max(3.0, quiet_s(policy_doc))
    try:
        calm_since = None
        while time.monotonic() - t0 < timeout_s:
            st = admin_state(base)
            if st.get("level") == 0 and st.get("pin") is None:
                calm_since = calm_since or time.monotonic()
                if time.monotonic() - calm_since >= hold_s:
                    break
            else:
                calm_since = None
            time.sleep(0.5)
        else:
            raise RuntimeError(f"policy not back at level 0 after {timeout_s}s: {admin_state(base).get('signals')}")
    finally:
        result = ray.get(actor.update_config.remote(policy_doc))
        if not result.get("ok"):
            raise RuntimeError(f"deployed policy could not be restored: {result}")
    pin_level(base, None)
    return time.monotonic() - t0


# -- measuring ---------------------------------------------------------------------------------

def run_profile(base: str, profile: Profile, plan: Plan, label: str, *, stop: Any = None,
                drain_s: float | None = None, mix: Any = "plan", poll: bool = True,
                max_requests: int | None = None, arrivals: Any = None, schedule: str | None = None) -> RunResult:
    """One load run; its seed from ``schedule`` where runs share one (`Plan.schedule_seed`), else
    from its ``label`` (`Plan.next_seed`). Its prompts always follow its label: runs that share a
    schedule send other prompts, or the semantic cache (on at level 0) would answer the later
    run's requests from the earlier's."""
    seed = label_seed = plan.next_seed(label)
    prompt_seed = None
    if schedule is not None:
        seed, prompt_seed = plan.schedule_seed(schedule), label_seed if label_seed is not None else run_seed()
    return asyncio.run(run_load(
        base, MODEL, profile, seed=seed, prompt_seed=prompt_seed, arrivals=arrivals,
        mix=plan.mix if mix == "plan" else mix,
        max_requests=max_requests,
        max_tokens=plan.max_tokens, drain_timeout_s=plan.drain_s if drain_s is None else drain_s,
        stop=stop, poll_levels_s=0.5 if poll else None, progress=label if plan.progress else None,
        headers=HEADERS))


def probe_size(plan: Plan, rate: float, stage: str) -> int:
    """Arrivals a probe sends: a prefix of the trace (coarse, at least ``coarse_s`` seconds'
    worth) or all of it (fine), cut to what fits in ``max_probe_s`` but never below the coarse
    prefix, and at least ``probe_s`` seconds' worth (a fast server at a high rate: the trace is
    extended)."""
    if stage == "coarse":
        return max(plan.coarse_n, math.ceil(plan.coarse_s * rate))
    if plan.probe_s * rate > plan.probe_n:
        return math.ceil(plan.probe_s * rate)
    return max(plan.coarse_n, min(plan.probe_n, math.floor(plan.max_probe_s * rate)))


def judge(rule: SloRule, records: Sequence[Any], warmup_n: int) -> tuple[bool, int, int]:
    """(passed, late, errors) of a probe: the rule over every request after the first
    ``warmup_n`` (which run into an idle server and are sent, not judged)."""
    judged = records[warmup_n:]
    late = sum(1 for r in judged if r.ok and (r.e2e_ms or 0.0) > rule.slo_ms)
    return rule.passed(judged), late, sum(1 for r in judged if not r.ok)


def measure_capacity(base: str, plan: Plan, label: str, start_rps: float, growth: float,
                     brownout: bool, spread: Sequence[float] | None = None) -> Calibration:
    """The rate at which the p99 end to end crosses the SLO (`bench.loadgen.calibrate_fit`).

    Every probe replays the same Poisson trace (``plan.trace_seed``: median burstiness among 41
    seeds; fresh per probe with ``--fresh-trace``) scaled to its rate, with new prompts: two
    probes, or two calibrations, differ by their rate and the server only, not by the luck of
    the draw. Coarse probes (a prefix of the trace) pass when no judged request failed or was
    late and stop as soon as one is; fine probes (all of it) measure the p99 of a normal fit of
    the judged latencies and stop only at an error or a request twice the SLO old. A probe that
    failed while other processes used more than ``plan.noisy_cores`` CPU cores is run once more,
    when they have calmed down (up to 30 s), and the second try counts (at most
    ``plan.noisy_repeats`` times per calibration).
    """
    rule = plan.slo
    repeats = [0]
    warm = plan.warmup_n

    def measure(rate: float, stage: str) -> Probe:
        n = probe_size(plan, rate, stage)
        probe = probe_once(rate, n, stage, False)
        noisy = probe.other_cpu_cores is not None and probe.other_cpu_cores > plan.noisy_cores
        if not probe.passed and noisy and repeats[0] < plan.noisy_repeats:
            repeats[0] += 1
            waited = NOISE.wait_quiet(plan.noisy_cores)
            log(f"  other processes used {probe.other_cpu_cores} cores during that failed probe: once more "
                f"(after {waited:.0f} s waiting for them to calm down)")
            probe = probe_once(rate, n, stage, True)
        return probe

    def certainly_failed(recs: Sequence[Any], now: float, planned: int) -> bool:
        return rule.certainly_failed(recs[warm:], now, planned - warm)

    def far_gone(recs: Sequence[Any], now: float, planned: int) -> bool:
        judged = recs[warm:]
        return (any(r.done_s is not None and not r.ok for r in judged)
                or any(r.done_s is None and (now - r.scheduled_s) * 1000.0 > 2 * rule.slo_ms for r in judged))

    def probe_once(rate: float, n: int, stage: str, repeated: bool) -> Probe:
        seed = run_seed() if plan.trace_seed is None else plan.trace_seed
        arrivals = trace(rate, n, seed)
        profile = constant(rate, arrivals[-1].at_s + 1e-3)
        t0 = time.monotonic()
        if stage == "coarse":
            stop, drain_s = certainly_failed, rule.slo_ms / 1000 + 1.0
        else:
            stop, drain_s = far_gone, 2 * rule.slo_ms / 1000 + 1.0
        result = run_profile(base, profile, plan, f"{label} {stage} {rate:.3f}/s", arrivals=arrivals, stop=stop,
                             drain_s=drain_s, mix=None, poll=False)
        noise = NOISE.mean(t0, time.monotonic())
        recs = result.records
        passed, late, errors = judge(rule, recs, warm)
        e2e = [r.e2e_ms for r in recs[warm:] if r.ok and r.e2e_ms is not None]
        fit = None
        if stage == "fine":
            fit = fit_p99(e2e) if not errors and not result.stopped_early else None
            passed = fit is not None and fit <= rule.slo_ms
        else:
            passed = passed and not result.stopped_early
        probe = Probe(round(rate, 4), passed, len(recs), errors,
                      None if not e2e else round(percentile(e2e, 99) or 0, 1), result.stopped_early, stage, late,
                      None if not e2e else round(max(e2e), 1), noise, repeated, None if fit is None else round(fit, 1))
        log(f"  {label} {stage:6s} probe {rate:6.3f} req/s: {'pass' if passed else 'FAIL'}  n={probe.requests}/{n} "
            f"late={late} errors={errors} max={probe.max_e2e_ms} ms"
            + (f" fit p99={probe.p99_fit_ms} ms" if stage == "fine" else "")
            + f" (others {noise} cores){' (stopped early)' if probe.stopped_early else ''}"
            + (f"; first error: {first_error(recs[warm:])}" if errors else ""))
        wait_idle(base, brownout)
        return probe

    t0 = time.monotonic()
    cal = calibrate_fit(lambda r: measure(r, "coarse"), lambda r: measure(r, "fine"), start_rps,
                        target_ms=rule.slo_ms, growth=growth, coarse_tol=plan.coarse_tol,
                        coarse_steps=plan.bisect_steps, spread=spread or plan.spread)
    log(f"{label} capacity: {cal.capacity_rps:.3f} req/s ({len(cal.probes)} probes, {time.monotonic() - t0:.0f} s)")
    return cal


VLLM_BENCH_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                   "mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "p99_e2el_ms")


def vllm_bench_args(base: str, num_prompts: int, rate_rps: float, seed: int) -> list[str]:
    """The `vllm bench serve` command line the README shows, against ``base``."""
    return ["--backend", "openai-chat", "--base-url", base, "--endpoint", "/v1/chat/completions",
            "--model", MODEL, "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", "16", "--ignore-eos", "--num-prompts", str(num_prompts),
            "--request-rate", f"{rate_rps:.2f}", "--top-k", "20", "--seed", str(seed),
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99"]


def vllm_bench_serve(base: str, tmp: Path, plan: Plan, num_prompts: int, rate_rps: float) -> dict[str, Any]:
    """Run vLLM's own benchmark client against the server (unchanged) and keep its summary."""
    seed = plan.next_seed("vllm bench serve")
    seed = int(time.time()) if seed is None else seed
    cmd = [sys.executable, str(ROOT / "bench" / "vllm_bench_serve.py"),
           *vllm_bench_args(base, num_prompts, rate_rps, seed),
           "--save-result", "--result-dir", str(tmp), "--result-filename", "vllm_bench.json"]
    log(f"vllm bench serve: {num_prompts} prompts at {rate_rps:.2f} req/s")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    path = tmp / "vllm_bench.json"
    if out.returncode != 0 or not path.exists():
        log(f"  vllm bench serve failed (rc {out.returncode}): {out.stderr[-2000:]}")
        return {"ok": False, "returncode": out.returncode, "stderr_tail": out.stderr[-2000:]}
    result = json.loads(path.read_text())
    summary = {k: result.get(k) for k in VLLM_BENCH_KEYS}
    log(f"  vllm bench serve: {summary}")
    return {"ok": result.get("completed") == num_prompts, "args": vllm_bench_args("BASE", num_prompts, rate_rps, seed),
            **summary}


def first_error(records: Sequence[Any]) -> str:
    bad = next((r for r in records if not r.ok), None)
    return "" if bad is None else f"status {bad.status} {(bad.error or '')[:120]}"


UNLOADED_N = 10  # requests one at a time after each warm-up: the "one at a time" figures
LAST_LEVEL0 = "brownout level 0, last"  # `one_at_a_time_last`: the built-in app's counterpart


def warm_up(base: str, plan: Plan, brownout: bool, label: str, first: bool = False) -> dict[str, Any]:
    """Load first (the first batches after a deploy are slow: ``first`` loads longer), then the
    unloaded latency: ``UNLOADED_N`` requests one at a time (four gave a median that moved by
    a third between runs). Returns (and logs) the latter; the capacity cannot beat it."""
    seconds = plan.first_warm_s if first else plan.warm_s
    burst = run_profile(base, constant(2.0, seconds), plan, f"{label} warm-up", drain_s=60, mix=None, poll=False)
    wait_idle(base, brownout)
    alone, said = _one_at_a_time(base, plan, label)
    doc = {"warm_up_ok": sum(1 for r in burst.records if r.ok), "warm_up_requests": len(burst.records),
           # what the others got: a warm-up request not answered 200 is a finding, not noise
           "warm_up_status": rep.status_counts(burst.records), **alone}
    log(f"{label} warm-up: {doc['warm_up_ok']}/{doc['warm_up_requests']} ok"
        + (f" ({first_error(burst.records)})" if doc["warm_up_ok"] < doc["warm_up_requests"] else "")
        + f"; {said}")
    wait_idle(base, brownout)
    return doc


def _one_at_a_time(base: str, plan: Plan, label: str) -> tuple[dict[str, Any], str]:
    """``UNLOADED_N`` requests one at a time: the ``unloaded_*`` figures and a line for the log."""
    singles: list[Any] = []
    for _ in range(UNLOADED_N):
        singles += run_profile(base, constant(1000.0, 1.0), plan, f"{label} unloaded", drain_s=60, mix=None,
                               poll=False, max_requests=1).records
    e2e = [r.e2e_ms for r in singles if r.ok and r.e2e_ms is not None]
    ttft = [r.ttft_ms for r in singles if r.ok and r.ttft_ms is not None]
    doc = {"unloaded_e2e_ms_p50": None if not e2e else round(percentile(e2e, 50) or 0, 1),
           "unloaded_ttft_ms_p50": None if not ttft else round(percentile(ttft, 50) or 0, 1),
           "unloaded_requests": len(singles), "unloaded_ok": len(e2e)}
    return doc, (f"unloaded (one at a time): e2e p50 {doc['unloaded_e2e_ms_p50']} ms, TTFT p50 "
                 f"{doc['unloaded_ttft_ms_p50']} ms" + (f"; {first_error(singles)}" if len(e2e) < len(singles) else ""))


def one_at_a_time_last(base: str, plan: Plan) -> dict[str, Any]:
    """Brownout at level 0 one request at a time once more, its service warm, just before it
    makes way for the built-in app: the figure the built-in app's is compared with, minutes
    apart instead of the whole run (in seed 221 the two were 19 minutes apart and read 1.117 x)."""
    pin_level(base, 0)
    wait_idle(base, True, timeout_s=60)
    doc, said = _one_at_a_time(base, plan, LAST_LEVEL0)
    log(f"{LAST_LEVEL0}: {said}")
    return doc


def calibration_doc(cal: Calibration) -> dict[str, Any]:
    return {"capacity_rps": round(cal.capacity_rps, 3), "bracketed": cal.bracketed,
            "upper_rps": None if cal.upper_rps is None else round(cal.upper_rps, 3),
            "probes": [p.__dict__ for p in cal.probes]}


class Bench:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.runs: list[dict[str, Any]] = []
        self.raw: list[dict[str, Any]] = []
        self.capacity: dict[str, Any] = {}
        self.phases: dict[str, float] = {}
        self.vllm_bench: dict[str, Any] | None = None
        self.unloaded: dict[str, Any] = {}
        # where the engine computed (`deployments.cpu_placement`, from /healthz) and the Ray
        # node's CPUs once Brownout was shut down, before the built-in app ran on the same node
        self.cpu_placement: dict[str, Any] = {}

    def run(self, name: str, system: str, base: str, profile: Profile, brownout: bool, mix: Any = "plan",
            schedule: str | None = None, **extra: Any) -> dict[str, Any]:
        """One load run (``mix``: the plan's criticality mix, another mix, or None for no header:
        every request at the benchmark key's tier; ``schedule``: the name of a schedule it shares
        with the other systems' runs at its load, `Plan.schedule_seed`, kept in its report)."""
        log(f"run {name}: {profile.name}")
        t0, wall0 = time.monotonic(), time.time()
        result = run_profile(base, profile, self.plan, name, mix=mix, schedule=schedule)
        if schedule is not None:
            extra["schedule"] = schedule
        noise = NOISE.mean(t0, time.monotonic())
        doc = rep.run_report(name, result, self.plan.slo.slo_ms, system=system, other_cpu_cores=noise, **extra)
        if system == "brownout-adaptive" or (system == "url" and brownout):  # a running Brownout's too
            doc["transitions"] = transitions_since(base, wall0, result.started_at)
        o = doc["overall"]
        log(f"  {name}: offered {o['offered_rps']} goodput {o['goodput_rps']} req/s, p99 {o['e2e_ms']['p99']} ms, "
            f"status {o['status_counts']}, max level {o['max_level_seen']}, other processes used {noise} cores")
        self.runs.append(doc)
        self.raw.append({"name": name, "records": [r.to_dict() for r in result.records], "levels": result.levels})
        self.last_records = result.records
        wait_idle(base, brownout)
        return doc

    def timed(self, phase: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            self.phases[phase] = round(time.monotonic() - t0, 1)


# -- the cluster -------------------------------------------------------------------------------

def serve_config(http_port: int, data_dir: Path) -> dict[str, Any]:
    """serve_config.yaml, unchanged but for the HTTP port, a private data folder and a private
    API key and admin token (`bench.credentials`: limits far above any benchmark rate)."""
    from bench.credentials import local_secrets

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = http_port
    args = config["applications"][0]["args"]
    args["enrichments"]["data_dir"] = str(data_dir)
    auth, headers = local_secrets(data_dir.parent / "secrets")
    args["auth"] = {**args.get("auth", {}), **auth}
    HEADERS.update(headers)
    # `vllm bench serve` (openai-chat backend) sends OPENAI_API_KEY as its bearer token
    os.environ["OPENAI_API_KEY"] = headers["Authorization"].removeprefix("Bearer ")
    return config


def ingress_policy(config: dict[str, Any]) -> dict[str, Any]:
    (ingress,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "Ingress"]
    return ingress["user_config"]["policy"]


def wait_app(name: str, timeout_s: float = 600) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        if app is not None and app.status == "RUNNING":
            return
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy of {name} failed: {app.message}")
        time.sleep(1)
    raise RuntimeError(f"{name} not RUNNING after {timeout_s}s")


def deploy_brownout(dashboard_url: str, config: dict[str, Any], tmp: Path) -> None:
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = subprocess.run([str(Path(sys.executable).parent / "serve"), "deploy", str(path), "--address", dashboard_url],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"serve deploy failed: {out.stderr}{out.stdout}")
    wait_app(APP)


def deploy_builtin(http_port: int, config: dict[str, Any]) -> None:
    """Ray's built-in OpenAI app with the engine settings of serve_config.yaml's model args."""
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from bench.engine_batch import direct_engine, engine_settings
    from deployments.tiny_model import ensure_tiny_model

    m = config["applications"][0]["args"]["model"]
    engine = direct_engine(engine_settings(m))  # the same engine settings, or the comparison is not fair
    cfg = LLMConfig(
        model_loading_config={"model_id": m["served_model_name"], "model_source": str(ensure_tiny_model())},
        accelerator_config={"kind": "cpu"},
        engine_kwargs=engine,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(m["kv_cache_space_gib"])}},
    )
    # On 2 cores its ingress must not reserve a CPU, or the app never schedules (FACTS).
    app = build_openai_app({"llm_configs": [cfg], "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    serve.run(app, name="builtin", route_prefix="/", blocking=False)
    # ray.serve.llm leaves this process's logging at INFO, and httpx logs every request of the
    # load generator at INFO: one JSON line per request in the benchmark's output (956 lines in
    # one run on 12-03), and formatting work in the process that sends the load
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    wait_app("builtin")


class Cluster:
    """A private local Ray cluster (temp dir, free ports) and the config to deploy on it.
    ``plan``: its SLO is set in the config's policy; None leaves the policy as shipped."""

    def __init__(self, plan: Plan | None, what: str) -> None:
        import ray

        self.tmp = Path(tempfile.mkdtemp(prefix="bo-overload-"))
        self.http_port, self.dash_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.dashboard = f"http://127.0.0.1:{self.dash_port}"
        self.config = serve_config(self.http_port, self.tmp / "data")
        self.policy_doc = ingress_policy(self.config)
        if plan is not None and "slo" in self.policy_doc["degradation"]:
            # The server holds the SLO the benchmark judges by: admission and the derived levels
            # aim at the same objective as the goodput figures.
            self.policy_doc["degradation"]["slo"]["e2e_p99_ms"] = plan.slo.slo_ms
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        slo = "" if plan is None else f"; SLO p99 e2e {plan.slo.slo_ms:g} ms"
        log(f"Ray cluster (private, {self.tmp.name}); {what}{slo}")
        # 4 logical CPUs: the built-in app needs its engine, router and ingress; one app at a time.
        ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
                 dashboard_port=self.dash_port, _temp_dir=str(self.tmp / "ray"), log_to_driver=False)

    def close(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(self.tmp, ignore_errors=True)


def raylet_cpus() -> dict[str, Any]:
    """The CPUs of this command's raylet (its child: `Cluster` starts Ray locally) and the node's:
    equal once Brownout's model replica gave back what its CPU isolation moved."""
    from deployments import cpu_placement as cp

    raylets = cp.children_named(cp.parent_map(), os.getpid(), "raylet")
    return {"raylet": [list(cp.process_cpus(p) or ()) for p in raylets], "node": list(cp.node_cpus())}


def deploy_unprotected(bench: Bench, cluster: Cluster) -> None:
    """`serve deploy` Brownout, wait until it answers, and switch admission off. Pinned runs and
    calibrations measure Brownout without admission control (features on or off, every request
    admitted): the service as it was before it held the SLO. The adaptive runs get the policy as
    deployed, admission on (`reset_policy`)."""
    log("deploying Brownout (serve deploy serve_config.yaml)")
    bench.timed("deploy_brownout", lambda: deploy_brownout(cluster.dashboard, cluster.config, cluster.tmp))
    wait_healthy(cluster.base, "/healthz")
    set_admission(cluster.base, cluster.policy_doc, enabled=False)
    with http(cluster.base) as c:
        bench.cpu_placement["brownout"] = (c.get("/healthz").json().get("engine") or {}).get("cpu_isolation")


def calibrate_pair(bench: Bench, base: str, plan: Plan, suffix: str = "",
                   c0_given: float | None = None, first: bool = True) -> tuple[float, dict[str, Any]]:
    """Level 0 pinned: warm up (longer if ``first`` after the deploy), calibrate C0 (unless
    given); returns C0 and the unloaded figures."""
    pin_level(base, 0)
    unloaded = bench.timed(f"warm_up_level0{suffix}", lambda: warm_up(
        base, plan, True, f"Brownout level 0{suffix}", first=first))
    if c0_given is not None:
        bench.capacity[f"C0{suffix}"] = {"capacity_rps": c0_given, "given": True}
        return c0_given, unloaded
    cal = bench.timed(f"calibrate_c0{suffix}", lambda: measure_capacity(base, plan, f"C0{suffix} (level 0)", 1.0,
                                                                        2.0, True))
    bench.capacity[f"C0{suffix}"] = calibration_doc(cal)
    return cal.capacity_rps, unloaded


def calibrate_c3(bench: Bench, base: str, plan: Plan, c0: float, suffix: str = "") -> tuple[float, dict[str, Any]]:
    """Level 3 pinned: warm up, calibrate C3 (the ramp starts at 1.25 x C0)."""
    pin_level(base, 3)
    unloaded = bench.timed(f"warm_up_level3{suffix}", lambda: warm_up(base, plan, True, f"Brownout level 3{suffix}"))
    cal = bench.timed(f"calibrate_c3{suffix}", lambda: measure_capacity(
        base, plan, f"C3{suffix} (level 3)", 1.25 * c0 if c0 > 0 else 1.0, 1.5, True))
    bench.capacity[f"C3{suffix}"] = calibration_doc(cal)
    return cal.capacity_rps, unloaded


def rel_diff(values: Sequence[float]) -> float | None:
    """(max - min) / min: how far apart repeated measurements are, relative to the smaller."""
    if not values or min(values) <= 0:
        return None
    return round((max(values) - min(values)) / min(values), 4)


def calibrate_only(args: argparse.Namespace) -> int:
    """Deploy once; calibrate C0 and C3 ``--repeats`` times back to back (admission off, as the
    comparison's calibrations); write ``repeatability.json``: both pairs, their relative
    differences."""
    plan = Plan(args)
    bench = Bench(plan)
    t_start = time.monotonic()
    NOISE.start()
    cluster = Cluster(plan, f"calibration only, {args.repeats} x (C0, C3)")
    base = cluster.base
    pairs: list[dict[str, Any]] = []
    try:
        deploy_unprotected(bench, cluster)
        for i in range(1, args.repeats + 1):
            t0 = time.monotonic()
            c0, unloaded0 = calibrate_pair(bench, base, plan, f" #{i}", first=i == 1)
            c3, unloaded3 = calibrate_c3(bench, base, plan, c0, f" #{i}")
            pairs.append({"repeat": i, "C0_rps": round(c0, 3), "C3_rps": round(c3, 3),
                          "C0": bench.capacity[f"C0 #{i}"], "C3": bench.capacity[f"C3 #{i}"],
                          "unloaded": {"level 0": unloaded0, "level 3": unloaded3},
                          "wall_s": round(time.monotonic() - t0, 1),
                          "other_cpu_cores": NOISE.mean(t0, time.monotonic())})
            log(f"repeat {i}: C0 {c0:.3f}, C3 {c3:.3f} req/s in {(time.monotonic() - t0) / 60:.1f} min")
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - keep what was measured
        failed = f"{type(err).__name__}: {err}"
        log(f"FAILED: {failed}")
    else:
        failed = None
    finally:
        cluster.close()
    total_s = time.monotonic() - t_start
    diffs = {k: rel_diff([p[f"{k}_rps"] for p in pairs]) if len(pairs) > 1 else None for k in ("C0", "C3")}
    doc = {
        "what": (f"C0 and C3 calibrated {args.repeats} times back to back on one deployment (level pinned through "
                 "the admin API, admission off), to show how far apart two runs of the calibration land"),
        "meta": meta(plan, args, total_s, bench.phases),
        "failed": failed,
        "pairs": [{k: p[k] for k in ("repeat", "C0_rps", "C3_rps", "wall_s", "other_cpu_cores")} for p in pairs],
        "relative_difference": diffs,
        "relative_difference_rule": "(max - min) / min over the repeats",
        "within_20pct": {k: None if v is None else v <= 0.20 for k, v in diffs.items()},
        "calibrations": pairs,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name or 'repeatability'}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print()
    for p in pairs:
        print(f"repeat {p['repeat']}: C0 {p['C0_rps']:.3f} req/s, C3 {p['C3_rps']:.3f} req/s "
              f"({p['wall_s'] / 60:.1f} min, other processes {p['other_cpu_cores']} cores)")
    print(f"relative difference ((max - min) / min): C0 {diffs['C0']}, C3 {diffs['C3']}")
    print_phases(bench.phases, total_s)
    log(f"wrote {path} in {total_s / 60:.1f} min")
    return 1 if failed else 0


ONE_CLASS_SUFFIX = " standard"  # the suffix of the one-class run
ONE_CLASS = (("critical", 0.0), ("standard", 1.0), ("sheddable", 0.0))


def one_class_run(rate: float, plan: Plan, repeat: int = 1) -> tuple[str, Profile, dict[str, Any]]:
    """The adaptive 1.5x load with one class: every request sends ``X-Brownout-Criticality:
    standard`` (the shipped policy's ``slo.default_class``; without a header a request is served
    at its key's tier, and the benchmark's key is critical so that its header can name every
    class). Issue 10's acceptance names the 20/50/30 mix for one 3x item, and judges 1.5x
    without it; with the mix the door also sheds sheddable work first at 1.5x, by design. Both
    are reported."""
    extra: dict[str, Any] = {"load": "1.5x", "mix": ONE_CLASS, "criticality": "standard"}
    if repeat > 1:
        extra["repeat"] = repeat
    return (f"adaptive @1.5x{ONE_CLASS_SUFFIX}" + (f" #{repeat}" if repeat > 1 else ""), constant(rate, plan.run_s), extra)


def adaptive_runs(plan: Plan, c0: float, loads: dict[str, float]) -> list[tuple[str, Profile, dict[str, Any]]]:
    """The first repeat's adaptive runs, in order: 1.5x, 1.5x of one class (with a mix), 3x, the
    step profile ``plan.step_repeats`` times and, unless ``--quick``, the oscillation; with
    ``--step-only`` the step profiles alone."""
    todo: list[tuple[str, Profile, dict[str, Any]]] = [] if plan.step_only else [
        (f"adaptive @{tag}", constant(rate, plan.run_s), {"load": tag, "schedule": f"{tag} #1"})
        for tag, rate in loads.items()]
    if plan.mix and not plan.step_only:  # issue 10 names the mix for one 3x item only: 1.5x also with one class
        todo.insert(1, one_class_run(loads["1.5x"], plan))
    todo.append(("adaptive step", step(c0, plan.step_low_s, plan.step_high_s), {"load": "step"}))
    # each a fresh draw after its own reset to level 0: whether the level rises before the step,
    # and how soon after it, varies from one draw of the arrivals to the next
    todo += [(f"adaptive step #{k}", step(c0, plan.step_low_s, plan.step_high_s), {"load": "step", "repeat": k})
             for k in range(2, plan.step_repeats + 1)]
    if plan.oscillate and not plan.step_only:
        todo.append(("adaptive oscillate", oscillate(c0, 0.5 * c0, 30.0, 60.0), {"load": "oscillate"}))
    return todo


def run_adaptive(bench: Bench, base: str, policy_doc: dict[str, Any],
                 todo: Sequence[tuple[str, Profile, dict[str, Any]]]) -> None:
    """Run each adaptive profile in ``todo``, in order, each after `reset_policy`."""
    for name, profile, extra in todo:
        log(f"resetting the policy to level 0 before {name}")
        took = bench.timed(f"reset_{name}", lambda: reset_policy(base, policy_doc))
        log(f"  reset took {took:.0f} s")
        bench.timed(name, lambda name=name, profile=profile, extra=extra: bench.run(
            name, "brownout-adaptive", base, profile, True, **extra))


def comparison(args: argparse.Namespace) -> int:
    from ray import serve

    plan = Plan(args)
    bench = Bench(plan)
    t_start = time.monotonic()
    NOISE.start()
    cluster = Cluster(plan, f"runs: {', '.join(plan.runs)}")
    tmp, http_port, base = cluster.tmp, cluster.http_port, cluster.base
    config, policy_doc = cluster.config, cluster.policy_doc
    c0 = args.c0
    c3 = args.c3
    try:
        brownout_runs = [r for r in plan.runs if r != "builtin"]
        if brownout_runs or c0 is None:
            deploy_unprotected(bench, cluster)
            c0, bench.unloaded["brownout level 0"] = calibrate_pair(bench, base, plan, c0_given=c0)
            if c0 <= 0:
                raise RuntimeError(
                    f"C0 is 0: no probe met the SLO ({plan.slo.slo_ms:g} ms) with level 0 pinned; one request "
                    f"alone takes {bench.unloaded.get('brownout level 0', {}).get('unloaded_e2e_ms_p50')} ms end "
                    "to end here. Check the machine is quiet, or give --slo-ms above that figure.")
            loads = {"1.5x": 1.5 * c0, "3x": 3.0 * c0}
            log(f"fixed-rate runs last {plan.size_runs(c0):g} s")
            if "pinned0" in plan.runs:
                for tag, rate in loads.items():
                    bench.timed(f"pinned0_{tag}", lambda tag=tag, rate=rate: bench.run(
                        f"pinned0 @{tag}", "brownout-level0", base, constant(rate, plan.run_s), True,
                        schedule=f"{tag} #1", load=tag))
            if not args.no_vllm_bench:
                # about 30 s (quick) or 60 s of load at half of C0, 8 to 40 prompts
                prompts = max(8, min(40, round(0.5 * c0 * (30 if plan.quick else 60))))
                bench.vllm_bench = bench.timed("vllm_bench_serve", lambda: vllm_bench_serve(
                    base, tmp, plan, num_prompts=prompts, rate_rps=0.5 * c0))
            if "pinned3" in plan.runs or (c3 is None and "adaptive" in plan.runs and not plan.step_only):
                if c3 is None:
                    c3, bench.unloaded["brownout level 3"] = calibrate_c3(bench, base, plan, c0)
                else:
                    pin_level(base, 3)
                    bench.unloaded["brownout level 3"] = warm_up(base, plan, True, "Brownout level 3")
                if "pinned3" in plan.runs:
                    for tag, rate in loads.items():
                        bench.timed(f"pinned3_{tag}", lambda tag=tag, rate=rate: bench.run(
                            f"pinned3 @{tag}", "brownout-level3", base, constant(rate, plan.run_s), True,
                            schedule=f"{tag} #1", load=tag))
            if c3 is not None and "C3" not in bench.capacity:
                bench.capacity["C3"] = {"capacity_rps": c3, "given": True}
            if "adaptive" in plan.runs:
                run_adaptive(bench, base, policy_doc, adaptive_runs(plan, c0, loads))
                c0_again = getattr(args, "c0_each_repeat", False)  # never with --c0 (`Plan`)
                c0_now = c0  # the C0 this repeat's loads come from (the first, unless measured again)
                for k in range(2, plan.adaptive_repeats + 1):
                    # C3 again beside each repeat (admission off, level 3 pinned, as the first): the
                    # machine's speed drifts over a run, and the 3x figure is judged against C3
                    if args.c3 is None or c0_again:
                        set_admission(base, policy_doc, enabled=False)
                    if c0_again:
                        # and C0, so the loads are 1.5 and 3 x what level 0 serves now: on 12-06 the
                        # Xeon's C3 fell 15.3 -> 11.4 req/s within 25 min under a C0 measured once,
                        # and the 1.5x load grew from 1.05 to 1.41 x C3
                        c0_k, _ = calibrate_pair(bench, base, plan, suffix=f" #{k}", first=False)
                        if c0_k > 0:  # else the loads stay as they were
                            c0_now, loads = c0_k, {"1.5x": 1.5 * c0_k, "3x": 3.0 * c0_k}
                            plan.size_runs(c0_k)
                    if args.c3 is None:
                        calibrate_c3(bench, base, plan, c0_now, suffix=f" #{k}")
                    todo = [(f"adaptive @{tag} #{k}", constant(rate, plan.run_s),
                             {"load": tag, "repeat": k, "schedule": f"{tag} #{k}"}) for tag, rate in loads.items()]
                    if plan.mix:
                        todo.insert(1, one_class_run(loads["1.5x"], plan, k))
                    run_adaptive(bench, base, policy_doc, todo)
            if "builtin" in plan.runs:
                bench.unloaded[LAST_LEVEL0] = bench.timed("one_at_a_time_level0_last",
                                                          lambda: one_at_a_time_last(base, plan))
            log("shutting Brownout down")
            serve.shutdown()
            bench.cpu_placement["raylet_cpus_after_shutdown"] = raylet_cpus()
        if "builtin" in plan.runs:
            log("deploying Ray's built-in LLM app (build_openai_app)")
            bench.timed("deploy_builtin", lambda: deploy_builtin(http_port, config))
            wait_healthy(base, "/v1/models")
            bench.unloaded["builtin"] = bench.timed("warm_up_builtin", lambda: warm_up(
                base, plan, False, "built-in", first=True))
            # three fine probes, not four: only "C3 / built-in capacity" uses it
            cal = bench.timed("calibrate_builtin", lambda: measure_capacity(
                base, plan, "built-in", c0, 1.5, False, spread=(0.8, 1.0, 1.2)))
            bench.capacity["builtin"] = calibration_doc(cal)
            plan.size_runs(c0)
            for tag, rate in {"1.5x": 1.5 * c0, "3x": 3.0 * c0}.items():
                bench.timed(f"builtin_{tag}", lambda tag=tag, rate=rate: bench.run(
                    f"builtin @{tag}", "ray-serve-llm", base, constant(rate, plan.run_s), False,
                    schedule=f"{tag} #1", load=tag))
    except Exception as err:  # noqa: BLE001 - keep what was measured; the report says what failed
        failed = f"{type(err).__name__}: {err}"
        log(f"FAILED: {failed}")
    else:
        failed = None
    finally:
        cluster.close()

    total_s = time.monotonic() - t_start
    doc = {
        "meta": meta(plan, args, total_s, bench.phases),
        "failed": failed,
        "capacity": bench.capacity,
        "unloaded": bench.unloaded,
        "ratios": ratios(bench.runs, bench.capacity, plan.slo.slo_ms, bench.unloaded),
        "repeats": repeat_figures(bench.runs, bench.capacity, plan.slo.slo_ms),
        "vllm_bench_serve": bench.vllm_bench,
        "cpu_placement": bench.cpu_placement,
        "runs": bench.runs,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("overload_quick" if plan.quick else "overload")
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    if args.raw:
        Path(args.raw).write_text("".join(json.dumps(r) + "\n" for r in bench.raw))
    if bench.runs:
        plot(doc, out_dir / f"{stem}.png", plan.slo.slo_ms)
    print_summary(doc)
    log(f"wrote {out_dir / (stem + '.json')} and {stem}.png in {total_s / 60:.1f} min")
    return 1 if failed else 0


# -- results -----------------------------------------------------------------------------------

def meta(plan: Plan, args: argparse.Namespace, total_s: float, phases: dict[str, float]) -> dict[str, Any]:
    return {
        "command": provenance.command_line("bench/overload.py", args.argv),
        # read when the run started (main): the service code deployed and the measuring code
        "code_commit": args.code["commit"],
        "uncommitted": args.code["uncommitted"],
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "slo": {"p99_e2e_ms": plan.slo.slo_ms, "max_error_ratio": plan.slo.max_error_ratio},
        "request": {"endpoint": "/v1/chat/completions", "stream": True, "max_tokens": plan.max_tokens,
                    "ignore_eos": True, "arrivals": "Poisson (open loop)",
                    "criticality_mix": dict(plan.mix) if plan.mix else None},
        "durations_s": {"run": plan.run_s, "run_sized": None if not plan.sizes_runs else {
                            "floor_s": plan.run_floor_s, "min_critical_at_3x": MIN_CRITICAL, "max_s": MAX_RUN_S},
                        "drain": plan.drain_s,
                        "step": [plan.step_low_s, plan.step_high_s, plan.step_low_s]},
        "calibration": calibration_meta(plan),
        "quick": plan.quick,
        "wall_s": round(total_s, 1),
        "other_cpu_cores_mean": NOISE.mean(0.0, float("inf")),
        "phases_s": phases,
    }


def calibration_meta(plan: Plan) -> dict[str, Any]:
    return {
        "trace": ("fresh Poisson schedule per probe" if plan.trace_seed is None else
                  f"one Poisson trace (seed {plan.trace_seed}: median burstiness of seeds 0-40 for "
                  f"{plan.probe_n} arrivals, unless --trace-seed) scaled to each probe's rate; new prompts"),
        "trace_seed": plan.trace_seed,
        "arrivals": {"coarse": plan.coarse_n, "coarse_min_s": plan.coarse_s, "fine": plan.probe_n,
                     "fine_max_s": plan.max_probe_s, "fine_min_s": plan.probe_s, "not_judged_first": plan.warmup_n},
        "rule": ("a coarse probe passes when none of its judged requests failed or was late; a fine probe "
                 "when none failed and its fitted p99 is within the SLO"),
        "search": {"coarse_tol": plan.coarse_tol, "coarse_max_bisections": plan.bisect_steps,
                   "fine_rates_x_coarse_capacity": list(plan.spread)},
        "capacity": ("where the least-squares line through the fine probes' (rate, p99) reaches the SLO; "
                     "p99 of a probe = mean + 2.33 sd of its judged latencies (a normal fit)"),
        "failed_probe_repeated_above_other_cores": plan.noisy_cores,
        "noisy_repeats_at_most": plan.noisy_repeats,
    }


def _find(runs: Sequence[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["name"] == name), None)


def _div(a: float | None, b: float | None, nd: int = 3) -> float | None:
    return None if a is None or not b else round(a / b, nd)


def ratios(runs: Sequence[dict[str, Any]], capacity: dict[str, Any], slo_ms: float,
           unloaded: dict[str, Any] | None = None) -> dict[str, Any]:
    """The figures the admission work is judged by, per system where they apply."""
    c3 = (capacity.get("C3") or {}).get("capacity_rps")
    cb = (capacity.get("builtin") or {}).get("capacity_rps")
    out: dict[str, Any] = {}
    for system in ("adaptive", "pinned0", "pinned3", "builtin"):
        hi = _find(runs, f"{system} @3x")
        mid = _find(runs, f"{system} @1.5x")
        if hi:
            out[f"{system}: goodput at 3xC0 / C3"] = _div(hi["overall"]["goodput_rps"], c3)
        if mid:
            out[f"{system}: p99 at 1.5xC0 / SLO"] = _div(mid["overall"]["e2e_ms"]["p99"], slo_ms)
    p0, pa = _find(runs, "pinned0 @1.5x"), _find(runs, "adaptive @1.5x")
    if pa:
        out["adaptive: within the SLO at 1.5xC0"] = pa["overall"]["good_ratio"]
    one = _find(runs, f"adaptive @1.5x{ONE_CLASS_SUFFIX}")
    if one:
        out["adaptive, standard only: within the SLO at 1.5xC0"] = one["overall"]["good_ratio"]
        out["adaptive, standard only: p99 at 1.5xC0 / SLO"] = _div(one["overall"]["e2e_ms"]["p99"], slo_ms)
        if p0:
            out["pinned0 p99 / adaptive standard-only p99 at 1.5xC0"] = _div(
                p0["overall"]["e2e_ms"]["p99"], one["overall"]["e2e_ms"]["p99"])
    if p0 and pa:
        out["pinned0 p99 / adaptive p99 at 1.5xC0"] = _div(p0["overall"]["e2e_ms"]["p99"], pa["overall"]["e2e_ms"]["p99"])
    if p0:
        # Whether pinned level 0 fell behind at 1.5 x C0 (completed / offered well below 1) or kept
        # up with a deeper batch; and the most that ratio can be in this run: no admission rule
        # serves a request faster than the minimal path does alone, so pinned-0 p99 over level 3's
        # latency alone bounds pinned-0 p99 / adaptive p99 from above.
        o = p0["overall"]
        out["pinned0 @1.5x: completed / offered"] = _div(o["throughput_rps"], o["offered_rps"])
        alone3 = ((unloaded or {}).get("brownout level 3") or {}).get("unloaded_e2e_ms_p50")
        out["pinned0 p99 at 1.5xC0 / level 3 alone (ceiling of pinned0 / adaptive p99)"] = _div(
            o["e2e_ms"]["p99"], alone3)
    hi = _find(runs, "adaptive @3x")
    if hi:
        o = hi["overall"]
        out["adaptive @3x: median time to refusal ms"] = o.get("refusal_p50_ms")
        out["adaptive @3x: non-200 that are 429/503 with Retry-After"] = o.get("non200_shed_retry_after_share")
        out["adaptive @3x: client time-outs"] = o.get("client_timeouts")
        cls = hi.get("classes")
        if cls:
            pc = cls["per_class"]
            out["adaptive @3x: within the SLO per class"] = {c: v["good_ratio"] for c, v in pc.items()}
            out["adaptive @3x: shed rate per class"] = {c: v["shed_ratio"] for c, v in pc.items()}
            out["adaptive @3x: shed sheddable >= standard >= critical"] = cls["shed_order_ok"]
            out["adaptive @3x: critical >= 99% within the SLO"] = cls["critical_good_ok"]
    out["C3 / built-in capacity"] = _div(c3, cb)
    u = unloaded or {}
    ub = (u.get("builtin") or {}).get("unloaded_e2e_ms_p50")
    for level in (0, 3):
        mine = (u.get(f"brownout level {level}") or {}).get("unloaded_e2e_ms_p50")
        last = (u.get(LAST_LEVEL0) or {}).get("unloaded_e2e_ms_p50") if level == 0 else None
        if last is not None and ub:
            # the measurement nearest the built-in app's in time; the first one beside it
            out["one at a time: e2e p50 Brownout level 0 / built-in"] = _div(last, ub)
            if mine is not None:
                out["one at a time: e2e p50 Brownout level 0 after its warm-up / built-in"] = _div(mine, ub)
        elif mine is not None and ub:
            out[f"one at a time: e2e p50 Brownout level {level} / built-in"] = _div(mine, ub)
    stepped = _find(runs, "adaptive step")
    if stepped and stepped["load_steps_s"]:
        timeline = [(p["t_s"], p["level"]) for p in stepped["levels"]]
        at_step = stepped["load_steps_s"][0]
        # as the admin API's polls (every 0.5 s) saw it: later by up to a poll and its round trip
        polled = rep.reaction_s(timeline, at_step, 1)
        # when the policy actor changed the level (its own clock; every ingress follows by long-poll),
        # from the level polled before its first change; without a history (an older server) the polls
        changes = [(t["t_s"], t["to"]) for t in stepped.get("transitions") or [] if "to" in t]
        if changes:
            before = [p for p in timeline if p[0] <= at_step and p[0] < changes[0][0]][-1:]
            out["reaction s (load step -> level >= 1)"] = rep.reaction_s(before + changes, at_step, 1)
        else:
            out["reaction s (load step -> level >= 1)"] = polled
        out["reaction s, as polled (load step -> level >= 1)"] = polled
        # 0 s above means the level was already >= 1 when the load stepped up: this says which
        out["level at the load step"] = next((lv for t, lv in reversed(timeline) if t <= at_step), None)
        out["SLO met again s after the step down"] = stepped.get("slo_met_again_s")
    osc = _find(runs, "adaptive oscillate")
    if osc:
        out["level changes under oscillation"] = osc["level_changes"]
    return out


def repeat_figures(runs: Sequence[dict[str, Any]], capacity: dict[str, Any], slo_ms: float) -> dict[str, Any] | None:
    """With ``--adaptive-repeats`` > 1: per repeat, the adaptive figures the issue judges (3x goodput
    over the C3 measured beside that repeat, critical within the SLO and the shed order at 3x, the
    share within the SLO and the p99 at 1.5x, and 1.5 x C0 over that C3: the 1.5x load's size
    against the minimal path's capacity beside it), their medians, and the 3x runs' classes pooled (a
    99% criterion on 150 critical requests rests on one or two of them; pooled it rests on more).
    None with one repeat."""
    rows: list[dict[str, Any]] = []
    pooled: dict[str, dict[str, int]] = {}
    k = 1
    while True:
        suffix = "" if k == 1 else f" #{k}"
        hi, mid = _find(runs, f"adaptive @3x{suffix}"), _find(runs, f"adaptive @1.5x{suffix}")
        one = _find(runs, f"adaptive @1.5x{ONE_CLASS_SUFFIX}{suffix}")
        if hi is None and mid is None:
            break
        c3 = (capacity.get(f"C3{suffix}") or capacity.get("C3") or {}).get("capacity_rps")
        # the C0 this repeat's loads were sized from: its own (--c0-each-repeat), else the first
        c0 = (capacity.get(f"C0{suffix}") or capacity.get("C0") or {}).get("capacity_rps")
        row: dict[str, Any] = {"repeat": k, "C3_rps": c3}
        if f"C0{suffix}" in capacity and k > 1:
            row["C0_rps"] = c0
        # the 1.5x load against what the minimal path carried within the SLO beside it with every
        # request admitted (one calibration, noisy): context for the 1.5x figures, not a bound, as
        # the door carries more by refusing some (3x goodput 1.1-1.9 x C3 on 12-04)
        row["1.5xC0 / C3"] = _div(1.5 * c0, c3) if c0 else None
        if hi is not None:
            cls = hi.get("classes") or {}
            row["goodput at 3xC0 / C3"] = _div(hi["overall"]["goodput_rps"], c3)
            row["critical within the SLO at 3xC0"] = ((cls.get("per_class") or {}).get("critical") or {}).get("good_ratio")
            row["shed order at 3xC0"] = cls.get("shed_order_ok")
            for c, v in (hi.get("per_class") or {}).items():
                acc = pooled.setdefault(c, {"requests": 0, "good": 0, "shed": 0})
                for key in acc:
                    acc[key] += int(v.get(key) or 0)
        if mid is not None:
            row["within the SLO at 1.5xC0"] = mid["overall"]["good_ratio"]
            row["p99 at 1.5xC0 / SLO"] = _div(mid["overall"]["e2e_ms"]["p99"], slo_ms)
        if one is not None:
            row["within the SLO at 1.5xC0, standard only"] = one["overall"]["good_ratio"]
            row["p99 at 1.5xC0 / SLO, standard only"] = _div(one["overall"]["e2e_ms"]["p99"], slo_ms)
        rows.append(row)
        k += 1
    if len(rows) < 2:
        return None
    medians = {}
    for key in dict.fromkeys(k for r in rows for k in r):  # every key, in first-seen order
        if key not in ("repeat", "C3_rps", "C0_rps", "shed order at 3xC0"):
            median = percentile([r[key] for r in rows if r.get(key) is not None], 50)  # None if none
            medians[key] = None if median is None else round(median, 4)
    per_class = {c: {**v, "good_ratio": round(v["good"] / v["requests"], 4) if v["requests"] else None,
                     "shed_ratio": round(v["shed"] / v["requests"], 4) if v["requests"] else None}
                 for c, v in pooled.items()}
    figures = rep.class_figures({c: v for c, v in per_class.items() if v["requests"]})
    return {"per_repeat": rows, "median": medians, "pooled_3x": per_class,
            "pooled_3x_shed_order_ok": None if figures is None else figures["shed_order_ok"],
            "pooled_3x_critical_good_ok": None if figures is None else figures["critical_good_ok"]}


def summary_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": r["name"], "offered_rps": r["overall"]["offered_rps"], "goodput_rps": r["overall"]["goodput_rps"],
             "p99_ms": r["overall"]["e2e_ms"]["p99"], "shed_ratio": r["overall"]["shed_ratio"]}
            for r in doc["runs"] if r.get("load") in ("1.5x", "3x")]


def plot(doc: dict[str, Any], path: Path, slo_ms: float) -> None:
    order = ["adaptive @3x", "pinned0 @3x", "pinned3 @3x", "builtin @3x", "adaptive step",
             "adaptive @1.5x", "pinned0 @1.5x", "pinned3 @1.5x", "builtin @1.5x", "adaptive oscillate"]
    runs = [r for name in order if (r := _find(doc["runs"], name))]
    runs += [r for r in doc["runs"] if r not in runs]
    caps = {k: v.get("capacity_rps") for k, v in doc["capacity"].items()}
    title = (f"Brownout overload benchmark ({doc['meta']['machine']['cpus']} CPUs, SLO p99 {slo_ms / 1000:g} s): "
             + ", ".join(f"{k} {v:.2f} req/s" for k, v in caps.items() if v is not None))
    notes = [f"{k} capacity {v:.2f} req/s" for k, v in caps.items() if v is not None] + [""]
    notes += [f"{k}: {_compact(v)}" for k, v in doc["ratios"].items() if not k.startswith(("pinned", "builtin"))]
    rep.plot_runs(runs, str(path), title, slo_ms, summary_rows(doc), notes)


def _compact(v: Any) -> str:
    return ", ".join(f"{k} {x}" for k, x in v.items()) if isinstance(v, dict) else str(v)


def table(runs: Sequence[dict[str, Any]]) -> str:
    head = ("run", "offered", "thru", "goodput", "p50 ms", "p99 ms", "ttft p99", "shed", "other err", "refuse ms",
            "RA", "t/o", "max lvl", "noise")
    rows = [head]
    for r in runs:
        o = r["overall"]
        ra = o.get("non200_shed_retry_after_share")
        rows.append((r["name"], f"{o['offered_rps']:.2f}", f"{o['throughput_rps']:.2f}", f"{o['goodput_rps']:.2f}",
                     _fmt(o["e2e_ms"]["p50"]), _fmt(o["e2e_ms"]["p99"]), _fmt(o["ttft_ms"]["p99"]),
                     str(o["shed"]), str(o["errors"] - o["shed"]), _fmt(o.get("refusal_p50_ms")),
                     "-" if ra is None else f"{ra:.0%}", str(o.get("client_timeouts", "-")),
                     "-" if o["max_level_seen"] is None else str(o["max_level_seen"]),
                     "-" if r.get("other_cpu_cores") is None else f"{r['other_cpu_cores']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def class_table(runs: Sequence[dict[str, Any]]) -> str:
    """Per run with a criticality mix: per class within the SLO / shed, and the two checks."""
    lines = []
    for r in runs:
        cls = r.get("classes")
        if not cls:
            continue
        cells = "  ".join(f"{c} {v['good_ratio']:.0%}/{v['shed_ratio']:.0%}" for c, v in cls["per_class"].items()
                          if v["good_ratio"] is not None)
        lines.append(f"  {r['name']:20s} {cells}  shed order ok: {_yn(cls['shed_order_ok'])}, "
                     f"critical >= 99%: {_yn(cls['critical_good_ok'])}")
    return "\n".join(lines)


def _yn(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def print_summary(doc: dict[str, Any]) -> None:
    print()
    print("capacity (req/s, p99 e2e within the SLO, <= 1% errors):")
    for k, v in doc["capacity"].items():
        probes = len(v.get("probes", []))
        print(f"  {k:8s} {v['capacity_rps']:.2f}" + (f"  ({probes} probes)" if probes else "  (given)"))
    for k, v in doc.get("unloaded", {}).items():
        print(f"  unloaded {k}: one request alone e2e p50 {v.get('unloaded_e2e_ms_p50')} ms, "
              f"TTFT p50 {v.get('unloaded_ttft_ms_p50')} ms")
    print()
    print("rates in req/s; latencies end to end from the scheduled time, over completed requests;")
    print("noise: CPU cores used meanwhile by processes outside this benchmark (other work on the machine)")
    print("refuse ms: median time to refusal of non-200 answers (sent -> response); RA: share of non-200 that are")
    print("429/503 with Retry-After; t/o: client time-outs (cut off at the end of the run)")
    print(table(doc["runs"]))
    classes = class_table(doc["runs"])
    if classes:
        print()
        print("per class: within the SLO / shed (429/503), of the class's requests:")
        print(classes)
    vb = doc.get("vllm_bench_serve")
    if vb:
        print()
        print(f"vllm bench serve (openai-chat) against Brownout: {'ok' if vb.get('ok') else 'FAILED'} "
              f"completed {vb.get('completed')}, failed {vb.get('failed')}, p99 e2e {vb.get('p99_e2el_ms')} ms")
    noise = doc["meta"].get("other_cpu_cores_mean")
    if noise is not None and noise > 0.25:
        print()
        print(f"WARNING: other processes used {noise:.2f} CPU cores on average during the benchmark: on a "
              "2-core machine the figures are not representative; run it again on a quiet machine.")
    print()
    print("ratios:")
    for k, v in doc["ratios"].items():
        print(f"  {k}: {v}")
    rp = doc.get("repeats")
    if rp:
        print()
        print(f"adaptive runs repeated ({len(rp['per_repeat'])} x, each 3x judged against the C3 measured beside it):")
        for row in rp["per_repeat"]:
            print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
        print("  median: " + ", ".join(f"{k} {v}" for k, v in rp["median"].items()))
        print("  3x pooled: " + "  ".join(f"{c} {v['good']}/{v['requests']} within, {v['shed_ratio']:.1%} shed"
                                          for c, v in rp["pooled_3x"].items() if v["requests"])
              + f"; shed order ok: {_yn(rp['pooled_3x_shed_order_ok'])}, critical >= 99%: "
              f"{_yn(rp['pooled_3x_critical_good_ok'])}")
    print_phases(doc["meta"].get("phases_s") or {}, doc["meta"].get("wall_s") or 0.0)


def print_phases(phases: dict[str, float], total_s: float) -> None:
    print()
    print(f"phases (s), {total_s / 60:.1f} min in all:")
    print("  " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))


# -- one profile against a running server ------------------------------------------------------

class Neighbour:
    """A noisy neighbour for one run: ``procs`` busy-looping processes beside the server from
    ``from_s`` to ``to_s`` seconds after `start` (a tenant taking the cores for a while), ended
    by their PIDs. How fast the door recovers from such a slow phase is what `single` reports
    for the requests sent after it."""

    def __init__(self, spec: str) -> None:
        try:
            parts = [float(x) for x in spec.split(",")]
        except ValueError:
            parts = []
        if len(parts) not in (2, 3) or not (0 <= parts[0] < parts[1]) or (len(parts) == 3 and not (
                parts[2] >= 1 and parts[2] == int(parts[2]))):
            raise SystemExit(f"--neighbour: need FROM,TO[,PROCS] with 0 <= FROM < TO and PROCS a whole number "
                             f">= 1, got {spec!r}")
        self.from_s, self.to_s = parts[0], parts[1]
        self.procs = int(parts[2]) if len(parts) == 3 else (os.cpu_count() or 1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ran: list[float] = []  # when the processes started and ended (s after `start`)

    def start(self) -> None:
        t0 = time.monotonic()

        def run() -> None:
            if self._stop.wait(self.from_s):
                return
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.procs)]
            self.ran.append(round(time.monotonic() - t0, 2))
            try:
                self._stop.wait(max(0.0, self.to_s - (time.monotonic() - t0)))
            finally:
                for p in procs:
                    p.kill()
                for p in procs:
                    p.wait()
                self.ran.append(round(time.monotonic() - t0, 2))

        self._thread = threading.Thread(target=run, name="neighbour", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def report(self, records: Sequence[Any], slo_ms: float) -> dict[str, Any]:
        """The neighbour's phase and, for the requests sent during it and after it, the run's
        figures (`report.summarize`, overall and per class)."""
        after = [r for r in records if r.sent_s is not None and r.sent_s >= self.to_s]
        during = [r for r in records if r.sent_s is not None and self.from_s <= r.sent_s < self.to_s]
        span = max((r.sent_s for r in after), default=self.to_s) - self.to_s
        return {"from_s": self.from_s, "to_s": self.to_s, "procs": self.procs, "ran_s": self.ran,
                "during": rep.summarize(during, slo_ms, self.to_s - self.from_s),
                "after": rep.summarize(after, slo_ms, span), "after_by_class": rep.per_class(after, slo_ms, span)}


def single(args: argparse.Namespace) -> int:
    # No noise figure here: the server is not this command's child, so its own CPU would count.
    plan = Plan(args)
    base = args.url.rstrip("/")
    from bench.credentials import env_headers

    HEADERS.update(env_headers())
    os.environ.setdefault("OPENAI_API_KEY", HEADERS.get("Authorization", "Bearer none").removeprefix("Bearer "))
    wait_healthy(base, "/v1/models", timeout_s=10)
    brownout = httpx.get(base + "/admin/brownout", timeout=10, headers=HEADERS).status_code != 404
    if args.profile == "calibrate":
        cal = measure_capacity(base, plan, "capacity", args.rate or 2.0, 2.0, brownout)
        print(json.dumps(calibration_doc(cal), indent=1))
        return 0
    cap = args.capacity
    if args.profile == "fixed":
        if not args.rate:
            raise SystemExit("--profile fixed needs --rate")
        profile = constant(args.rate, plan.run_s)
    elif args.profile == "step":
        if not cap:
            raise SystemExit("--profile step needs --capacity")
        profile = step(cap, plan.step_low_s, plan.step_high_s)
    else:
        if not cap:
            raise SystemExit("--profile oscillate needs --capacity")
        profile = oscillate(cap, 0.5 * cap, 30.0, args.run_s or 90.0)
    bench = Bench(plan)
    neighbour = args.neighbour  # parsed in `main`
    if neighbour is not None:
        neighbour.start()
    try:
        run = bench.run(args.profile, "url", base, profile, brownout, load=args.profile)
    finally:
        if neighbour is not None:
            neighbour.stop()
    if neighbour is not None:
        run["neighbour"] = neighbour.report(bench.last_records, plan.slo.slo_ms)
        a = run["neighbour"]["after"]
        d = run["neighbour"]["during"]
        log(f"  during the neighbour: {d.get('requests')} sent, {d.get('good_ratio')} within the SLO, "
            f"{d.get('shed_ratio')} refused, statuses {d.get('status_counts')}")
        log(f"  after the neighbour (sent from {neighbour.to_s:g} s): {a.get('good_ratio')} within the SLO, "
            f"per class {({c: v.get('good_ratio') for c, v in run['neighbour']['after_by_class'].items()})}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"loadgen_{args.profile}"
    doc = {"meta": meta(plan, args, 0.0, {}), "capacity": {}, "runs": [run],
           "reaction_s": rep.reaction_s([(p["t_s"], p["level"]) for p in run["levels"]], run["load_steps_s"][0])
           if run["load_steps_s"] else None,
           "slo_met_again_s": run["slo_met_again_s"]}
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    if args.raw:
        Path(args.raw).write_text("".join(json.dumps(r) + "\n" for r in bench.raw))
    rep.plot_runs([run], str(out_dir / f"{stem}.png"), f"{profile.name} against {base}", plan.slo.slo_ms)
    print(table([run]))
    if class_table([run]):
        print(class_table([run]))
    if doc["reaction_s"] is not None or doc["slo_met_again_s"] is not None:
        print(f"reaction s (load step -> level >= 1): {doc['reaction_s']}; "
              f"SLO met again s after the step down: {doc['slo_met_again_s']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (also the defaults `bench/onset.py` plans with)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short probes and runs: a smoke test of a few minutes")
    ap.add_argument("--only", default=None, help=f"comma-separated runs among {','.join(RUNS)} (default: all)")
    ap.add_argument("--slo-ms", type=float, default=2000.0, help="SLO: p99 end-to-end latency (ms)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mix", default=None, help="critical/standard/sheddable percentages (default 20/50/30)")
    ap.add_argument("--no-mix", action="store_true", help="send no criticality header")
    ap.add_argument("--c0", type=float, default=None, help="use this C0 instead of calibrating it")
    ap.add_argument("--c3", type=float, default=None, help="use this C3 instead of calibrating it")
    ap.add_argument("--probe-n", type=int, default=None,
                    help="arrivals of a full-length (fine) calibration probe (default 30, --quick 24)")
    ap.add_argument("--coarse-n", type=int, default=None,
                    help="arrivals of a coarse calibration probe, a prefix of the trace (default: the shortest "
                    "that holds the trace's worst burst)")
    ap.add_argument("--probe-s", type=float, default=None,
                    help="a fine probe sends at least this many seconds' worth of arrivals (default 15, --quick 6)")
    ap.add_argument("--coarse-s", type=float, default=None,
                    help="a coarse probe sends at least this many seconds' worth of arrivals (default 6, --quick 3)")
    ap.add_argument("--run-s", type=float, default=None, help="seconds per fixed-rate run")
    ap.add_argument("--drain-s", type=float, default=None, help="wait this long for stragglers after a run")
    ap.add_argument("--bisect", type=int, default=None, help="at most this many coarse bisection steps (default 4)")
    ap.add_argument("--trace-seed", type=int, default=None,
                    help="the calibration trace's seed (default: the median-burstiness one of seeds 0-40)")
    ap.add_argument("--fresh-trace", action="store_true",
                    help="a fresh Poisson schedule for every calibration probe (noisier)")
    ap.add_argument("--calibrate-only", action="store_true",
                    help="deploy once, calibrate C0 and C3 --repeats times back to back, write repeatability.json")
    ap.add_argument("--repeats", type=int, default=2, help="with --calibrate-only: how many (C0, C3) pairs")
    ap.add_argument("--adaptive-repeats", type=int, default=1,
                    help="run adaptive @1.5x and @3x this many times, each repeat after C3 is measured again beside "
                    "it (unless --c3); per-repeat figures, their medians and the 3x classes pooled in 'repeats'")
    ap.add_argument("--step-repeats", type=int, default=1,
                    help="run the adaptive step profile this many times, each after a reset to level 0")
    ap.add_argument("--step-only", action="store_true",
                    help="of the adaptive runs, only the step profile(s): no 1.5x, 3x or oscillation")
    ap.add_argument("--c0-each-repeat", action="store_true",
                    help="with --adaptive-repeats: measure C0 again before each repeat too, and size its 1.5x and 3x "
                    "loads from it (default: the first C0 for every repeat)")
    ap.add_argument("--seed", type=int, default=None, help="fix the prompts and schedules (default: fresh per run)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default=None, help="file stem of the report and figure")
    ap.add_argument("--raw", default=None, help="also write every request record (JSON lines) here")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-vllm-bench", action="store_true", help="skip the `vllm bench serve` compatibility run")
    ap.add_argument("--url", default=None, help="run one --profile against this running server instead")
    ap.add_argument("--profile", choices=("calibrate", "fixed", "step", "oscillate"), default="fixed")
    ap.add_argument("--rate", type=float, default=None, help="req/s of --profile fixed (start of calibrate)")
    ap.add_argument("--capacity", type=float, default=None, help="the capacity --profile step/oscillate scale")
    ap.add_argument("--neighbour", default=None, metavar="FROM,TO[,PROCS]",
                    help="with --url: PROCS (default: one per core) busy processes beside the server from FROM to "
                    "TO seconds into the run (a noisy neighbour); reports the requests sent after it")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.code = provenance.code_state()
    if args.neighbour is not None:
        if not args.url:
            ap.error(f"--neighbour {args.neighbour}: needs --url (a running server to put it beside)")
        args.neighbour = Neighbour(args.neighbour)
    if args.calibrate_only:
        return calibrate_only(args)
    return single(args) if args.url else comparison(args)


if __name__ == "__main__":
    sys.exit(main())
