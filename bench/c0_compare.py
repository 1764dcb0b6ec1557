"""C0 (the capacity with every feature on: level 0 pinned) of two revisions, measured in one run.

    .venv/bin/python bench/c0_compare.py [--before a3788c5] [--after HEAD] [--slo-ms 4000] [--reps 2]

For each revision in turn, alternating (before, after, before, after, ...: drift of the machine
falls on both), it:

1. checks the revision out in a temporary ``git worktree add --detach``;
2. starts a private local Ray cluster from that worktree (a child process whose working directory
   and ``PYTHONPATH`` are the worktree, so that every replica imports ``serve_app.app:build_app``
   and the rest from that revision; the venv is this one);
3. deploys that revision's own ``serve_config.yaml`` with ``serve deploy``, changed only in: the
   HTTP port (a free one), the data folder (a temporary one), ``args.model.dtype: float32`` (on a
   CPU without native bfloat16, bf16 is emulated and 5x slower; the newer revisions resolve
   ``auto`` to float32 there, the older ones do not: forced on both, the engine is the same) and,
   where the revision has admission control (its policy has an ``slo`` section), the policy's
   SLO set to ``--slo-ms`` with ``degradation.admission.enabled: false`` (C0 is the service's
   capacity with every request admitted, as in `bench/overload.py`);
4. checks the replicas run that revision's code (the ingress's handle-call counter exists exactly
   where the revision's ``serve_app/pipeline.py`` has one) and that admission is off;
5. pins level 0 through the admin API, warms up, measures the unloaded latency (a few requests
   one at a time) and calibrates C0 with `bench.overload.measure_capacity` (the same rule as the
   overload benchmark: the highest Poisson rate whose probe has <= 1% errors and p99 end to end
   within the SLO; streamed chat, 16 tokens with ``ignore_eos``, new prompts in every probe; a
   geometric ramp from ``--start-rps`` then a bisection);
6. shuts the cluster down (``serve.shutdown()``, ``ray.shutdown()`` in the child; whatever of its
   process tree is left is ended by PID) and removes the worktree.

A second pair of repetitions is started only if the time measured so far says it ends within
``--budget-min``. Writes ``bench/results/c0_compare.json``: per revision and repetition C0 with
its probes, the median C0 per revision, the ratio after / before, the machine, the command, the
total time; prints a short table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from bench import overload as ov
from bench import provenance

ROOT = Path(__file__).resolve().parents[1]
APP = ov.APP

# The child that holds one revision's cluster: started with the worktree as working directory and
# PYTHONPATH; up until its stdin closes, then Serve and Ray are shut down cleanly.
CHILD = r"""
import os, sys
import ray
port, temp_dir = int(sys.argv[1]), sys.argv[2]
ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
         dashboard_port=port, _temp_dir=temp_dir, log_to_driver=False)
import serve_app
print("READY", os.path.dirname(os.path.abspath(serve_app.__file__)), flush=True)
sys.stdin.read()
try:
    from ray import serve
    serve.shutdown()
finally:
    ray.shutdown()
