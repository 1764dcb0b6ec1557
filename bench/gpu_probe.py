"""Check that ``deployments.gpu.GpuProbe`` sees GPU load: idle, matmul load, idle, load.

Needs only torch (CUDA) and ``deployments/gpu.py`` with pynvml; no vLLM, no Ray. Prints one
JSON line per reading (every 0.5 s), then a JSON summary with the mean utilisation of the idle
and load phases. NVML's utilisation is an average over its last sample period, so readings in
the first ``--settle-s`` of each phase are printed but left out of the means.

Run from the repository root: ``python bench/gpu_probe.py`` (or ``python -m bench.gpu_probe``).

Exit status: 0 when the mean load utilisation is above the mean idle one, 2 when there is no
CUDA GPU or NVML cannot read it, 3 when the load did not show in the readings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

# Runnable as a plain script from a checkout without installing the project.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.gpu import GpuProbe, GpuReading  # noqa: E402

PHASES: tuple[tuple[str, float], ...] = (("idle", 3.0), ("load", 5.0), ("idle", 3.0), ("load", 5.0))


def _workload(load: threading.Event, stop: threading.Event, size: int) -> None:
    """Keep the GPU busy with bf16 matmuls while ``load`` is set; sleep otherwise."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    while not stop.is_set():
        if not load.is_set():
            time.sleep(0.02)
            continue
        for _ in range(20):
            a = torch.matmul(a, b)
            a = a / a.norm()  # keep values finite
        torch.cuda.synchronize()


def _row(phase: str, t_s: float, reading: GpuReading) -> dict[str, object]:
    return {
        "t_s": round(t_s, 2),
        "phase": phase,
        "available": reading.available,
        "reason": reading.reason,
        "util_ratio": reading.util_ratio,
        "mem_ratio": round(reading.mem_ratio, 4),
        "devices": [
            {"index": d.index, "name": d.name, "util_ratio": d.util_ratio,
             "mem_used_bytes": d.mem_used_bytes}
            for d in reading.devices
        ],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--size", type=int, default=8192, help="matmul side length")
    parser.add_argument("--settle-s", type=float, default=1.0)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA GPU visible to torch"}))
        return 2
    probe = GpuProbe()
    first = probe.read()
    if not first.available:
        print(json.dumps({"error": f"GpuProbe unavailable: {first.reason}"}))
        return 2

    load, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=_workload, args=(load, stop, args.size), daemon=True)
    worker.start()
    samples: dict[str, list[float]] = {"idle": [], "load": []}
    start = time.monotonic()
    try:
        for phase, duration_s in PHASES:
            if phase == "load":
                load.set()
            else:
                load.clear()
            phase_start = time.monotonic()
            phase_end = phase_start + duration_s
            while (now := time.monotonic()) < phase_end:
                reading = probe.read()
                print(json.dumps(_row(phase, now - start, reading)), flush=True)
                if reading.available and now - phase_start >= args.settle_s:
                    samples[phase].append(reading.util_ratio)
                time.sleep(max(0.0, min(args.interval_s, phase_end - time.monotonic())))
    finally:
        stop.set()
        worker.join(timeout=10)
        probe.close()

    idle_mean = statistics.fmean(samples["idle"]) if samples["idle"] else 0.0
    load_mean = statistics.fmean(samples["load"]) if samples["load"] else 0.0
    summary = {
        "device": first.devices[0].name,
        "device_count": first.device_count,
        "mem_total_bytes": first.devices[0].mem_total_bytes,
        "idle_util_mean": round(idle_mean, 3),
        "load_util_mean": round(load_mean, 3),
        "idle_samples": len(samples["idle"]),
        "load_samples": len(samples["load"]),
        "read_errors": probe.read_errors,
        "load_visible": load_mean > idle_mean,
    }
    print(json.dumps({"summary": summary}, indent=2))
    return 0 if summary["load_visible"] else 3


if __name__ == "__main__":
    sys.exit(main())
