"""How long the model's vLLM engine takes to start, and how fast it then runs, with vLLM's AOT
compile cache (its default) and with its older compile cache (``VLLM_USE_AOT_COMPILE=0``, what
`deployments.engine.cpu_compile_env` sets for a compiled engine on a CPU).

Every start of a model replica (a deploy, a replacement after a crash, a scale-up) waits for the
engine, and on a CPU vLLM 0.32 cannot load its AOT artifact back, so it compiled the model on each
start. Each run here is a fresh process (the variable must be set before vLLM reads it), the modes
alternate, and one unmeasured start of each mode comes first so that both caches are filled; then
per run: the engine's start (`LLMEngine.start`), the median of rounds of ``--batch`` concurrent
requests of ``--max-tokens`` tokens, and of one request alone. Medians and the ratio are of runs
made side by side in one invocation.

    .venv/bin/python bench/engine_start.py --repeats 3 --out bench/results/engine_start_<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's packages (deployments, bench)
    sys.path.insert(0, str(ROOT))
MODES = {"aot": "1", "cache": "0"}  # the value of VLLM_USE_AOT_COMPILE in each mode


async def _child(batch: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    from deployments.engine import EngineSettings, LLMEngine
    from deployments.tiny_model import ensure_tiny_model

    engine = LLMEngine(EngineSettings(model=str(ensure_tiny_model()), max_num_seqs=16, max_model_len=1024,
                                      enforce_eager=False))
    began = time.monotonic()
    await engine.start()
    start_s = time.monotonic() - began

    async def one(tag: str) -> None:
        async for _ in engine.generate(f"hello world {tag}", {"max_tokens": max_tokens, "ignore_eos": True,
                                                                "temperature": 0}, tag):
            pass

    batches, singles = [], []
    for r in range(rounds + 1):  # the first round of each warms up and is not counted
        t = time.monotonic()
        await asyncio.gather(*(one(f"b{r}-{i}") for i in range(batch)))
        batches.append(time.monotonic() - t)
        t = time.monotonic()
        await one(f"s{r}")
        singles.append(time.monotonic() - t)
    await engine.shutdown()
    return {"start_s": round(start_s, 2), "batch_s": round(statistics.median(batches[1:]), 3),
            "single_s": round(statistics.median(singles[1:]), 3)}


def run_child(mode: str, batch: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """One fresh process in ``mode``: its measurements (the last line it prints, as JSON)."""
    env = {**os.environ, "VLLM_USE_AOT_COMPILE": MODES[mode], "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.engine_start", "--child", "--batch", str(batch),
                           "--max-tokens", str(max_tokens), "--rounds", str(rounds)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({done.returncode}): {done.stderr[-2000:]}")
    return {"mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode the medians of the runs, and ``cache`` over ``aot`` for each (a start ratio below
    1: the cache mode starts faster)."""
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            out[mode] = {k: round(statistics.median(r[k] for r in mine), 3) for k in ("start_s", "batch_s", "single_s")}
            out[mode]["runs"] = len(mine)
    if "aot" in out and "cache" in out:
        out["cache_over_aot"] = {k: round(out["cache"][k] / out["aot"][k], 3) for k in ("start_s", "batch_s", "single_s")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per mode (alternating)")
    ap.add_argument("--batch", type=int, default=16, help="concurrent requests per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per run")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.batch < 1 or args.max_tokens < 1 or args.rounds < 1:
        raise SystemExit("--repeats, --batch, --max-tokens and --rounds must be >= 1")
    if args.child:
        print(json.dumps(asyncio.run(_child(args.batch, args.max_tokens, args.rounds))))
        return 0
    from bench import provenance
    from bench.overload import machine

    code = provenance.code_state()
    t0 = time.monotonic()
    for mode in MODES:  # fill both caches: a fresh HOME's first start compiles in either mode
        print(f"warm-up start, {mode}: {run_child(mode, 1, 4, 1)}", flush=True)
    runs = []
    for i in range(args.repeats):
        for mode in MODES:
            runs.append(run_child(mode, args.batch, args.max_tokens, args.rounds))
            print(f"run {i + 1}: {runs[-1]}", flush=True)
    summary = summarize(runs)
    if args.out:
        provenance.write_result(args.out, {
            "meta": provenance.run_meta("bench/engine_start.py", sys.argv[1:] if argv is None else argv, code, t0,
                                        machine()),
            "batch": args.batch, "max_tokens": args.max_tokens, "rounds": args.rounds, "runs": runs, "summary": summary})
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
