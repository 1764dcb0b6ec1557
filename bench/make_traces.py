"""Regenerate the example traces under configs/traces/ (deterministic: fixed seeds).

    python bench/make_traces.py

- flash_crowd.jsonl: quiet, then a sudden crowd (queue and latency jump), held, then decays.
- oscillating.jsonl: load oscillating around the default policy's level-1 thresholds, the case
  where a policy without hysteresis flaps.
- periodic_bursts.jsonl: 10 s bursts every 50 s, the quiet gaps (40 s) a little longer than the
  default recovery dwell (30 s): hysteresis alone steps down and back up once per burst; flap
  damping (growing dwell) holds the level through the bursts and steps down once they stop.
Samples every second, as the policy actor would see an aggregated snapshot.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "configs" / "traces"


def flash_crowd() -> list[dict[str, float]]:
    rng = random.Random(7)
    rows = []
    for t in range(0, 300):
        if t < 60:
            q, lat = rng.uniform(0, 1.5), rng.uniform(300, 500)
        elif t < 150:  # the crowd: queue far past every trigger
            q, lat = rng.uniform(55, 90), rng.uniform(4000, 9000)
        elif t < 180:  # draining
            frac = (t - 150) / 30
            q, lat = 60 * (1 - frac) + rng.uniform(0, 2), 5000 * (1 - frac) + 400
        else:
            q, lat = rng.uniform(0, 0.8), rng.uniform(300, 500)
        rows.append({"t": float(t), "queue_length": round(q, 2), "p95_latency_ms": round(lat, 1),
                     "avg_latency_ms": round(lat * 0.6, 1), "kv_cache_usage": round(min(1.0, q / 100), 3)})
    return rows


def oscillating() -> list[dict[str, float]]:
    rng = random.Random(11)
    rows = []
    for t in range(0, 600):
        # queue_length swings 2..6 around the level-1 trigger (4), period 20 s, with noise;
        # it never falls below the recover value (1), nor reaches level 2 (16).
        q = 4 + 2 * math.sin(2 * math.pi * t / 20) + rng.uniform(-0.5, 0.5)
        rows.append({"t": float(t), "queue_length": round(max(q, 0), 2),
                     "p95_latency_ms": round(900 + 150 * q + rng.uniform(-50, 50), 1)})
    return rows


def periodic_bursts() -> list[dict[str, float]]:
    rng = random.Random(13)
    rows = []
    for t in range(0, 700):
        # ten bursts at t = 0, 50, ..., 450, each 10 s: the queue passes the level-1 trigger (4)
        # but not level 2 (8); between them, and for 250 s after the last, it is below recover (1)
        in_burst = t < 500 and t % 50 < 10
        q = rng.uniform(5, 7.5) if in_burst else rng.uniform(0, 0.8)
        rows.append({"t": float(t), "queue_length": round(q, 2),
                     "p95_latency_ms": round(600 + 150 * q + rng.uniform(-50, 50), 1)})
    return rows


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("flash_crowd", flash_crowd()), ("oscillating", oscillating()),
                       ("periodic_bursts", periodic_bursts())):
        path = OUT / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {path.name}: {len(rows)} samples")


if __name__ == "__main__":
    main()