print("STOPPED", flush=True)
"""


# -- pure helpers (unit-tested) ------------------------------------------------------------------

def run_order(reps: int) -> list[str]:
    """``before, after`` repeated ``reps`` times: alternating, so drift falls on both."""
    return ["before", "after"] * reps


def patch_config(config: dict[str, Any], http_port: int, data_dir: str, slo_ms: float,
                 dtype: str = "float32") -> tuple[dict[str, Any], bool]:
    """A revision's serve_config with the port, data folder and dtype moved, and admission off where
    the revision has it (its policy has an ``slo`` section: then the SLO is set to ``slo_ms`` too).

    Returns (the new config, whether the revision has admission control). The input is not changed.
    """
    cfg = copy.deepcopy(config)
    cfg["http_options"]["port"] = http_port
    app = cfg["applications"][0]
    app["args"].setdefault("model", {})["dtype"] = dtype
    app["args"].setdefault("enrichments", {})["data_dir"] = data_dir
    ov.HEADERS.clear()
    if "auth" in app["args"]:  # a revision with API keys: a private key and admin token (bench.credentials)
        from bench.credentials import local_secrets

        auth, headers = local_secrets(Path(data_dir).parent / "secrets")
        app["args"]["auth"] = {**app["args"]["auth"], **auth}
        ov.HEADERS.update(headers)
    (ingress,) = [d for d in app["deployments"] if d["name"] == "Ingress"]
    degradation = ingress["user_config"]["policy"]["degradation"]
    has_admission = "slo" in degradation
    if has_admission:
        degradation["slo"]["e2e_p99_ms"] = slo_ms
        degradation.setdefault("admission", {})["enabled"] = False
    return cfg, has_admission


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per revision: every C0 in run order and their median; the ratio of the medians after / before."""
    out: dict[str, Any] = {}
    for side in ("before", "after"):
        c0s = [r["c0_rps"] for r in results if r["side"] == side and r.get("c0_rps") is not None]
        unloaded = [r["unloaded"]["unloaded_e2e_ms_p50"] for r in results
                    if r["side"] == side and (r.get("unloaded") or {}).get("unloaded_e2e_ms_p50") is not None]
        out[side] = {"c0_rps": c0s, "median_c0_rps": round(statistics.median(c0s), 3) if c0s else None,
                     "unloaded_e2e_ms_p50": unloaded,
                     "median_unloaded_e2e_ms_p50": round(statistics.median(unloaded), 1) if unloaded else None}
    b, a = out["before"]["median_c0_rps"], out["after"]["median_c0_rps"]
    out["ratio_after_over_before"] = round(a / b, 3) if a is not None and b else None
    return out


def process_group(cmdline: Sequence[str], name: str) -> str:
    """What a cluster process is, from its command line: a Serve replica by deployment
    (``ray::ServeReplica:<app>:<Deployment>``), vLLM's engine core, the Serve proxy and controller,
    the policy actor, or Ray's own daemons; anything else is ``other``."""
    text = " ".join(cmdline) or name
    if "ServeReplica:" in text:
        return "replica:" + text.split("ServeReplica:", 1)[1].split()[0].split(":")[-1]
    for needle, group in (("EngineCore", "vllm_engine_core"), ("ProxyActor", "serve_proxy"),
                          ("ServeController", "serve_controller"), ("PolicyActor", "policy_actor"),
                          ("raylet", "raylet"), ("gcs_server", "gcs"), ("dashboard", "dashboard"),
                          ("log_monitor", "ray_other"), ("monitor.py", "ray_other"),
                          ("runtime_env", "ray_other"), ("default_worker", "ray_idle_worker")):
        if needle in text:
            return group
    return "other"


def cpu_by_group(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                 requests: int) -> dict[str, dict[str, float]]:
    """CPU seconds each group used between two snapshots ``{pid: (group, cpu_s)}``, in all and
    per request; a process that started between them counts from zero."""
    used: dict[str, float] = {}
    for pid, (group, cpu) in after.items():
        used[group] = used.get(group, 0.0) + max(0.0, cpu - before.get(pid, (group, 0.0))[1])
    return {g: {"cpu_s": round(v, 2), "cpu_ms_per_request": round(1000 * v / requests, 1) if requests else None}
            for g, v in sorted(used.items(), key=lambda kv: -kv[1])}


