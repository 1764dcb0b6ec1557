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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="bench/overload.py result files (JSON)")
    ap.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name in args.files:
        try:
            doc = json.loads(Path(name).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            ap.error(f"{name}: not a readable result file ({err})")
        rows.extend(step_runs(doc, Path(name).name))
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
