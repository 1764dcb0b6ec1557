"""Brownout's ingress path vs Ray's built-in `ray.serve.llm` OpenAI app, side by side, one run.

    python bench/overhead.py [--requests 60] [--max-tokens 32] [--out bench/results/overhead.json]

Both apps run in one Ray cluster on the same tiny model folder with the same engine settings
(max_num_seqs, max_model_len, enforce_eager, dtype, seed, 1 GiB KV cache). Requests go one at a
time over HTTP on loopback, alternating between the apps (A, B, A, B, ...) so that machine noise
hits both alike; each asks for exactly ``max_tokens`` tokens (``ignore_eos``, temperature 0).
Prints both median end-to-end latencies and the ratio Brownout / built-in.

The cluster is given 4 logical CPUs: each vLLM replica reserves one CPU and the built-in app
needs its own ingress and router, which do not fit in 2 logical CPUs; only one request runs at a
time, so over-subscription does not distort the measurement.
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

ENGINE = {"max_num_seqs": 16, "max_model_len": 1024, "enforce_eager": True, "dtype": "auto", "seed": 0}
MODEL_NAME = "brownout-tiny"


def deploy(port: int, model_dir: str) -> None:
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from serve_app.app import BrownoutArgs, ModelArgs, build_app

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    ours = build_app(BrownoutArgs(model=ModelArgs(source=model_dir, served_model_name=MODEL_NAME,
                                                  kv_cache_space_gib=1, **ENGINE)))
    serve.run(ours, name="brownout", route_prefix="/brownout")
    builtin_cfg = LLMConfig(
        model_loading_config={"model_id": MODEL_NAME, "model_source": model_dir},
        accelerator_config={"kind": "cpu"},
        engine_kwargs=dict(ENGINE),
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    )
    builtin = build_openai_app({"llm_configs": [builtin_cfg],
                                "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})
    serve.run(builtin, name="builtin", route_prefix="/builtin")


def one(client: httpx.Client, url: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story about the sea."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
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

    import ray

    from deployments.tiny_model import ensure_tiny_model

    model_dir = str(ensure_tiny_model())
    tmp = tempfile.mkdtemp(prefix="bo-bench-", dir="/tmp")
    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    try:
        deploy(args.port, model_dir)
        base = f"http://127.0.0.1:{args.port}"
        urls = {"brownout": f"{base}/brownout/v1/chat/completions",
                "builtin": f"{base}/builtin/v1/chat/completions"}
        lat: dict[str, list[float]] = {k: [] for k in urls}
        with httpx.Client(timeout=120) as client:
            for _ in range(args.warmup):
                for url in urls.values():
                    one(client, url, args.max_tokens)
            for i in range(args.requests):
                order = list(urls.items()) if i % 2 == 0 else list(urls.items())[::-1]
                for name, url in order:
                    dt, tokens = one(client, url, args.max_tokens)
                    assert tokens == args.max_tokens, (name, tokens)
                    lat[name].append(dt * 1000)
        med = {k: statistics.median(v) for k, v in lat.items()}
        result = {
            "requests_per_app": args.requests,
            "max_tokens": args.max_tokens,
            "concurrency": 1,
            "engine": ENGINE,
            "median_ms": {k: round(v, 2) for k, v in med.items()},
            "p90_ms": {k: round(sorted(v)[int(0.9 * len(v))], 2) for k, v in lat.items()},
            "ratio_brownout_over_builtin": round(med["brownout"] / med["builtin"], 4),
            "target_ratio_max": 1.10,
        }
        result["meets_target"] = result["ratio_brownout_over_builtin"] <= result["target_ratio_max"]
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
