"""Smoke test and throughput probe of ``deployments.engine.LLMEngine`` with the tiny model.

Builds (or reuses) the tiny model, starts the real vLLM engine, then:

1. one chat completion through ``render_chat`` + ``generate``;
2. a single stream of 64 tokens (tokens/s of one request);
3. bursts of ``--concurrency`` requests at max_tokens 32 and 64 (``ignore_eos``), printing
   requests/s, tokens/s and the largest running/waiting counts seen in ``stats()``; then a
   burst of twice ``--max-num-seqs`` requests, which must show waiting requests;
4. abort: a 1000-token generation is closed after a few deltas; prints how long until the
   scheduler reports no running request. The same for a consuming task that is cancelled;
5. invalid requests (bad sampling arguments, empty or too long prompt) raise ``ValueError``.

Run from the repository root: ``python bench/engine_smoke.py [--num-layers 4 ...]``. The spec
flags override fields of ``DEFAULT_SPEC`` to compare model sizes. Prints one JSON object per
step; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.engine import EngineSettings, LLMEngine  # noqa: E402
from deployments.tiny_model import DEFAULT_SPEC, TinyModelSpec, ensure_tiny_model  # noqa: E402


def emit(step: str, **fields: Any) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


async def collect(engine: LLMEngine, prompt: str, sampling: dict[str, Any], request_id: str):
    """Run one generation to the end; returns (text, last delta)."""
    parts, last = [], None
    async for delta in engine.generate(prompt, sampling, request_id):
        parts.append(delta.text)
        last = delta
    return "".join(parts), last


async def burst(
    engine: LLMEngine, prompt: str, n: int, max_tokens: int, tag: str
) -> dict[str, Any]:
    """``n`` concurrent requests; samples ``stats()`` every 20 ms while they run."""
    sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
    peak = {"running": 0, "waiting": 0, "kv_cache_usage_ratio": 0.0, "inflight": 0}
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            s = engine.stats()
            peak["running"] = max(peak["running"], s.num_running_reqs)
            peak["waiting"] = max(peak["waiting"], s.num_waiting_reqs)
            peak["kv_cache_usage_ratio"] = max(
                peak["kv_cache_usage_ratio"], s.kv_cache_usage_ratio
            )
            peak["inflight"] = max(peak["inflight"], s.inflight)
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    start = time.perf_counter()
    results = await asyncio.gather(
        *(collect(engine, prompt, sampling, f"{tag}-{i}") for i in range(n))
    )
    elapsed_s = time.perf_counter() - start
    done.set()
    await sampler
    tokens = sum(last.completion_tokens for _, last in results)
    return {
        "requests": n,
        "max_tokens": max_tokens,
        "elapsed_s": round(elapsed_s, 2),
        "req_per_s": round(n / elapsed_s, 2),
        "tok_per_s": round(tokens / elapsed_s, 1),
        "peak": peak,
    }


async def abort_demo(engine: LLMEngine, prompt: str) -> dict[str, Any]:
    sampling = {"max_tokens": 1000, "ignore_eos": True}
    gen = engine.generate(prompt, sampling, "abort-demo")
    seen = 0
    async for delta in gen:
        seen += delta.new_tokens
        if seen >= 5:
            break
    before = engine.stats()
    closed_at = time.perf_counter()
    await gen.aclose()
    drop_s = None
    while time.perf_counter() - closed_at < 1.0:
        if engine.stats().num_running_reqs == 0:
            drop_s = time.perf_counter() - closed_at
            break
        await asyncio.sleep(0.005)
    after = engine.stats()
    return {
        "tokens_before_close": seen,
        "running_before": before.num_running_reqs,
        "inflight_before": before.inflight,
        "running_zero_after_s": None if drop_s is None else round(drop_s, 3),
        "running_after": after.num_running_reqs,
        "inflight_after": after.inflight,
        "aborted_total": after.aborted_total,
    }


async def invalid_requests(engine: LLMEngine, prompt: str) -> dict[str, str | None]:
    """Each bad request must raise ValueError on its first iteration."""
    cases = {
        "unknown_key": ({"max_tokens": 4, "bogus": 1}, prompt),
        "bad_temperature": ({"max_tokens": 4, "temperature": -1.0}, prompt),
        "prompt_too_long": ({"max_tokens": 4}, prompt * 80),
        "empty_prompt": ({"max_tokens": 4}, ""),
    }
    errors: dict[str, str | None] = {}
    for name, (sampling, text) in cases.items():
        try:
            await anext(engine.generate(text, sampling, f"invalid-{name}"))
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)[:120]
    return errors


async def cancel_demo(engine: LLMEngine, prompt: str) -> dict[str, Any]:
    """Cancel the task consuming a long generation; the request must leave the scheduler."""
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(prompt, {"max_tokens": 1000, "ignore_eos": True}, "cancel"):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    aborted_before = engine.stats().aborted_total
    task.cancel()
    cancelled_at = time.perf_counter()
    drop_s = None
    while time.perf_counter() - cancelled_at < 1.0:
        if engine.stats().num_running_reqs == 0 and task.done():
            drop_s = time.perf_counter() - cancelled_at
            break
        await asyncio.sleep(0.005)
    return {
        "running_zero_after_s": None if drop_s is None else round(drop_s, 3),
        "aborted": engine.stats().aborted_total - aborted_before,
        "inflight_after": engine.stats().inflight,
    }


async def main_async(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in vars(args).items() if k in _SPEC_FIELDS and v is not None}
    spec = dataclasses.replace(DEFAULT_SPEC, **overrides)
    t0 = time.perf_counter()
    model_dir = ensure_tiny_model(spec=spec)
    emit("model", spec=dataclasses.asdict(spec), path=model_dir.name,
         build_or_load_s=round(time.perf_counter() - t0, 2))  # fmt: skip

    settings = EngineSettings(
        model=str(model_dir), max_num_seqs=args.max_num_seqs, dtype=args.dtype
    )
    engine = LLMEngine(settings)
    t0 = time.perf_counter()
    await engine.start()
    emit("start", engine_start_s=round(time.perf_counter() - t0, 2), settings=settings.model_dump())

    failures: list[str] = []
    try:
        prompt = engine.render_chat([{"role": "user", "content": "Tell me about the weather."}])
        text, last = await collect(engine, prompt, {"max_tokens": 24, "temperature": 0.8}, "chat-0")
        emit("chat", prompt=prompt, prompt_tokens=engine.count_tokens(prompt), text=text,
             last_delta=dataclasses.asdict(last))  # fmt: skip
        if last is None or last.finish_reason is None:
            failures.append("chat: no finish_reason on the last delta")

        await burst(engine, prompt, 4, 8, "warmup")
        t0 = time.perf_counter()
        _, last = await collect(engine, prompt, {"max_tokens": 64, "ignore_eos": True}, "single")
        single_s = time.perf_counter() - t0
        emit("single_stream", tokens=last.completion_tokens,
             tok_per_s=round(last.completion_tokens / single_s, 1))  # fmt: skip

        for max_tokens in (32, 64):
            result = await burst(engine, prompt, args.concurrency, max_tokens, f"burst{max_tokens}")
            emit("burst", **result)
            if result["peak"]["running"] == 0:
                failures.append(f"burst {max_tokens}: stats never showed a running request")
        # Twice as many requests as batch slots: the scheduler must report a queue.
        result = await burst(engine, prompt, 2 * args.max_num_seqs, 32, "overflow")
        emit("overflow_burst", **result)
        if result["peak"]["waiting"] == 0:
            failures.append("overflow burst: stats never showed a waiting request")

        result = await abort_demo(engine, prompt)
        emit("abort", **result)
        if result["running_zero_after_s"] is None:
            failures.append("abort: running requests did not drop to 0 within 1 s")
        result = await cancel_demo(engine, prompt)
        emit("cancel", **result)
        if result["running_zero_after_s"] is None or result["aborted"] != 1:
            failures.append("cancel: the cancelled request was not aborted within 1 s")

        errors = await invalid_requests(engine, prompt)
        emit("invalid_requests", errors=errors)
        failures += [f"invalid request {k!r} did not raise ValueError" for k, v in errors.items()
                     if v is None]  # fmt: skip
        emit("stats", **dataclasses.asdict(engine.stats()))
    finally:
        await engine.shutdown()
    emit("done", ok=not failures, failures=failures)
    return 1 if failures else 0


_SPEC_FIELDS = {f.name for f in dataclasses.fields(TinyModelSpec)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    for name in sorted(_SPEC_FIELDS):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None)
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
