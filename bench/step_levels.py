"""What raised the level in the step profiles of stored overload results, before and after the step.

The overload benchmark's step profile (0.5 x C0, then 3 x, then 0.5 x) measures how soon the
level rises after the step up. Where the level had already risen in the 0.5 x phase, that
figure is 0 and measures nothing; and a level raised at half the capacity switches optional
work off for a whole dwell with no overload to answer. For every ``adaptive step`` run in the
given result files this prints the policy actor's transitions (from the run's ``transitions``:
time from the step up, level, signal and its value) before the step, and the first two after
it, then counts the runs whose level rose before the step and by which signal.

A ``refused_ratio`` of exactly ``1 / RefusalWindow.MIN_DECISIONS`` (0.05) is one refusal in a
window of at most that many decisions: a lone refusal (`policies.admission.RefusalWindow`).

Usage::

    .venv/bin/python bench/step_levels.py bench/results/overload_2026-12-0[3-6]*.json
    .venv/bin/python bench/step_levels.py --json bench/results/overload_*.json
    .venv/bin/python bench/step_levels.py --refusals bench/results/overload_2026-12-06_*arrivals*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from policies.admission import RefusalWindow  # noqa: E402

LONE_REFUSAL = 1 / RefusalWindow.MIN_DECISIONS


def _transition(t: dict[str, Any], step_at_s: float) -> dict[str, Any]:
    return {"after_step_s": round(t["t_s"] - step_at_s, 3), "to": t["to"], "signal": t.get("signal"),
            "value": t.get("value")}


def step_runs(doc: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """One row per adaptive step run of one result document."""
    rows = []
    for run in doc.get("runs", []):
        steps = run.get("load_steps_s") or []
        if not run.get("name", "").startswith("adaptive step") or not steps:
            continue
        at = steps[0]
        transitions = sorted(run.get("transitions") or [], key=lambda t: t["t_s"])
        rows.append({
            "source": source, "run": run["name"], "code_commit": doc.get("meta", {}).get("code_commit"),
            "before_step": [_transition(t, at) for t in transitions if t["t_s"] < at],
            "after_step": [_transition(t, at) for t in transitions if t["t_s"] >= at][:2],
        })
    return rows


def is_lone_refusal(t: dict[str, Any]) -> bool:
    return t["signal"] == "refused_ratio" and t["value"] is not None and abs(t["value"] - LONE_REFUSAL) < 1e-6


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    raised = [r for r in rows if r["before_step"]]
    first = [r["before_step"][0] for r in raised]
    return {
        "step_runs": len(rows),
        "level_up_before_step": len(raised),
        "first_raised_by": dict(Counter(t["signal"] for t in first)),
        "first_raised_by_a_lone_refusal": sum(is_lone_refusal(t) for t in first),
    }


def _fmt(transitions: Sequence[dict[str, Any]]) -> str:
    return "; ".join(f"{t['after_step_s']:+.2f} s L{t['to']} {t['signal']} {t['value']}" for t in transitions) or "-"


def refusals(doc: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """Every admission poll of the adaptive runs at which a class's refusals grew, with the door's
    arrival estimates then (``arrival_rate_per_s``, all classes summed, long and fast; polls
    from d2a4eb8 on) against what it drains at the refused class's cap: ``cap / latency(cap)``
    on the model's line as polled (``base_latency_s + per_request_s * (cap - 1)``, times the
    speed reading applied; the floor and the bound of a request alone left out). A ratio well
    under 1 is a clump meeting a cap; over 1, demand past what the door serves there."""
    rows = []
    for run in doc.get("runs", []):
        if not run.get("name", "").startswith("adaptive"):
            continue
        steps = run.get("load_steps_s") or []
        prev: dict[str, int] | None = None
        for poll in run.get("admission") or []:
            counts = Counter()
            for key, n in (poll.get("refused") or {}).items():
                counts[key.split(":")[0]] += n
            rates = poll.get("arrival_rate_per_s")
            if prev is not None and rates:
                for cls, n in counts.items():
                    if n <= prev.get(cls, 0):
                        continue
                    cap = (poll.get("class_cap") or {}).get(cls)
                    base, per = poll.get("base_latency_s"), poll.get("per_request_s")
                    if not cap or base is None or per is None:
                        continue
                    latency_s = (base + per * (cap - 1)) * (poll.get("slowdown_applied") or 1.0)
                    drain = cap / latency_s
                    long_rate = sum(r[0] for r in rates.values())
                    fast_rate = sum(r[1] for r in rates.values())
                    phase = ("" if not steps else "before the step" if poll["t_s"] < steps[0]
                             else "step up" if len(steps) < 2 or poll["t_s"] < steps[1] else "after the step")
                    rows.append({"source": source, "run": run["name"], "phase": phase, "t_s": poll["t_s"],
                                 "class": cls, "refused": n - prev.get(cls, 0), "cap": cap,
                                 "drain_per_s": round(drain, 2), "arrivals_long_per_s": round(long_rate, 2),
                                 "arrivals_fast_per_s": round(fast_rate, 2),
                                 "long_over_drain": round(long_rate / drain, 2),
                                 "fast_over_drain": round(fast_rate / drain, 2)})
            prev = dict(counts)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="bench/overload.py result files (JSON)")
    ap.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    ap.add_argument("--refusals", action="store_true", help="instead: each poll of the adaptive runs at which "
                    "refusals grew, the door's arrivals against what it drains at the refused class's cap")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    docs = []
    for name in args.files:
        try:
            doc = json.loads(Path(name).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            ap.error(f"{name}: not a readable result file ({err})")
        docs.append((doc, Path(name).name))
    if args.refusals:
        found = [r for doc, source in docs for r in refusals(doc, source)]
        if args.json:
            print(json.dumps(found, indent=1))
            return 0
        for r in found:
            print(f"{r['run']:<24} {r['phase']:<16} {r['t_s']:7.2f} s  {r['class']:<9} +{r['refused']:<3} cap {r['cap']:<3} "
                  f"drains {r['drain_per_s']:6.2f}/s  arrivals {r['arrivals_long_per_s']:6.2f} / "
                  f"{r['arrivals_fast_per_s']:6.2f}/s  ratio {r['long_over_drain']:5.2f} / {r['fast_over_drain']:5.2f}")
        return 0
    for doc, source in docs:
        rows.extend(step_runs(doc, source))
    summary = summarize(rows)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
        return 0
    for r in rows:
        print(f"{r['source']:<58} {str(r['code_commit'])[:7]:<7}  before: {_fmt(r['before_step']):<40}  "
              f"after: {_fmt(r['after_step'])}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
