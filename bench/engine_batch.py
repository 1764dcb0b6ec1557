"""The vLLM engine alone, at a fixed number of requests in flight: what no admission rule can beat.

    .venv/bin/python bench/engine_batch.py [--concurrency 1,2,4,8,12,16] [--seconds 15] [--out F]
        [--enforce-eager config|true|false]

One `AsyncLLM` with the engine settings of ``serve_config.yaml``'s model args (the embedded model,
``max_num_seqs``, ``max_model_len``, ``enforce_eager``, dtype as `deployments.engine.engine_dtype`
resolves it, the KV cache), its engine-core process bound to the CPU the shipped placement gives
it (``cpu_isolation: auto``, `deployments.cpu_placement.plan`) and this process, the engine's
front end, to the others, as a model replica runs. No Ray, no HTTP, no Serve.

For each concurrency ``n`` in turn, ``n`` clients each send a request as soon as their last one
finished (a closed loop: exactly ``n`` in flight, the engine's continuous batching admitting each
new one at its next step); ``--seconds`` are measured after ``--warm-s`` at that concurrency. Every
request is a chat prompt of the overload benchmark's kind (`bench.loadgen.make_prompt`, new
each time, rendered with the model's chat template) answered with exactly ``--max-tokens`` tokens
(``ignore_eos``). Per concurrency: completions per second and the latencies' median and p99.
``--enforce-eager true|false`` runs the engine eager or compiled instead of as serve_config.yaml
says, to compare the two modes on the same engine (run both, back to back, in either order).

Why: the overload benchmark asks at 1.5 x C0 for both ">= 95% within the SLO" and "pinned-0 p99 /
adaptive p99 >= 5". Carrying a rate takes at least the concurrency at which the engine alone
completes that rate, and a request then takes at least what it takes the engine alone there
(the service only adds to it). So `ceiling` gives, for a rate served and pinned level 0's p99,
the highest that ratio can be: pinned-0 p99 over the engine alone's p99 at the lowest
concurrency that carries the rate (and over its median, a looser bound). And `frontier` asks
whether any door could meet both at the rate the standard-only run was offered: a simulated
door with a waiting room of fixed size in front of the engine's measured speeds, no serving
overhead and no spread of step times (the best case), the share within the SLO against the
ratio, room by room.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deployments.window import percentile  # noqa: E402  (the project's one percentile: numpy's linear rule)

# the two 1.5 x C0 items: the share within the SLO, and pinned-0 p99 / adaptive p99
WITHIN_SLO_TARGET, RATIO_TARGET = 0.95, 5.0


def meets_both(within_slo: float, ratio: float) -> bool:
    """Whether a point meets both 1.5 x C0 items."""
    return within_slo >= WITHIN_SLO_TARGET and ratio >= RATIO_TARGET


def row(concurrency: int, spans: Sequence[tuple[float, float]], start: float, end: float) -> dict[str, Any]:
    """One concurrency's figures from its requests' ``(sent, done)`` times, measured in the window
    ``[start, end]`` of a closed loop that ran before and after it: completions per second are
    those done within it; latencies, those of requests sent and done within it (a request that
    straddles an edge ran partly at another load)."""
    if end <= start:
        raise ValueError(f"concurrency {concurrency}: empty window {start:g}..{end:g}")
    done = [(a, b) for a, b in spans if start <= b <= end]
    latencies = [b - a for a, b in done if a >= start]
    if not latencies:
        raise ValueError(f"concurrency {concurrency}: no request both sent and done within {end - start:g} s")
    return {"concurrency": concurrency, "completed": len(done), "measured": len(latencies),
            "throughput_rps": round(len(done) / (end - start), 3),
            "e2e_ms_p50": round(1000 * statistics.median(latencies), 1),
            "e2e_ms_p99": round(1000 * (percentile(latencies, 99) or 0.0), 1)}


def ceiling(rows: Sequence[Mapping[str, Any]], served_rps: float, pinned0_p99_ms: float) -> dict[str, Any]:
    """The highest pinned-0 p99 / adaptive p99 a run that served ``served_rps`` can show: pinned
    level 0's p99 over the engine alone's latency at the lowest measured concurrency that
    completes at least that rate. None where no measured concurrency carries it (then the run
    served more than the engine alone did here: the machine was faster, and nothing is bounded)."""
    carrying = sorted((r for r in rows if r["throughput_rps"] >= served_rps), key=lambda r: r["concurrency"])
    if not carrying:
        return {"served_rps": served_rps, "concurrency": None, "ratio_ceiling_p99": None, "ratio_ceiling_p50": None}
    r = carrying[0]
    return {"served_rps": served_rps, "concurrency": r["concurrency"],
            "engine_alone_e2e_ms_p50": r["e2e_ms_p50"], "engine_alone_e2e_ms_p99": r["e2e_ms_p99"],
            "ratio_ceiling_p99": round(pinned0_p99_ms / r["e2e_ms_p99"], 2),
            "ratio_ceiling_p50": round(pinned0_p99_ms / r["e2e_ms_p50"], 2)}


def overload_ceilings(rows: Sequence[Mapping[str, Any]], doc: Mapping[str, Any], name: str,
                      slots: int | None = None) -> dict[str, Any]:
    """`ceiling` for an overload-benchmark result: at 1.5 x C0, for the adaptive runs (the mix and
    standard only) at the rate each served, against that file's pinned level 0's p99; with the
    engine's batch (``slots``), also the `frontier` at the standard-only run's offered rate."""
    from bench.overload import ONE_CLASS_SUFFIX, _find

    pinned = _find(doc["runs"], "pinned0 @1.5x")
    if pinned is None:
        raise SystemExit(f"{name}: no 'pinned0 @1.5x' run")
    p99 = pinned["overall"]["e2e_ms"]["p99"]
    out: dict[str, Any] = {"file": name, "pinned0_p99_ms": p99}
    found = {run: _find(doc["runs"], run) for run in ("adaptive @1.5x", f"adaptive @1.5x{ONE_CLASS_SUFFIX}")}
    for run, report in found.items():
        if report is not None:
            o = report["overall"]
            out[run] = {**ceiling(rows, o["throughput_rps"], p99), "measured_ratio": round(p99 / o["e2e_ms"]["p99"], 2)}
    one = found[f"adaptive @1.5x{ONE_CLASS_SUFFIX}"]
    if one is not None and slots:
        slo_s = float(doc["meta"]["slo"]["p99_e2e_ms"]) / 1000
        out["frontier at the standard-only run's offered rate"] = frontier(
            rows, one["overall"]["offered_rps"], p99, slots, slo_s)
        c3_model = model_capacity(rows, slots, slo_s)
        both = highest_rate_meeting_both(rows, slots, slo_s, p99)
        c0, c3 = (doc.get("capacity", {}).get(k, {}).get("capacity_rps") for k in ("C0", "C3"))
        out["where both can hold"] = {
            "model_c3_rps": c3_model, "highest_rate_meeting_both_rps": both,
            "highest_rate_meeting_both / model C3": None if both is None else round(both / c3_model, 3),
            "this run: 1.5 x C0 / C3": None if not (c0 and c3) else round(1.5 * c0 / c3, 3)}
    return out


def latency_at(rows: Sequence[Mapping[str, Any]], n: float) -> float:
    """The engine alone's median latency (s) with ``n`` in flight: linear between measured
    concurrencies, the nearest measured one outside them."""
    pts = sorted((r["concurrency"], r["e2e_ms_p50"] / 1000) for r in rows)
    if n <= pts[0][0]:
        return pts[0][1]
    for (a, la), (b, lb) in zip(pts, pts[1:]):
        if a <= n <= b:
            return la + (lb - la) * (n - a) / (b - a)
    return pts[-1][1]


def simulate_door(rows: Sequence[Mapping[str, Any]], rate_rps: float, waiting_room: int, slots: int,
                  slo_s: float, horizon_s: float = 20000.0, seed: int = 1) -> dict[str, float]:
    """The best a door can do with a fixed waiting room, on the engine alone's speeds: Poisson
    arrivals at ``rate_rps``; up to ``slots`` run at once and share the engine (with ``n`` running,
    each completes ``1 / latency_at(n)`` of its work per second, so ``n`` started together take
    the measured median); up to ``waiting_room`` more wait, first come first served, for a slot;
    the rest are refused on arrival. No serving overhead and no spread of step times: a real
    service only adds to the latencies. Returns the share refused, the admitted requests' p99
    (s) and the share of all requests answered within ``slo_s``."""
    rng = random.Random(seed)
    t, next_arrival = 0.0, rng.expovariate(rate_rps)
    running: list[list[float]] = []  # [work left, arrival time]
    waiting: list[float] = []
    latencies: list[float] = []
    refused = arrived = 0
    while t < horizon_s:
        speed = 1.0 / latency_at(rows, len(running)) if running else 0.0
        to_done = min(r[0] for r in running) / speed if running else float("inf")
        step = min(next_arrival - t, to_done)
        for r in running:
            r[0] -= speed * step
        t += step
        if next_arrival <= t:
            arrived += 1
            if len(running) < slots:
                running.append([1.0, t])
            elif len(waiting) < waiting_room:
                waiting.append(t)
            else:
                refused += 1
            next_arrival = t + rng.expovariate(rate_rps)
        else:
            latencies += [t - r[1] for r in running if r[0] <= 1e-9]
            running = [r for r in running if r[0] > 1e-9]
            while waiting and len(running) < slots:
                running.append([1.0, waiting.pop(0)])
    if not latencies:
        raise ValueError(f"no request completed within {horizon_s:g} s at {rate_rps:g} req/s")
    return {"refused": refused / arrived, "p99_s": percentile(latencies, 99) or 0.0,
            "within_slo": sum(1 for x in latencies if x <= slo_s) / arrived}


def frontier(rows: Sequence[Mapping[str, Any]], rate_rps: float, pinned0_p99_ms: float, slots: int, slo_s: float,
             rooms: Sequence[int] = (0, 1, 2, 3, 4, 6, 8, 12, 16), horizon_s: float = 20000.0) -> dict[str, Any]:
    """`simulate_door` for each waiting room: the trade between the share answered within the SLO
    and pinned-0 p99 / p99; ``both`` says whether any room gives >= 95% within and a ratio >= 5."""
    points = []
    for room in rooms:
        sim = simulate_door(rows, rate_rps, room, slots, slo_s, horizon_s)
        points.append({"waiting_room": room, "refused": round(sim["refused"], 4), "within_slo": round(sim["within_slo"], 4),
                       "p99_ms": round(1000 * sim["p99_s"], 1), "ratio": round(pinned0_p99_ms / (1000 * sim["p99_s"]), 2)})
    return {"rate_rps": rate_rps, "pinned0_p99_ms": pinned0_p99_ms, "points": points,
            "both": any(meets_both(p["within_slo"], p["ratio"]) for p in points)}


def model_capacity(rows: Sequence[Mapping[str, Any]], slots: int, slo_s: float, horizon_s: float = 6000.0) -> float:
    """C3 in the model: the highest Poisson rate (to 0.1 req/s) whose p99 stays within ``slo_s``
    with every request admitted (an unbounded waiting room), as the benchmark calibrates C3."""
    lo, hi = 0.1, max(r["throughput_rps"] for r in rows) * 1.5
    while hi - lo > 0.1:
        mid = (lo + hi) / 2
        if simulate_door(rows, mid, 10**9, slots, slo_s, horizon_s)["p99_s"] <= slo_s:
            lo = mid
        else:
            hi = mid
    return round(lo, 1)


def highest_rate_meeting_both(rows: Sequence[Mapping[str, Any]], slots: int, slo_s: float, pinned0_p99_ms: float,
                              rooms: Sequence[int] = (0, 1, 2, 3, 4, 6, 8), step_rps: float = 0.25,
                              horizon_s: float = 6000.0) -> float | None:
    """The highest rate, on a grid of ``step_rps``, at which some waiting room gives both >= 95%
    within the SLO and pinned0_p99_ms / p99 >= 5 (`meets_both`; None: not even the lowest step)."""
    best = None
    rate = step_rps
    while rate <= max(r["throughput_rps"] for r in rows) * 1.2:
        sims = (simulate_door(rows, rate, room, slots, slo_s, horizon_s) for room in rooms)
        if any(meets_both(sim["within_slo"], pinned0_p99_ms / (1000 * sim["p99_s"])) for sim in sims):
            best = rate
        elif best is not None:
            break  # past the first rate that fails after one that held
        rate = round(rate + step_rps, 6)
    return best


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: {text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"--concurrency: {text!r}: give integers >= 1")
    return values


def engine_args() -> dict[str, Any]:
    """serve_config.yaml's model args that the engine takes."""
    import yaml

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    return dict(config["applications"][0]["args"]["model"])


