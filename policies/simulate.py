"""Replay a signal trace through a policy: what would Brownout have done?

A trace is JSONL, one sample a line: ``{"t": <seconds>, "<signal>": <value>, ...}``; a line may
instead carry ``"signals": {...}``. Samples must be in time order. Each sample is fed to
`decide()` as one aggregated snapshot (the aggregator is not in the loop: a trace records what
the policy saw).

``--baseline naive`` replays the same trace through the reference design's naive manager: every
``naive_interval_s`` (5 s) the level becomes the highest whose trigger holds, with no memory.
``--baseline undamped`` replays it through Brownout's own controller with flap damping off
(``dwell_factor: 1``), to show what the growing recovery dwell saves.

Usage::

    python -m policies.simulate configs/traces/oscillating.jsonl \\
        [--config configs/degradation.yaml] [--baseline naive|undamped] [--plot out.png] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from policies.config import SIGNALS, DegradationConfig, PolicyError, default_policy, load_policy
from policies.slo import derive_policy
from policies.controller import ControllerState, Reason, Transition, decide, naive_level
from policies.features import Level
from policies.signals import Signals

NAIVE_INTERVAL_S = 5.0
NAIVE_REASON = Reason("trigger", detail="naive: highest trigger crossed")


@dataclass(frozen=True)
class Sample:
    t: float
    values: dict[str, float]


@dataclass
class Run:
    """The outcome of one replay: the level after each sample, and every change."""

    name: str
    times: list[float] = field(default_factory=list)
    levels: list[int] = field(default_factory=list)
    transitions: list[dict[str, object]] = field(default_factory=list)

    @property
    def changes(self) -> int:
        return len(self.transitions)

    def segments(self) -> list[tuple[float, float, int]]:
        """The timeline as (start, end, level) runs."""
        out: list[tuple[float, float, int]] = []
        for t, lv in zip(self.times, self.levels):
            if out and out[-1][2] == lv:
                out[-1] = (out[-1][0], t, lv)
            else:
                out.append((t, t, lv))
        return out

    def first_time_at_or_above(self, level: int) -> float | None:
        return next((t for t, lv in zip(self.times, self.levels) if lv >= level), None)

    def summary(self) -> dict[str, object]:
        return {
            "policy": self.name,
            "level_changes": self.changes,
            "max_level": max(self.levels, default=0),
            "timeline": [{"from_t": a, "to_t": b, "level": lv} for a, b, lv in self.segments()],
            "transitions": self.transitions,
        }


def read_trace(lines: Iterable[str], source: str = "trace") -> list[Sample]:
    """Parse JSONL samples; errors name the line, the key and the value."""
    samples: list[Sample] = []
    for lineno, raw in enumerate(lines, start=1):
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}:{lineno}: not JSON: {err}") from None
        if not isinstance(obj, dict) or "t" not in obj:
            raise ValueError(f"{source}:{lineno}: each sample needs a 't' (seconds)")
        t = obj.pop("t")
        values = obj.pop("signals", None) or obj
        for name, value in values.items():
            if name not in SIGNALS:
                raise ValueError(
                    f"{source}:{lineno}: unknown signal {name!r}; valid: {', '.join(SIGNALS)}"
                )
            if not isinstance(value, (int, float)):
                raise ValueError(f"{source}:{lineno}: {name} must be a number, got {value!r}")
        if samples and t < samples[-1].t:
            raise ValueError(f"{source}:{lineno}: t={t} goes back in time (previous {samples[-1].t})")
        samples.append(Sample(float(t), {k: float(v) for k, v in values.items()}))
    return samples


def replay(config: DegradationConfig, samples: Sequence[Sample], name: str = "brownout") -> Run:
    """Brownout's controller over the trace."""
    run = Run(name)
    state = ControllerState()
    for sample in samples:
        signals = Signals(at=sample.t, values=sample.values, sources=1)
        state, transition = decide(config, state, signals, sample.t)
        if transition is not None:
            run.transitions.append(transition.to_dict())
        run.times.append(sample.t)
        run.levels.append(int(state.level))
    return run


