"""Deployment-handle calls per request, at level 0 (every feature on) and level 3 (minimal path).

    python bench/handle_calls.py [--requests 10] [--url http://127.0.0.1:8000] \
        [--out bench/results/handle_calls.json]

Without ``--url`` it starts a private local Ray cluster and runs the default app (the builder
defaults: embedded tiny model, every enrichment on, state in a temporary folder). With ``--url``
it measures a running app (``make serve``); it pins levels through the admin API and releases
the pin at the end.

The count is the ingress's own: `serve_app.pipeline.Pipeline.handle_calls`, incremented at each
handle call it makes on the request path (the model, and one per enrichment deployment per
request phase), shown under ``ingress.pipeline.handle_calls`` in ``GET /admin/brownout``. Each
request is a distinct chat prompt without a user (so the semantic cache misses and its answer is
cacheable: every feature has work at level 0). Counters are read once background side effects
have settled. Per-feature stage calls (``ingress.pipeline.calls``) are reported too: before
batching, every stage call was a handle call, so their sum plus the model call is what the same
request cost then.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = "brownout-tiny"
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repository importable
    sys.path.insert(0, str(ROOT))

from bench.credentials import env_headers, local_secrets  # noqa: E402

HEADERS: dict[str, str] = {}  # the private app's key and admin token (local_app), if any


def admin_state(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/admin/brownout")
    r.raise_for_status()
    return r.json()


def counters(client: httpx.Client) -> tuple[dict[str, int], dict[str, int]]:
    """(handle calls per deployment, stage calls per feature), once they stop moving."""
    last = None
    for _ in range(40):
        pipeline = admin_state(client)["ingress"]["pipeline"]
        now = (dict(pipeline.get("handle_calls", {})), dict(pipeline["calls"]))
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    assert last is not None
    return last


def pin(client: httpx.Client, level: int) -> None:
    client.post("/admin/brownout/override", json={"level": level, "ttl_s": 600, "note": "handle_calls bench"}
                ).raise_for_status()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        state = admin_state(client)
        if state["level"] == level and state["ingress"]["snapshot_level"] == level:
            return
        time.sleep(0.1)
    raise RuntimeError(f"level {level} not reached")


def measure(client: httpx.Client, level: int, requests: int, rng: random.Random) -> dict[str, Any]:
    pin(client, level)
    handles0, stages0 = counters(client)
    latencies_ms = []
    for _ in range(requests):
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(8))
        t0 = time.perf_counter()
        r = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8,
                                                       "messages": [{"role": "user", "content": words}]})
        latencies_ms.append((time.perf_counter() - t0) * 1000.0)
        r.raise_for_status()
    handles1, stages1 = counters(client)
    handles = {k: handles1.get(k, 0) - handles0.get(k, 0) for k in handles1}
    stages = {k: stages1.get(k, 0) - stages0.get(k, 0) for k in stages1}
    return {
        "level": level,
        "requests": requests,
        "handle_calls_per_request": sum(handles.values()) / requests,
        "by_deployment": {k: v / requests for k, v in sorted(handles.items()) if v},
        "stage_calls_per_request": {k: v / requests for k, v in sorted(stages.items()) if v},
        # before batching and in-ingress stages: one handle call per stage call, plus the model
        "unbatched_equivalent_per_request": sum(stages.values()) / requests + 1,
        # one request at a time, for information (machine noise dominates on a shared host)
        "median_latency_ms": round(statistics.median(latencies_ms), 1),
    }


def run(url: str, requests: int) -> list[dict[str, Any]]:
    rng = random.Random(20261130)
    with httpx.Client(base_url=url, timeout=120, headers=HEADERS or env_headers()) as client:
        try:
            return [measure(client, level, requests, rng) for level in (0, 3)]
        finally:
            client.delete("/admin/brownout/override", params={"level": "true"})


def local_app() -> tuple[str, Any]:
    """A private local cluster with the default app on a free port; returns (url, cleanup)."""
    import socket

    import ray
    from ray import serve

    from serve_app.app import BrownoutArgs, build_app

    tmp = Path(tempfile.mkdtemp(prefix="bo-bench-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=str(tmp / "ray"),
             log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    auth, headers = local_secrets(tmp / "secrets")
    HEADERS.update(headers)
    serve.run(build_app(BrownoutArgs(enrichments={"data_dir": str(tmp / "data")}, auth=auth)), name="brownout",
              route_prefix="/")

    def cleanup() -> None:
        serve.shutdown()
        ray.shutdown()

    return f"http://127.0.0.1:{port}", cleanup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--url", default=None, help="a running app; default: start a private one")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "handle_calls.json")
    args = parser.parse_args(argv)
    cleanup = None
    url = args.url
    if url is None:
        url, cleanup = local_app()
    try:
        results = run(url, args.requests)
    finally:
        if cleanup is not None:
            cleanup()
    for r in results:
        print(f"level {r['level']}: {r['handle_calls_per_request']:.2f} handle calls per request "
              f"{r['by_deployment']} (unbatched, as before: {r['unbatched_equivalent_per_request']:.2f}); "
              f"median latency {r['median_latency_ms']} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"levels": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