def engine_settings(model: Mapping[str, Any]) -> dict[str, Any]:
    """The engine settings every benchmark gives its engines, Brownout's and Ray's built-in app's
    alike, from ``model`` (serve_config.yaml's model args): seed 0, and ``dtype`` as set, where
    "auto" is left for Brownout to resolve; an engine built directly (the built-in app's, this
    module's) gets `direct_engine` of them, or the comparison is not fair."""
    return {"max_num_seqs": model["max_num_seqs"], "max_model_len": model["max_model_len"],
            "enforce_eager": model["enforce_eager"], "dtype": model.get("dtype", "auto"), "seed": 0}


def direct_engine(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` (`engine_settings`) for an engine built directly (Ray's built-in app's, this
    module's): ``dtype`` resolved with `deployments.engine.engine_dtype`, not "auto" as it is,
    which Brownout resolves the same way, or the comparison is not fair."""
    from deployments.engine import engine_dtype

    return {**settings, "dtype": engine_dtype(settings["dtype"])}


async def measure(concurrency: Sequence[int], seconds: float, warm_s: float, max_tokens: int,
                  enforce_eager: bool | None = None) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from bench.loadgen import make_prompt
    from deployments import cpu_placement as cp
    from deployments.engine import engine_dtype
    from deployments.tiny_model import ensure_tiny_model

    m = engine_args()
    if enforce_eager is not None:  # --enforce-eager: the other engine mode than serve_config's, to compare
        m["enforce_eager"] = enforce_eager
    if m["source"] != "embedded:tiny":
        raise SystemExit(f"model.source={m['source']!r}: this benchmark runs the embedded model only")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(m["kv_cache_space_gib"]))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(ensure_tiny_model()), **direct_engine(engine_settings(m)), disable_log_stats=True))
    placement, why = cp.plan("auto", cp.node_cpus(), 1)
    cores = cp.children_named(cp.parent_map(), os.getpid(), cp.ENGINE_COMM)
    if placement is not None and cores:
        for pid in cores:
            cp.set_process_cpus(pid, placement.engine)
        cp.set_process_cpus(os.getpid(), placement.service)
    tokenizer = engine.get_tokenizer()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def one(spans: list[tuple[float, float]]) -> None:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": make_prompt(rng)}],
                                               tokenize=False, add_generation_prompt=True)
        t0 = time.perf_counter()
        async for _ in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
            pass
        spans.append((t0, time.perf_counter()))

    async def closed_loop(n: int, until: float, spans: list[tuple[float, float]]) -> None:
        """``n`` clients, each sending its next request when its last is done, until ``until``."""
        async def client() -> None:
            while time.perf_counter() < until:
                await one(spans)
        await asyncio.gather(*(client() for _ in range(n)))

    rows = []
    try:
        await closed_loop(max(concurrency), time.perf_counter() + 2 * warm_s, [])  # the first batches are slow
        for n in concurrency:
            spans: list[tuple[float, float]] = []
            start = time.perf_counter() + warm_s
            end = start + seconds
            await closed_loop(n, end, spans)  # the loop runs on past the window until its last request is done
            rows.append(row(n, spans, start, end))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.shutdown()
        del engine  # its __del__ shuts down again: now, not at exit once its modules are gone
        gc.collect()
    return {"rows": rows, "placement": {"engine_cpus": list(placement.engine) if placement else None,
                                        "front_end_cpus": list(placement.service) if placement else None,
                                        "why": why, "engine_processes_bound": len(cores)},
            "engine": {k: m[k] for k in ("max_num_seqs", "max_model_len", "enforce_eager", "kv_cache_space_gib")},
            "dtype_in_use": engine_dtype(m.get("dtype", "auto")), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8,12,16", help="requests in flight, in turn (default 1,2,4,8,12,16)")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per concurrency")
    ap.add_argument("--warm-s", type=float, default=3.0, help="unmeasured seconds before each")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--enforce-eager", choices=("config", "true", "false"), default="config",
                    help="the engine eager (true) or compiled (false); default: serve_config.yaml's")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    ap.add_argument("--overload", type=Path, nargs="*", default=[],
                    help="overload-benchmark results: the ceiling of pinned-0 p99 / adaptive p99 at 1.5 x C0 for each")
    args = ap.parse_args(argv)
    concurrency = parse_concurrency(args.concurrency)
    overload = {p: json.loads(p.read_text()) for p in args.overload}  # unreadable: fail before measuring
    if args.seconds <= 0 or args.warm_s < 0 or args.max_tokens < 1:
        raise SystemExit("--seconds must be > 0, --warm-s >= 0, --max-tokens >= 1")
    # One compute thread, as Ray gives the model replica (num_cpus 1), set before torch loads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench import provenance
    from bench.overload import machine

    code = provenance.code_state()
    t0 = time.monotonic()
    eager = None if args.enforce_eager == "config" else args.enforce_eager == "true"
    result = asyncio.run(measure(concurrency, args.seconds, args.warm_s, args.max_tokens, eager))
    doc = {"meta": provenance.run_meta("bench/engine_batch.py", sys.argv[1:] if argv is None else argv, code, t0,
                                       machine()),
           "max_tokens": args.max_tokens, "seconds_per_concurrency": args.seconds, **result}
    if overload:
        doc["ceilings"] = [overload_ceilings(result["rows"], d, p.name, result["engine"]["max_num_seqs"])
                           for p, d in overload.items()]
        print(json.dumps(doc["ceilings"], indent=1))
    if args.out:
        provenance.write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
