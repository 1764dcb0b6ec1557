"""Brownout's ingress path vs Ray's built-in `ray.serve.llm` OpenAI app, side by side, one run.

    python bench/overhead.py [--requests 60] [--max-tokens 16] [--no-stream] [--out bench/results/overhead.json]

Three apps run in one Ray cluster on the same tiny model folder with the same engine settings,
serve_config.yaml's (max_num_seqs, max_model_len, enforce_eager, dtype; seed 0, 1 GiB KV cache):

- ``builtin``: Ray's ``build_openai_app`` (LLMServer + OpenAiIngress);
- ``core``: Brownout's core path: its ingress and VLLMModel, no enrichment deployments (what
  the minimal path costs at any level);
- ``full``: Brownout at level 0 with every enrichment on (real embeddings, fsync'd audit log,
  SQLite, ...): what the overload benchmark's "one at a time, Brownout level 0" measures.

Requests go one at a time over HTTP on loopback, in rounds of one request per app, the app that
goes first rotating, so that the machine's drift (its speed moves by a quarter between runs
here) falls on all three alike; the overload benchmark's own figure compares ten requests per
system taken up to twenty minutes apart. Each asks for exactly ``max_tokens`` tokens
(``ignore_eos``, temperature 0), streamed by default as the overload benchmark's are (the count
from ``stream_options.include_usage``; the time to the first token is recorded too). Reports the
median end-to-end latencies, their ratios to the built-in app's and the median of the per-round
ratios; the target is ``<= 1.10`` for both of Brownout's paths.

Brownout's engines run here with ``model.cpu_isolation: off`` unless ``--cpu-isolation`` says
otherwise. As shipped (``auto``) each Brownout model replica binds its engine to the node's last
CPU and moves every other process of the Ray node to the rest: in one cluster with the built-in
app that bound both Brownout engines to one core, moved every front end (the built-in app's
too) to the other and left the built-in app's engine unbound, so the figure depended on that
placement more than on the request path (measured on 9b1a8c7: built-in 667 ms, Brownout level 0
545 ms, 0.82 x; `bench/results/overhead_2026-12-06_avx512_isolated.json`). Alone on a machine, as `bench/overload.py` measures
them, each app has the node to itself and Brownout keeps its isolation.

The cluster is given 6 logical CPUs: each vLLM replica reserves one and the built-in app needs
its own ingress and router, which do not fit in 2 logical CPUs; only one request runs at a time,
so over-subscription does not distort the measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench import provenance  # noqa: E402
from bench.loadgen import RequestRecord, stream_one  # noqa: E402
from deployments.engine import engine_dtype  # noqa: E402

from bench.engine_batch import direct_engine, engine_args, engine_settings  # noqa: E402

ENGINE = engine_settings(engine_args())  # serve_config.yaml's: the engine settings all three apps get
MODEL_NAME = "brownout-tiny"


HEADERS: dict[str, str] = {}  # the key and admin token of the private apps (`deploy`)


def deploy(port: int, model_dir: str, data_dir: str, cpu_isolation: str = "off") -> None:
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from serve_app.app import BrownoutArgs, ModelArgs, build_app

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    model = ModelArgs(source=model_dir, served_model_name=MODEL_NAME, kv_cache_space_gib=1,
                      cpu_isolation=cpu_isolation, **ENGINE)
    from bench.credentials import local_secrets

    auth, headers = local_secrets(Path(data_dir) / "secrets")
    HEADERS.update(headers)  # the built-in app ignores them
    core = build_app(BrownoutArgs(model=model, enrichments={"enabled": False}, auth=auth))
    serve.run(core, name="core", route_prefix="/core")
    full = build_app(BrownoutArgs(model=model, enrichments={"enabled": True, "data_dir": data_dir}, auth=auth))
    serve.run(full, name="full", route_prefix="/full")
    builtin_cfg = LLMConfig(
        model_loading_config={"model_id": MODEL_NAME, "model_source": model_dir},
        accelerator_config={"kind": "cpu"},
        engine_kwargs=direct_engine(ENGINE),  # not "auto": see engine_dtype
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    )
    builtin = build_openai_app({"llm_configs": [builtin_cfg],
                                "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})
    serve.run(builtin, name="builtin", route_prefix="/builtin")


APPS = ("builtin", "core", "full")
TARGET = 1.10  # issue 10: Brownout's median one at a time <= 1.10 x the built-in app's


@dataclass(frozen=True)
class Sample:
    e2e_ms: float
    ttft_ms: float | None  # streamed only: until the first chunk with content
    tokens: int


async def one(client: httpx.AsyncClient, url: str, max_tokens: int, i: int, stream: bool) -> Sample:
    # a different prompt each time: the full path's semantic cache must not answer for the model
    body: dict[str, Any] = {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": f"Tell me story number {i} of the sea."}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "user": f"user-{i % 1000:04d}"}
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(url, json=body)
        dt = time.perf_counter() - t0
        r.raise_for_status()
        return Sample(dt * 1000, None, r.json()["usage"]["completion_tokens"])
    # the overload benchmark's streamed request, as its load generator sends and times it
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    rec = RequestRecord(i, 0.0)
    await stream_one(client, url, body, {}, rec, lambda: time.perf_counter() - t0)
    if not rec.ok or rec.e2e_ms is None:
        raise SystemExit(f"{url}: status {rec.status} {rec.error or ''}")
    return Sample(rec.e2e_ms, rec.ttft_ms, -1 if rec.completion_tokens is None else rec.completion_tokens)


async def measure(urls: Mapping[str, str], requests: int, warmup: int, max_tokens: int,
                  stream: bool) -> dict[str, list[Sample]]:
    """``warmup`` rounds unmeasured, then ``requests`` rounds of one request per app (`rotation`)."""
    samples: dict[str, list[Sample]] = {k: [] for k in urls}
    async with httpx.AsyncClient(timeout=120, headers=HEADERS) as client:
        for w in range(warmup):
            for url in urls.values():
                await one(client, url, max_tokens, -1 - w, stream)
        for i in range(requests):
            for name in rotation(i, tuple(urls)):
                sample = await one(client, urls[name], max_tokens, i, stream)
                if sample.tokens != max_tokens:
                    raise SystemExit(f"{name} answered {sample.tokens} tokens, not {max_tokens}")
                samples[name].append(sample)
    return samples


def rotation(i: int, names: Sequence[str] = APPS) -> list[str]:
    """Round ``i``'s order: each app goes first in turn."""
    k = i % len(names)
    return [*names[k:], *names[:k]]