def replay_undamped(config: DegradationConfig, samples: Sequence[Sample]) -> Run:
    """Brownout's controller with flap damping off: hysteresis, dwell and cooldown only."""
    damping = config.flap_damping.model_copy(update={"dwell_factor": 1.0})
    return replay(config.model_copy(update={"flap_damping": damping}), samples, "undamped")


def replay_naive(
    config: DegradationConfig, samples: Sequence[Sample], interval_s: float = NAIVE_INTERVAL_S
) -> Run:
    """The reference design's naive manager: re-evaluated every ``interval_s``, no hysteresis.

    Its loop wakes every ``interval_s`` and reads the latest sample at that moment.
    """
    run = Run("naive")
    level = Level.NORMAL
    next_eval = samples[0].t if samples else 0.0
    for sample in samples:
        if sample.t >= next_eval:
            new = naive_level(config, sample.values)
            if new != level:
                signals = Signals(at=sample.t, values=sample.values, sources=1)
                run.transitions.append(
                    Transition(sample.t, level, new, NAIVE_REASON, signals).to_dict()
                )
                level = new
            while next_eval <= sample.t:
                next_eval += interval_s
        run.times.append(sample.t)
        run.levels.append(int(level))
    return run


def plot(samples: Sequence[Sample], runs: Sequence[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({k for s in samples for k in s.values})
    fig, axes = plt.subplots(len(names) + 1, 1, figsize=(11, 2.0 * (len(names) + 1)), sharex=True)
    times = [s.t for s in samples]
    for ax, name in zip(axes, names):
        ax.plot(times, [s.values.get(name, float("nan")) for s in samples], lw=1)
        ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for run, style in zip(runs, ("-", "--")):
        ax.step(run.times, run.levels, style, where="post", label=f"{run.name} ({run.changes} changes)")
    ax.set_ylabel("level")
    ax.set_yticks([0, 1, 2, 3])
    ax.set_xlabel("t (s)")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_run(run: Run, out: TextIO) -> None:
    print(f"== {run.name}: {run.changes} level changes, max level {max(run.levels, default=0)}", file=out)
    print("timeline:", file=out)
    for a, b, lv in run.segments():
        print(f"  t={a:8.1f} .. {b:8.1f}  level {lv}", file=out)
    print("transitions:", file=out)
    for tr in run.transitions:
        print("  " + json.dumps(tr, sort_keys=True), file=out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m policies.simulate", description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, help="JSONL trace of timestamped signals")
    ap.add_argument("--config", type=Path, default=None, help="policy (.yaml or .json); default: configs/degradation.yaml")
    ap.add_argument("--baseline", choices=["naive", "undamped"], default=None,
                    help="also replay a baseline: the naive manager, or Brownout without flap damping")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of signals and levels")
    ap.add_argument("--json", action="store_true", help="print one JSON summary instead of text")
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="the engine's batch size a policy with an slo section derives its triggers for "
                    "(as the policy actor does; serve_config.yaml's model.max_num_seqs)")
    args = ap.parse_args(argv)
    try:
        config = load_policy(args.config) if args.config else default_policy()
        config = derive_policy(config, args.max_num_seqs)
        samples = read_trace(args.trace.read_text(encoding="utf-8").splitlines(), args.trace.name)
    except (PolicyError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    runs = [replay(config, samples)]
    if args.baseline == "naive":
        runs.append(replay_naive(config, samples))
    elif args.baseline == "undamped":
        runs.append(replay_undamped(config, samples))
    if args.json:
        print(json.dumps({"trace": args.trace.name, "samples": len(samples), "runs": [r.summary() for r in runs]}))
    else:
        print(f"trace {args.trace.name}: {len(samples)} samples")
        for run in runs:
            _print_run(run, sys.stdout)
        if len(runs) == 2 and runs[1].changes:
            print(f"level changes: brownout {runs[0].changes} vs {runs[1].name} {runs[1].changes} "
                  f"(ratio {runs[0].changes / runs[1].changes:.3f})")
    if args.plot:
        plot(samples, runs, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
