"""How long the policy actor's tick costs: aggregate N fresh replica reports, then decide().

    python bench/policy_bench.py [--reports 1000] [--repeats 200] [--out bench/results/policy_bench.json]

Prints the median and p95 of (aggregate + decide) in ms, and of each part alone. A benchmark
that prints its figures, not a timed test: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from policies.config import default_policy
from policies.controller import ControllerState, decide
from policies.signals import Aggregator, Report

from policies.config import SIGNALS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reports", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    cfg = default_policy()
    rng = random.Random(0)
    agg = Aggregator(stale_after_s=cfg.stale_after_s)
    state = ControllerState()
    totals, aggs, decides = [], [], []
    now = 1000.0
    for _ in range(args.repeats):
        now += 0.25
        # every replica sends a fresh report with all eight signals each round
        for r in range(args.reports):
            agg.add(Report(f"replica-{r}", now - rng.uniform(0, 1),
                           {k: rng.uniform(0, 1) for k in SIGNALS}))
        t0 = time.perf_counter()
        signals = agg.aggregate(now)
        t1 = time.perf_counter()
        state, _ = decide(cfg, state, signals, now)
        t2 = time.perf_counter()
        aggs.append((t1 - t0) * 1e3)
        decides.append((t2 - t1) * 1e3)
        totals.append((t2 - t0) * 1e3)

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    result = {
        "reports": args.reports,
        "repeats": args.repeats,
        "median_ms": round(statistics.median(totals), 4),
        "p95_ms": round(pct(totals, 0.95), 4),
        "aggregate_median_ms": round(statistics.median(aggs), 4),
        "decide_median_ms": round(statistics.median(decides), 4),
        "target_median_ms": 5.0,
    }
    result["meets_target"] = result["median_ms"] < result["target_median_ms"]
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