def cpu_summary(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per revision and group: the median CPU ms per served request over its repetitions, and
    the served requests' median latency."""
    out: dict[str, Any] = {}
    for side in ("before", "after"):
        runs = [r["cpu_profile"] for r in results if r["side"] == side and r.get("cpu_profile")]
        groups = sorted({g for r in runs for g in r["by_group"]})
        out[side] = {
            "runs": len(runs),
            "cpu_ms_per_request": {g: statistics.median(r["by_group"].get(g, {}).get("cpu_ms_per_request") or 0.0
                                                        for r in runs) for g in groups},
            "e2e_ms_p50": [r["e2e_ms_p50"] for r in runs],
            "ok": [f"{r['ok']}/{r['requests']}" for r in runs]}
        out[side]["total_cpu_ms_per_request"] = round(sum(out[side]["cpu_ms_per_request"].values()), 1)
    return out


def cpu_table(summary: dict[str, Any]) -> str:
    groups = sorted(set(summary["before"]["cpu_ms_per_request"]) | set(summary["after"]["cpu_ms_per_request"]),
                    key=lambda g: -summary["after"]["cpu_ms_per_request"].get(g, 0.0))
    lines = ["CPU ms per served request (median over repetitions)", f"{'group':28s}  {'before':>8s}  {'after':>8s}"]
    for g in groups + ["total"]:
        b = summary["before"]["total_cpu_ms_per_request"] if g == "total" else summary["before"]["cpu_ms_per_request"].get(g)
        a = summary["after"]["total_cpu_ms_per_request"] if g == "total" else summary["after"]["cpu_ms_per_request"].get(g)
        lines.append(f"{g:28s}  {'-' if b is None else f'{b:.0f}':>8s}  {'-' if a is None else f'{a:.0f}':>8s}")
    lines.append(f"e2e p50 ms: before {summary['before']['e2e_ms_p50']}, after {summary['after']['e2e_ms_p50']}; "
                 f"served: before {summary['before']['ok']}, after {summary['after']['ok']}")
    return "\n".join(lines)


def pair_fits(elapsed_s: float, per_revision_s: Sequence[float], budget_s: float) -> bool:
    """Whether one more pair (before + after) ends within the budget, at the slowest pace seen."""
    return not per_revision_s or elapsed_s + 2 * max(per_revision_s) <= budget_s


def table(results: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = ["side    rev      rep  C0 req/s  probes  alone e2e p50 ms  others' cores  minutes",
             "------  -------  ---  --------  ------  ----------------  -------------  -------"]
    for r in results:
        c0 = "FAILED" if r.get("c0_rps") is None else f"{r['c0_rps']:.3f}"
        alone = (r.get("unloaded") or {}).get("unloaded_e2e_ms_p50")
        noise = r.get("other_cpu_cores")
        lines.append(f"{r['side']:6s}  {r['revision']:7s}  {r['rep']:3d}  {c0:>8s}  {len(r.get('probes', [])):6d}  "
                     f"{'-' if alone is None else f'{alone:.0f}':>16s}  {'-' if noise is None else f'{noise:.2f}':>13s}"
                     f"  {r['wall_s'] / 60:7.1f}")
    lines.append("")
    for side in ("before", "after"):
        s = summary[side]
        lines.append(f"median C0 {side:6s}: {s['median_c0_rps']} req/s  (of {s['c0_rps']})")
    lines.append(f"ratio after / before: {summary['ratio_after_over_before']}")
    return "\n".join(lines)


# -- one revision --------------------------------------------------------------------------------

def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def wait_app(dash_url: str, env: dict[str, str], cwd: Path, timeout_s: float = 600) -> None:
    """Until the app is RUNNING, from ``serve status`` (this process is no Ray driver; the CLI sends
    the cluster's token itself)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        out = subprocess.run([str(Path(sys.executable).parent / "serve"), "status", "--address", dash_url],
                             cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        try:
            app = ((yaml.safe_load(out.stdout) or {}).get("applications") or {}).get(APP)
        except yaml.YAMLError:
            app = None
        if app is not None:
            last = app.get("status")
            if last == "RUNNING":
                return
            if last == "DEPLOY_FAILED":
                raise RuntimeError(f"deploy failed: {app.get('message')}")
        time.sleep(3)
    raise RuntimeError(f"app not RUNNING after {timeout_s:.0f} s (last status {last})")


class Cluster:
    """One revision's private Ray cluster, held by a child process (see CHILD)."""

    def __init__(self, tree: Path, tmp: Path, env: dict[str, str]) -> None:
        self.dash_port = ov.free_port()
        self.log_path = tmp / "cluster.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(self.dash_port), str(tmp / "ray")],
                                     cwd=tree, env=env, stdin=subprocess.PIPE, stdout=self._log,
                                     stderr=subprocess.STDOUT, text=True)
        self.imported_from: str | None = None

    @property
    def dash_url(self) -> str:
        return f"http://127.0.0.1:{self.dash_port}"

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("READY "):
                    self.imported_from = line[6:].strip()
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"cluster process exited ({self.proc.returncode}): {self.tail()}")
            time.sleep(1)
        raise RuntimeError(f"cluster not up after {timeout_s:.0f} s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self, timeout_s: float = 150) -> dict[str, Any]:
        """Clean shutdown in the child; then whatever of its process tree is left, by PID."""
        import psutil

        try:
            tree = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        t0 = time.monotonic()
        clean = False
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout_s)
            clean = self.proc.returncode == 0
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = []
        for pid in tree:
            try:
                p = psutil.Process(pid)
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
                    os.kill(pid, signal.SIGTERM)
            except (psutil.Error, ProcessLookupError):
                pass
        if left:
            time.sleep(5)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._log.close()
        return {"clean": clean, "stop_s": round(time.monotonic() - t0, 1), "leftover_processes_ended": len(left)}


