"""The trace simulator and the acceptance figures on the shipped example traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.config import default_policy, load_policy
from policies.slo import derive_policy
from policies.simulate import main, read_trace, replay, replay_naive

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "configs" / "traces"



def default_policy_for_16():  # type: ignore[no-untyped-def]
    """The default policy as the actor runs it for the default engine (batch of 16)."""
    return derive_policy(default_policy(), 16)


def load(name: str):  # type: ignore[no-untyped-def]
    return read_trace((TRACES / name).read_text().splitlines(), name)


def test_oscillating_trace_flaps_naive_not_brownout() -> None:
    cfg = default_policy_for_16()
    samples = load("oscillating.jsonl")
    ours, naive = replay(cfg, samples), replay_naive(cfg, samples)
    assert naive.changes >= 10, "the trace must actually oscillate across the level-1 trigger"
    assert ours.changes * 5 <= naive.changes, (ours.changes, naive.changes)


def test_flash_crowd_escalates_within_escalate_after_plus_one_sample() -> None:
    cfg = default_policy_for_16()
    samples = load("flash_crowd.jsonl")
    trig = cfg.trigger_thresholds(1)
    first_over = next(s.t for s in samples if any(s.values.get(k, -1) >= v for k, v in trig.items()))
    interval = samples[1].t - samples[0].t
    reached = replay(cfg, samples).first_time_at_or_above(1)
    assert reached is not None
    assert reached - first_over <= cfg.escalate_after_s(1) + interval


def test_flash_crowd_recovers_stepwise() -> None:
    run = replay(default_policy_for_16(), load("flash_crowd.jsonl"))
    downs = [(tr["from"], tr["to"]) for tr in run.transitions if tr["to"] < tr["from"]]
    assert downs == [(3, 2), (2, 1), (1, 0)]


def test_cli_prints_timeline_transitions_and_count(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    png = tmp_path / "out.png"
    rc = main([str(TRACES / "oscillating.jsonl"), "--baseline", "naive", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "timeline:" in out and "transitions:" in out
    assert "level changes: brownout" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reads_reference_json(capsys: pytest.CaptureFixture) -> None:
    ref = TRACES.parent / "reference.json"
    assert main([str(TRACES / "flash_crowd.jsonl"), "--config", str(ref), "--json"]) == 0
    assert '"policy": "brownout"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "lines, pattern",
    [
        (['{"t": 0, "queue_lenght": 3}'], r"x:1: unknown signal 'queue_lenght'"),
        (['{"queue_length": 3}'], r"x:1: each sample needs a 't'"),
        (['{"t": 1}', '{"t": 0}'], r"x:2: t=0 goes back in time"),
        (["{nope"], r"x:1: not JSON"),
        (['{"t": 0, "gpu_util": "high"}'], r"x:1: gpu_util must be a number, got 'high'"),
    ],
)
def test_bad_trace_lines_named(lines: list[str], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        read_trace(lines, "x")


def test_cli_bad_config_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("level1: {trigger: {gpu_util: 2}, recover: {gpu_util: 3}}\n")
    assert main([str(TRACES / "flash_crowd.jsonl"), "--config", str(bad)]) == 2
    assert "level1.recover.gpu_util: 3" in capsys.readouterr().err


def test_periodic_bursts_flap_damping_cuts_level_changes() -> None:
    """Bursts every 50 s with 40 s gaps (> the 30 s dwell): undamped steps down and up per burst."""
    from policies.simulate import replay_undamped

    cfg = load_policy(ROOT / "configs" / "hand_written.yaml")
    samples = load("periodic_bursts.jsonl")
    ours, undamped, naive = replay(cfg, samples), replay_undamped(cfg, samples), replay_naive(cfg, samples)
    assert undamped.changes >= 18 and naive.changes >= 18, "the trace must make hysteresis alone flap"
    assert ours.changes * 4 <= undamped.changes, (ours.changes, undamped.changes)
    # held through the bursts, then one step down after they stop: it still recovers
    assert ours.levels[-1] == 0 and max(ours.levels) == 1
    last_burst = max(s.t for s in samples if s.values["queue_length"] >= 4)
    held = [lv for t, lv in zip(ours.times, ours.levels) if 60 <= t <= last_burst]
    assert set(held) == {1}


def test_cli_undamped_baseline(capsys: pytest.CaptureFixture) -> None:
    assert main([str(TRACES / "periodic_bursts.jsonl"), "--baseline", "undamped",
                 "--config", str(ROOT / "configs" / "hand_written.yaml")]) == 0
    assert "level changes: brownout 4 vs undamped 20" in capsys.readouterr().out