def _p90(values: Sequence[float]) -> float:
    return sorted(values)[int(0.9 * len(values))]


def summarise(samples: Mapping[str, Sequence[Sample]], target: float = TARGET) -> dict[str, Any]:
    """Medians and p90s per app; for each Brownout path its median over the built-in app's, and
    the median of the per-round ratios (round ``i``'s request over the built-in app's in the same
    round: the two sides of one ratio seconds apart). Meets the target where both paths' ratios
    of medians are within it."""
    e2e = {k: [s.e2e_ms for s in v] for k, v in samples.items()}
    med = {k: statistics.median(v) for k, v in e2e.items()}
    out: dict[str, Any] = {
        "median_ms": {k: round(v, 2) for k, v in med.items()},
        "p90_ms": {k: round(_p90(v), 2) for k, v in e2e.items()},
    }
    ttft = {k: [s.ttft_ms for s in v if s.ttft_ms is not None] for k, v in samples.items()}
    if all(ttft.values()):
        out["ttft_median_ms"] = {k: round(statistics.median(v), 2) for k, v in ttft.items()}
    base = e2e["builtin"]
    for path in ("core", "full"):
        out[f"ratio_{path}_over_builtin"] = round(med[path] / med["builtin"], 4)
        out[f"median_round_ratio_{path}_over_builtin"] = round(
            statistics.median(a / b for a, b in zip(e2e[path], base, strict=True)), 4)
    out["target_ratio_max"] = target
    out["meets_target"] = all(out[f"ratio_{p}_over_builtin"] <= target for p in ("core", "full"))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=60, help="measured requests per app")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16, help="as the overload benchmark's requests")
    ap.add_argument("--no-stream", action="store_true", help="whole answers instead of streamed chat")
    ap.add_argument("--cpu-isolation", default="off",
                    help="Brownout's model.cpu_isolation (default off: see the module's docstring)")
    ap.add_argument("--port", type=int, default=0, help="the Serve HTTP port (0: a free one)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 1:
        ap.error("--requests and --max-tokens must be >= 1")
    stream = not args.no_stream

    import logging

    import ray

    from bench.overload import free_port, machine
    from deployments.tiny_model import ensure_tiny_model

    logging.getLogger("httpx").setLevel(logging.WARNING)

    code = provenance.code_state()  # before anything is deployed: the code this run measures
    t_start = time.monotonic()
    model_dir = str(ensure_tiny_model())
    tmp = tempfile.mkdtemp(prefix="bo-bench-", dir="/tmp")
    ray.init(address="local", num_cpus=6, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    try:
        port = args.port or free_port()
        data_dir = Path(tmp) / "data"  # the full app's audit log, SQLite store, ...
        data_dir.mkdir()
        deploy(port, model_dir, str(data_dir), args.cpu_isolation)
        base = f"http://127.0.0.1:{port}"
        urls = {name: f"{base}/{name}/v1/chat/completions" for name in APPS}
        samples = asyncio.run(measure(urls, args.requests, args.warmup, args.max_tokens, stream))
        result = {
            "meta": provenance.run_meta("bench/overhead.py", sys.argv[1:] if argv is None else argv, code, t_start,
                                        machine()),
            "requests_per_app": args.requests,
            "max_tokens": args.max_tokens,
            "stream": stream,
            "concurrency": 1,
            "cpu_isolation": args.cpu_isolation,
            "engine": ENGINE,
            "dtype_in_use": engine_dtype(ENGINE["dtype"]),  # all three engines: what "auto" resolves to here
            **summarise(samples),
            "e2e_ms": {k: [round(s.e2e_ms, 1) for s in v] for k, v in samples.items()},
        }
        print(json.dumps({k: v for k, v in result.items() if k != "e2e_ms"}, indent=2))
        if args.out:
            provenance.write_result(args.out, result)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)  # Ray's session files and the apps' data
    return 0


if __name__ == "__main__":
    sys.exit(main())