def cpu_snapshot(root_pid: int) -> dict[int, tuple[str, float]]:
    """``{pid: (group, cpu seconds so far)}`` for the cluster's process tree (children included)."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    try:
        procs = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return out
    for proc in procs:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                out[proc.pid] = (process_group(proc.cmdline(), proc.name()), t.user + t.system)
        except psutil.Error:
            continue
    return out


def measure_revision(side: str, rev: str, rep: int, args: argparse.Namespace, plan: ov.Plan) -> dict[str, Any]:
    t0 = time.monotonic()
    doc: dict[str, Any] = {"side": side, "revision": rev, "rep": rep, "phases_s": {}}
    tmp = Path(tempfile.mkdtemp(prefix="bo-c0-"))
    tree = tmp / "tree"
    cluster: Cluster | None = None

    def phase(name: str, since: float) -> None:
        doc["phases_s"][name] = round(time.monotonic() - since, 1)

    try:
        git("worktree", "add", "--detach", str(tree), rev)
        http_port = ov.free_port()
        base = f"http://127.0.0.1:{http_port}"
        config, has_admission = patch_config(yaml.safe_load((tree / "serve_config.yaml").read_text()),
                                             http_port, str(tmp / "data"), plan.slo.slo_ms)
        doc["has_admission_control"] = has_admission
        cfg_path = tmp / "serve_config.yaml"
        cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
        # RAY_AUTH_MODE=token as `make serve`: Ray 2.60's cluster asks the CLI for its token
        env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_AUTH_MODE": "token"}

        ov.log(f"[{side} {rev} #{rep}] starting a private Ray cluster in the worktree")
        s = time.monotonic()
        cluster = Cluster(tree, tmp, env)
        cluster.wait_ready()
        if Path(cluster.imported_from or "").resolve() != (tree / "serve_app").resolve():
            raise RuntimeError(f"the cluster imports serve_app from elsewhere than the worktree: {cluster.imported_from}")
        phase("cluster_start", s)

        ov.log(f"[{side} {rev} #{rep}] serve deploy (that revision's serve_config.yaml; port, data dir, dtype"
               f"{', admission off' if has_admission else ''})")
        s = time.monotonic()
        out = subprocess.run([str(Path(sys.executable).parent / "serve"), "deploy", str(cfg_path),
                              "--address", cluster.dash_url], cwd=tree, env=env, capture_output=True, text=True,
                             timeout=180)
        if out.returncode != 0:
            raise RuntimeError(f"serve deploy failed: {out.stderr[-1500:]}{out.stdout[-500:]}")
        wait_app(cluster.dash_url, env, tree)
        ov.wait_healthy(base, "/healthz", timeout_s=300)
        phase("deploy", s)

        state = ov.admin_state(base)
        ingress = state.get("ingress") or {}
        expect_counter = "handle_calls" in (tree / "serve_app" / "pipeline.py").read_text()
        has_counter = "handle_calls" in (ingress.get("pipeline") or {})
        admission = (ingress.get("admission") or {}).get("enabled")
        doc["code_check"] = {"serve_app_imported_from": "the worktree", "handle_call_counter": has_counter,
                             "handle_call_counter_expected": expect_counter, "admission_enabled": admission}
        if has_counter != expect_counter:
            raise RuntimeError("the replicas do not run this revision's code (handle-call counter "
                               f"{'present' if has_counter else 'absent'}, expected the opposite)")
        if admission:
            raise RuntimeError("admission control is on; C0 is measured with it off")

        ov.pin_level(base, 0)
        s = time.monotonic()
        doc["unloaded"] = ov.warm_up(base, plan, True, f"{side} {rev} level 0")
        phase("warm_up", s)

        if args.cpu_profile_rps:
            s = time.monotonic()
            snap0 = cpu_snapshot(cluster.proc.pid)
            res = ov.run_profile(base, ov.constant(args.cpu_profile_rps, args.cpu_profile_s), plan,
                                 f"{side} {rev} CPU profile", poll=False)
            snap1 = cpu_snapshot(cluster.proc.pid)
            wall = time.monotonic() - s
            ok = [r for r in res.records if r.ok]
            lat = sorted(r.e2e_ms for r in ok if r.e2e_ms is not None)
            doc["cpu_profile"] = {
                "rate_rps": args.cpu_profile_rps, "requests": len(res.records), "ok": len(ok),
                "wall_s": round(wall, 1), "e2e_ms_p50": lat[len(lat) // 2] if lat else None,
                "by_group": cpu_by_group(snap0, snap1, len(ok))}
            doc["cpu_profile"]["cluster_cpu_cores"] = round(
                sum(v["cpu_s"] for v in doc["cpu_profile"]["by_group"].values()) / wall, 2)
            doc["other_cpu_cores"] = ov.NOISE.mean(s, time.monotonic())
            phase("cpu_profile", s)
            return doc
        s = time.monotonic()
        cal = ov.measure_capacity(base, plan, f"{side} {rev} C0", args.start_rps, args.growth, True)
        phase("calibrate", s)
        doc["other_cpu_cores"] = ov.NOISE.mean(s, time.monotonic())
        doc["c0_rps"] = round(cal.capacity_rps, 3)
        doc.update({k: v for k, v in ov.calibration_doc(cal).items() if k != "capacity_rps"})
        doc["level_at_end"] = ov.admin_state(base).get("level")
    except Exception as err:  # noqa: BLE001 - keep the other revisions' figures; the report says what failed
        doc["failed"] = f"{type(err).__name__}: {err}"
        ov.log(f"[{side} {rev} #{rep}] FAILED: {doc['failed']}")
        if cluster is not None:
            doc["cluster_log_tail"] = cluster.tail(800)
    finally:
        s = time.monotonic()
        if cluster is not None:
            doc["shutdown"] = cluster.stop()
        try:
            git("worktree", "remove", "--force", str(tree))
        except subprocess.CalledProcessError:
            shutil.rmtree(tree, ignore_errors=True)
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        phase("shutdown", s)
        doc["wall_s"] = round(time.monotonic() - t0, 1)
    ov.log(f"[{side} {rev} #{rep}] C0 {doc.get('c0_rps')} req/s in {doc['wall_s'] / 60:.1f} min")
    return doc


# -- the command ---------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="a3788c5", help="the revision before the change (default: a3788c5, "
                    "the commit before the issue-8 refactor)")
    ap.add_argument("--after", default="HEAD", help="the revision after it (default: HEAD, resolved at start)")
    ap.add_argument("--slo-ms", type=float, default=4000.0, help="SLO: p99 end to end (ms); one request alone "
                    "takes about 1.5 s at level 0 on a 2-core AVX2 machine, so 2000 leaves no capacity there")
    ap.add_argument("--reps", type=int, default=2, help="pairs (before, after) at most; the second and later "
                    "only if they fit --budget-min")
    ap.add_argument("--budget-min", type=float, default=23.0, help="start another pair only if it ends within this")
    ap.add_argument("--probe-s", type=float, default=30.0, help="seconds per calibration probe (at least)")
    ap.add_argument("--start-rps", type=float, default=0.5, help="first probe rate (near the expected C0)")
    ap.add_argument("--growth", type=float, default=1.25, help="ramp factor of the calibration")
    ap.add_argument("--bisect", type=int, default=2, help="bisection steps of the calibration")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cpu-profile-rps", type=float, default=None,
                    help="instead of calibrating C0: send this constant Poisson rate (below both C0s) for "
                         "--cpu-profile-s and report CPU seconds per request by process group (where the "
                         "level-0 path spends the machine); writes c0_cpu_profile.json unless --out")
    ap.add_argument("--cpu-profile-s", type=float, default=60.0)
    ap.add_argument("--out", default=None, help="default: bench/results/c0_compare.json "
                    "(c0_cpu_profile.json with --cpu-profile-rps)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / ("c0_cpu_profile.json" if args.cpu_profile_rps
                                                      else "c0_compare.json"))

    plan = ov.Plan(argparse.Namespace(
        quick=False, slo_ms=args.slo_ms, probe_s=args.probe_s, run_s=None, drain_s=None, bisect=args.bisect,
        max_tokens=args.max_tokens, mix=None, no_mix=True, seed=None, no_progress=True, only=None))
    revs = {"before": git("rev-parse", "--short=7", f"{args.before}^{{commit}}"),
            "after": git("rev-parse", "--short=7", f"{args.after}^{{commit}}")}
    subjects = {side: git("log", "-1", "--format=%s", rev) for side, rev in revs.items()}
    bench_code = provenance.code_state(ROOT, ["bench"])
    t_start = time.monotonic()
    ov.NOISE.start()
    ov.log(f"C0 before {revs['before']} / after {revs['after']}; SLO p99 e2e {args.slo_ms:g} ms; "
           f"up to {args.reps} pair(s), budget {args.budget_min:g} min")
    results: list[dict[str, Any]] = []
    per_rev: list[float] = []
    stopped_for_budget = False
    for i, side in enumerate(run_order(args.reps)):
        if i and i % 2 == 0 and not pair_fits(time.monotonic() - t_start, per_rev, args.budget_min * 60):
            stopped_for_budget = True
            ov.log(f"another pair would not end within {args.budget_min:g} min: stopping after {i // 2} pair(s)")
            break
        doc = measure_revision(side, revs[side], i // 2 + 1, args, plan)
        results.append(doc)
        per_rev.append(doc["wall_s"])
    total_s = time.monotonic() - t_start
    summary = summarize(results)
    out = {
        "what": "C0, the capacity with every feature on (level 0 pinned through the admin API), of the revision "
                "before the issue-8 refactor and of the revision after it, measured in one run, alternating",
        "meta": {
            "command": provenance.command_line("bench/c0_compare.py", sys.argv[1:] if argv is None else argv),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "revisions": {side: {"commit": rev, "subject": subjects[side]} for side, rev in revs.items()},
            # the measuring code (this script, bench/overload.py, bench/loadgen.py): the checkout's
            # commit and its uncommitted changes under bench/ when the run started
            "bench_code": bench_code,
            "machine": ov.machine(),
            "slo": {"p99_e2e_ms": args.slo_ms, "max_error_ratio": plan.slo.max_error_ratio,
                    "rule": "a probe passes with <= 1% errors and <= 1% of requests over the SLO end to end "
                            "(bench.loadgen.SloRule, as bench/overload.py); C0 is the highest passing rate"},
            "request": {"endpoint": "/v1/chat/completions", "stream": True, "max_tokens": args.max_tokens,
                        "ignore_eos": True, "arrivals": "Poisson (open loop)", "criticality_header": None,
                        "prompts": "new in every probe (the semantic cache never answers)"},
            "calibration": {"probe_s": plan.probe_s, "probe_s_rule": "max(probe_s, 20 / rate), at most 2 x probe_s",
                            "start_rps": args.start_rps, "growth": args.growth, "bisect_steps": args.bisect},
            "deploy": ("each revision's own serve_config.yaml, `serve deploy` to a private local Ray cluster started "
                       "with the revision's worktree as working directory and PYTHONPATH; changed only: HTTP port, "
                       "data folder, args.model.dtype float32 on both (this CPU has no native bfloat16: emulated "
                       "bf16 is about 5x slower; the after revision resolves dtype auto to float32 here anyway, "
                       "the before revision would run bf16), and where the revision has admission control its "
                       "policy's slo.e2e_p99_ms = the SLO with degradation.admission.enabled false; level 0 "
                       "pinned with POST /admin/brownout/override {level: 0, ttl_s: 3600}"),
            "unloaded": "bench.overload.warm_up: a 2 req/s burst, then 4 requests one at a time (e2e p50)",
            "order": [f"{r['side']} {r['revision']}" for r in results],
            "stopped_for_budget": stopped_for_budget,
            "wall_s": round(total_s, 1),
            "other_cpu_cores_mean": ov.NOISE.mean(0.0, float("inf")),
        },
        "summary": summary,
        "runs": results,
    }
    if args.cpu_profile_rps:
        out["what"] = ("where the level-0 path spends the machine: CPU seconds per served request by process "
                       "group, at one constant Poisson rate, for the revision before the issue-8 refactor and "
                       "after it, alternating")
        out["summary"] = cpu_summary(results)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print()
    if args.cpu_profile_rps:
        print(cpu_table(out["summary"]))
        ov.log(f"wrote {path.name} in {total_s / 60:.1f} min")
        return 1 if any(r.get("failed") for r in results) or not results else 0
    print(table(results, summary))
    ov.log(f"wrote {path.name} in {total_s / 60:.1f} min")
    return 1 if any(r.get("failed") for r in results) or not results else 0


if __name__ == "__main__":
    sys.exit(main())
