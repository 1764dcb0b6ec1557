"""Brownout's ingress path vs Ray's built-in `ray.serve.llm` OpenAI app, side by side, one run.

    python bench/overhead.py [--requests 60] [--max-tokens 32] [--out bench/results/overhead.json]

Three apps run in one Ray cluster on the same tiny model folder with the same engine settings
(max_num_seqs, max_model_len, enforce_eager, dtype, seed, 1 GiB KV cache):

- ``builtin``: Ray's ``build_openai_app`` (LLMServer + OpenAiIngress);
- ``core``: Brownout's core path: its ingress and VLLMModel, no enrichment deployments (what
  the minimal path costs at any level);
- ``full``: Brownout at level 0 with every enrichment on (real embeddings, fsync'd audit log,
  SQLite, ...): what the optional work costs, for information.

Requests go one at a time over HTTP on loopback, rotating between the apps so that machine
noise hits all alike; each asks for exactly ``max_tokens`` tokens (``ignore_eos``, temperature
0). Prints the median end-to-end latencies and the ratios to the built-in app; the target is
``core / builtin <= 1.10``.

The cluster is given 6 logical CPUs: each vLLM replica reserves one and the built-in app needs
its own ingress and router, which do not fit in 2 logical CPUs; only one request runs at a time,
so over-subscription does not distort the measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from deployments.engine import engine_dtype

ENGINE = {"max_num_seqs": 16, "max_model_len": 1024, "enforce_eager": True, "dtype": "auto", "seed": 0}
MODEL_NAME = "brownout-tiny"


HEADERS: dict[str, str] = {}  # the key and admin token of the private apps (`deploy`)


def deploy(port: int, model_dir: str, data_dir: str) -> None:
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from serve_app.app import BrownoutArgs, ModelArgs, build_app

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    model = ModelArgs(source=model_dir, served_model_name=MODEL_NAME, kv_cache_space_gib=1, **ENGINE)
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
        engine_kwargs={**ENGINE, "dtype": engine_dtype(ENGINE["dtype"])},  # not "auto": see engine_dtype
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    )
    builtin = build_openai_app({"llm_configs": [builtin_cfg],
                                "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})
    serve.run(builtin, name="builtin", route_prefix="/builtin")


def one(client: httpx.Client, url: str, max_tokens: int, i: int) -> tuple[float, int]:
    # a different prompt each time: the full path's semantic cache must not answer for the model
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Tell me story number {i} of the sea."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "user": f"user-{i % 1000:04d}"}
    t0 = time.perf_counter()
    r = client.post(url, json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()["usage"]["completion_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=60, help="measured requests per app")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import logging

    import ray

    from deployments.tiny_model import ensure_tiny_model

    logging.getLogger("httpx").setLevel(logging.WARNING)

    model_dir = str(ensure_tiny_model())
    tmp = tempfile.mkdtemp(prefix="bo-bench-", dir="/tmp")
    ray.init(address="local", num_cpus=6, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    try:
        deploy(args.port, model_dir, tempfile.mkdtemp(prefix="bo-bench-data-"))
        base = f"http://127.0.0.1:{args.port}"
        urls = {name: f"{base}/{name}/v1/chat/completions" for name in ("builtin", "core", "full")}
        lat: dict[str, list[float]] = {k: [] for k in urls}
        names = list(urls)
        with httpx.Client(timeout=120, headers=HEADERS) as client:
            for w in range(args.warmup):
                for url in urls.values():
                    one(client, url, args.max_tokens, -1 - w)
            for i in range(args.requests):
                for name in names[i % 3:] + names[: i % 3]:  # rotate who goes first
                    dt, tokens = one(client, urls[name], args.max_tokens, i)
                    assert tokens == args.max_tokens, (name, tokens)
                    lat[name].append(dt * 1000)
        med = {k: statistics.median(v) for k, v in lat.items()}
        result = {
            "requests_per_app": args.requests,
            "max_tokens": args.max_tokens,
            "concurrency": 1,
            "engine": ENGINE,
            "dtype_in_use": engine_dtype(ENGINE["dtype"]),  # all three engines: what "auto" resolves to here
            "median_ms": {k: round(v, 2) for k, v in med.items()},
            "p90_ms": {k: round(sorted(v)[int(0.9 * len(v))], 2) for k, v in lat.items()},
            "ratio_core_over_builtin": round(med["core"] / med["builtin"], 4),
            "ratio_full_over_builtin": round(med["full"] / med["builtin"], 4),
            "target_ratio_max": 1.10,
        }
        result["meets_target"] = result["ratio_core_over_builtin"] <= result["target_ratio_max"]
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
