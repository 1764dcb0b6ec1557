"""Streamed answers in larger increments at a high level: what it saves, side by side.

    .venv/bin/python bench/stream_shaping.py --rates 12,15 --repeats 2 --seconds 40 \
        --out bench/results/stream_shaping.json

The shipped policy streams in increments of 4 tokens at level 2 and 8 at level 3
(``shape.stream_interval``, `policies.shaping`): the first token and the last increment still
go out at once, and each hop (the engine's output processor, the model replica's stream to the
ingress, one SSE event, the Serve proxy's message) handles a fraction of the items. This
deploys Brownout as the overload benchmark does (a private Ray cluster, the shipped config, the
model's engine on a CPU of its own where it can be), switches admission off (every request is
admitted, so both arms serve the same requests) and pins level 3. Then, for each rate and
repeat, it sends the same open-loop Poisson schedule twice (`bench.overload.Plan.schedule_seed`;
other prompts each time), once with the policy as shipped ("increments") and once with every
level's ``stream_interval`` taken out ("token by token"), alternating which goes first (A B, then
B A). Each arm's policy is applied through the policy actor, and a streamed probe's
``X-Brownout-Shaped`` header confirms the ingress has it before the run.

Per run: the clients' end-to-end and first-token latencies (from each request's scheduled time),
and the CPU seconds that each process of the private cluster used over the run, per request
served, by kind: the Serve proxy, the ingress replica, the model replica, its engine core, and
the rest of the cluster. The summary gives, per rate, each arm's median over the repeats and the
ratio increments / token by token. Figures from one run only compare with each other.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import overload as ov  # noqa: E402
from bench import provenance  # noqa: E402
from bench.loadgen import constant  # noqa: E402
from deployments import cpu_placement as cp  # noqa: E402

ARMS = ("increments", "token by token")
# process kinds, by what their command line names (Serve names its actors' processes)
KINDS = (("ProxyActor", "proxy"), ("Ingress", "ingress"), ("VLLMModel", "model replica"),
         ("EngineCore", "engine core"))
LEVEL = 3


def kind_of(cmdline: str) -> str:
    """The kind of one cluster process from its command line; ``other`` for the rest."""
    for needle, kind in KINDS:
        if needle in cmdline:
            return kind
    return "other"


def without_stream_interval(policy_doc: Mapping[str, Any]) -> dict[str, Any]:
    """``policy_doc`` with every level's ``shape.stream_interval`` taken out (token by token)."""
    doc = copy.deepcopy(dict(policy_doc))
    for key, lvl in doc["degradation"].items():
        if key.startswith("level") and isinstance(lvl, dict) and isinstance(lvl.get("shape"), dict):
            lvl["shape"].pop("stream_interval", None)
    return doc


def expected_header(policy_doc: Mapping[str, Any], level: int = LEVEL) -> str | None:
    """What a streamed request's ``X-Brownout-Shaped`` says at ``level`` under ``policy_doc``
    (a request of at most every cap, from an engine streaming token by token)."""
    from policies.config import parse_policy

    interval = parse_policy(dict(policy_doc)).shape_at(level).stream_interval
    return None if interval is None or interval <= 1 else f"stream_interval=1->{interval}"


def cpu_by_pid(root_pid: int) -> dict[int, tuple[str, float]]:
    """Every process below ``root_pid`` (the private cluster is this command's child) -> (kind,
    CPU seconds used so far, user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in cp.descendants(cp.parent_map(), root_pid) - {root_pid}:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (kind_of(cmd), (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_used(before: Mapping[int, tuple[str, float]], after: Mapping[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per kind between two samples, over the processes in both."""
    used: dict[str, float] = {}
    for pid, (kind, s) in after.items():
        if pid in before:
            used[kind] = used.get(kind, 0.0) + s - before[pid][1]
    return {k: round(v, 3) for k, v in sorted(used.items())}


def per_request_ms(used: Mapping[str, float], served: int) -> dict[str, float | None]:
    """CPU milliseconds per request served, per kind and in all."""
    if served <= 0:
        return {k: None for k in (*used, "all")}
    out: dict[str, float | None] = {k: round(1000.0 * v / served, 2) for k, v in used.items()}
    out["all"] = round(1000.0 * sum(used.values()) / served, 2)
    return out


