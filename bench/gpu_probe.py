"""Check that ``deployments.gpu.GpuProbe`` sees GPU load: idle, matmul load, idle, load.

Needs only torch (CUDA) and ``deployments/gpu.py`` with pynvml; no vLLM, no Ray. Prints one
JSON line per reading (every 0.5 s), then a JSON summary with the mean utilisation of the idle
and load phases. NVML's utilisation is an average over its last sample period, so readings in
the first ``--settle-s`` of each phase are printed but left out of the means.

Then memory: it holds ``--hold-gib`` more on the first GPU and reads the probe and
``nvidia-smi`` side by side, then frees it and reads the probe again. The summary's
``memory`` says both used figures and what the probe saw freed; the probe's figure must be
``nvidia-smi``'s to within ``--mem-tolerance-mib`` (where ``nvidia-smi`` is on the PATH).

Run from the repository root: ``python bench/gpu_probe.py`` (or ``python -m bench.gpu_probe``).

Exit status: 0 when the mean load utilisation is above the mean idle one and the memory held
shows as it should, 2 when there is no CUDA GPU or NVML cannot read it, 3 when the load did not
show in the readings, 4 when the memory did not. ``--out FILE`` also writes the readings and the
summary as one JSON document.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
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
    parser.add_argument("--hold-gib", type=float, default=8.0, help="memory held for the memory check")
    parser.add_argument("--mem-tolerance-mib", type=float, default=64.0)
    parser.add_argument("--out", type=Path, default=None, help="write readings and summary as JSON")
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
    rows: list[dict[str, object]] = []
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
                rows.append(_row(phase, now - start, reading))
                print(json.dumps(rows[-1]), flush=True)
                if reading.available and now - phase_start >= args.settle_s:
                    samples[phase].append(reading.util_ratio)
                time.sleep(max(0.0, min(args.interval_s, phase_end - time.monotonic())))
    finally:
        stop.set()
        worker.join(timeout=10)
    try:
        memory = _memory_check(probe, args.hold_gib, args.mem_tolerance_mib)
    finally:
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
        "memory": memory,
    }
    print(json.dumps({"summary": summary}, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "readings": rows}, indent=1) + "\n")
    if not summary["load_visible"]:
        return 3
    return 0 if memory["visible"] else 4


def _smi_used_mib() -> float | None:
    """The first GPU's memory in use as ``nvidia-smi`` shows it, in MiB (None without it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "-i", "0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    try:
        return float(out.stdout.strip().splitlines()[0])
    except (IndexError, ValueError):
        return None


def _memory_check(probe: GpuProbe, hold_gib: float, tolerance_mib: float) -> dict[str, object]:
    """Hold ``hold_gib`` on the first GPU: the probe's and nvidia-smi's used memory while it is
    held, and how much more the probe saw in use while it was held and how much less once it was
    let go; ``visible`` when the probe saw it held and freed, and matched nvidia-smi (where there
    is one), each to within ``tolerance_mib``."""
    import torch

    torch.cuda.empty_cache()  # the load's tensors, cached by torch, out of the figures
    torch.cuda.synchronize()
    time.sleep(0.5)
    before = probe.read().devices[0].mem_used_bytes
    held = torch.empty(int(hold_gib * 2**30), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with_held = probe.read().devices[0].mem_used_bytes
    smi = _smi_used_mib()
    del held
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    time.sleep(0.5)
    after = probe.read().devices[0].mem_used_bytes
    used_mib = round(with_held / 2**20, 1)
    held_gib, freed_gib = round((with_held - before) / 2**30, 3), round((with_held - after) / 2**30, 3)
    matches = None if smi is None else abs(used_mib - smi) <= tolerance_mib
    return {
        "hold_gib": hold_gib,
        "probe_used_mib": used_mib,
        "smi_used_mib": smi,
        "probe_held_gib": held_gib,
        "probe_freed_gib": freed_gib,
        "matches_nvidia_smi": matches,
        "visible": (all(abs(g - hold_gib) * 1024 <= tolerance_mib for g in (held_gib, freed_gib))
                    and matches is not False),
    }


if __name__ == "__main__":
    sys.exit(main())