def apply_arm(base: str, policy_doc: Mapping[str, Any], timeout_s: float = 20.0) -> None:
    """Apply ``policy_doc`` through the policy actor; return once a streamed probe at the pinned
    level carries the header this policy gives it."""
    import ray
    import httpx

    from policies.actor import get_policy_actor

    result = ray.get(get_policy_actor().update_config.remote(dict(policy_doc)))
    if not result.get("ok"):
        raise RuntimeError(f"policy rejected: {result}")
    want = expected_header(policy_doc)
    body = {"model": ov.MODEL, "messages": [{"role": "user", "content": "stream shaping probe"}],
            "max_tokens": 4, "stream": True}
    deadline = time.monotonic() + timeout_s
    got: str | None = "?"
    with httpx.Client(base_url=base, headers=ov.HEADERS, timeout=30) as c:
        while time.monotonic() < deadline:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                r.read()
                got = r.headers.get("X-Brownout-Shaped")
            if got == want:
                return
            time.sleep(0.5)
    raise RuntimeError(f"the ingress shaped a stream as {got!r}, not {want!r}, {timeout_s:g} s after the policy")


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per rate: each arm's median over its repeats, and increments / token by token."""
    figures = {
        "e2e p50 ms": lambda r: r["e2e_ms"]["p50"], "e2e p99 ms": lambda r: r["e2e_ms"]["p99"],
        "ttft p50 ms": lambda r: r["ttft_ms"]["p50"], "ttft p99 ms": lambda r: r["ttft_ms"]["p99"],
        "served req/s": lambda r: r["throughput_rps"],
    }
    out: dict[str, Any] = {}
    for rate in sorted({r["rate_rps"] for r in runs}):
        row: dict[str, Any] = {}
        for arm in ARMS:
            mine = [r for r in runs if r["rate_rps"] == rate and r["arm"] == arm]
            med: dict[str, Any] = {}
            for name, get in figures.items():
                vals = [get(r) for r in mine if get(r) is not None]
                med[name] = round(statistics.median(vals), 3) if vals else None
            kinds = sorted({k for r in mine for k in r["cpu_ms_per_request"]})
            med["cpu ms per request"] = {
                k: round(statistics.median(v), 2) for k in kinds
                if (v := [r["cpu_ms_per_request"][k] for r in mine if r["cpu_ms_per_request"].get(k) is not None])}
            med["runs"] = len(mine)
            row[arm] = med
        a, b = row[ARMS[0]], row[ARMS[1]]
        row["increments / token by token"] = {
            name: (round(a[name] / b[name], 3) if a[name] and b[name] else None) for name in figures}
        row["increments / token by token"]["cpu ms per request"] = {
            k: round(a["cpu ms per request"][k] / v, 3) for k, v in b["cpu ms per request"].items()
            if v and k in a["cpu ms per request"]}
        out[f"{rate:g} req/s"] = row
    return out


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--rates {text!r}: give numbers separated by commas, e.g. 12,15") from None
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"--rates {text!r}: each rate must be > 0 req/s")
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="12,15", help="req/s, comma-separated (below the level-3 capacity: "
                    "this measures the cost of serving, not of refusing)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per rate and arm (the arms alternate)")
    ap.add_argument("--seconds", type=float, default=40.0, help="length of each run")
    ap.add_argument("--seed", type=int, default=1, help="the schedules' seed")
    ap.add_argument("--slo-ms", type=float, default=2000.0, help="the SLO the service is deployed with")
    ap.add_argument("--out", default=str(ROOT / "bench/results/stream_shaping.json"))
    args = ap.parse_args(argv)
    rates = parse_rates(args.rates)
    if args.repeats < 1 or args.seconds <= 0:
        ap.error("--repeats must be >= 1 and --seconds > 0")

    plan = ov.Plan(ov.build_parser().parse_args(
        ["--slo-ms", str(args.slo_ms), "--only", "pinned3", "--seed", str(args.seed), "--no-progress"]))
    bench = ov.Bench(plan)
    code = provenance.code_state()  # before anything is deployed: the code this run measures
    cluster = ov.Cluster(plan, f"stream shaping at {args.rates} req/s, level {LEVEL} pinned")
    t_start = time.monotonic()
    runs: list[dict[str, Any]] = []
    shipped = copy.deepcopy(cluster.policy_doc)
    shipped["degradation"].setdefault("admission", {})["enabled"] = False  # both arms serve every request
    policies = {ARMS[0]: shipped, ARMS[1]: without_stream_interval(shipped)}
    try:
        if expected_header(shipped) is None:
            raise SystemExit(f"the shipped policy streams token by token at level {LEVEL}: nothing to compare")
        ov.deploy_unprotected(bench, cluster)
        ov.warm_up(cluster.base, plan, True, "level 0", first=True)
        ov.pin_level(cluster.base, LEVEL)
        for repeat in range(args.repeats):
            order = ARMS if repeat % 2 == 0 else ARMS[::-1]
            for rate in rates:
                for arm in order:
                    apply_arm(cluster.base, policies[arm])
                    before = cpu_by_pid(os.getpid())
                    doc = bench.run(f"{arm} @{rate:g} #{repeat + 1}", "brownout-level3", cluster.base,
                                    constant(rate, args.seconds), True, mix=None,
                                    schedule=f"{rate:g} #{repeat + 1}")
                    used = cpu_used(before, cpu_by_pid(os.getpid()))
                    o = doc["overall"]
                    served = int(o["status_counts"].get("200", 0))
                    runs.append({"arm": arm, "rate_rps": rate, "repeat": repeat + 1,
                                 "offered_rps": o["offered_rps"], "throughput_rps": o["throughput_rps"],
                                 "status_counts": o["status_counts"], "e2e_ms": o["e2e_ms"], "ttft_ms": o["ttft_ms"],
                                 "cpu_s": used, "cpu_ms_per_request": per_request_ms(used, served)})
                    ov.log(f"  {arm} @{rate:g} #{repeat + 1}: e2e {o['e2e_ms']}, ttft {o['ttft_ms']}, "
                           f"cpu ms/request {runs[-1]['cpu_ms_per_request']}")
        ov.pin_level(cluster.base, None)
    finally:
        cluster.close()
    out = {"meta": provenance.run_meta("bench/stream_shaping.py", sys.argv[1:] if argv is None else argv, code,
                                       t_start, ov.machine(), level=LEVEL, admission="off", max_tokens=plan.max_tokens,
                                       seconds=args.seconds, arms={ARMS[0]: expected_header(shipped), ARMS[1]: None},
                                       cpu_placement=bench.cpu_placement.get("brownout")),
           "summary": summarise(runs), "runs": runs}
    provenance.write_result(Path(args.out), out)
    print(json.dumps(out["summary"], indent=1))
    ov.log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
