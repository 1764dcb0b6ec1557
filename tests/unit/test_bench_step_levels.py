"""bench/step_levels.py: what raised the level in stored step profiles, before and after the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import step_levels


def _doc(transitions: list[dict]) -> dict:  # type: ignore[type-arg]
    return {"meta": {"code_commit": "abc1234"}, "runs": [
        {"name": "adaptive @3x", "load_steps_s": [], "transitions": [{"t_s": 1.0, "to": 3, "signal": "x"}]},
        {"name": "adaptive step", "load_steps_s": [15.0, 40.0], "transitions": transitions},
    ]}


def test_a_lone_refusal_in_the_half_load_phase_is_found_and_named() -> None:
    doc = _doc([{"t_s": 15.6, "to": 3, "signal": "refused_ratio", "value": 0.1667},
                {"t_s": 1.35, "to": 2, "signal": "refused_ratio", "value": 0.05}])
    rows = step_levels.step_runs(doc, "a.json")
    assert len(rows) == 1  # only the step profile
    assert rows[0]["before_step"] == [{"after_step_s": -13.65, "to": 2, "signal": "refused_ratio", "value": 0.05}]
    assert rows[0]["after_step"][0]["to"] == 3
    assert step_levels.summarize(rows) == {"step_runs": 1, "level_up_before_step": 1,
                                           "first_raised_by": {"refused_ratio": 1},
                                           "first_raised_by_a_lone_refusal": 1}


def test_runs_at_level_0_at_the_step_count_only_as_runs() -> None:
    rows = (step_levels.step_runs(_doc([{"t_s": 15.4, "to": 3, "signal": "refused_ratio", "value": 0.1}]), "b")
            + step_levels.step_runs(_doc([{"t_s": 2.3, "to": 1, "signal": "predicted_wait_ms", "value": 703.5}]), "c"))
    assert step_levels.summarize(rows) == {"step_runs": 2, "level_up_before_step": 1,
                                           "first_raised_by": {"predicted_wait_ms": 1},
                                           "first_raised_by_a_lone_refusal": 0}


def test_the_command_reads_files_and_refuses_a_bad_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_doc([{"t_s": 1.0, "to": 2, "signal": "refused_ratio", "value": 0.05}])))
    assert step_levels.main(["--json", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["first_raised_by_a_lone_refusal"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit):
        step_levels.main([str(bad)])
    assert "bad.json: not a readable result file" in capsys.readouterr().err


def test_each_refusal_is_read_against_the_arrivals_and_what_the_door_drains_at_the_cap() -> None:
    def poll(t_s: float, refused: dict[str, int], rates: dict[str, list[float]] | None) -> dict:  # type: ignore[type-arg]
        return {"t_s": t_s, "refused": refused, "class_cap": {"critical": 12, "standard": 5, "sheddable": 5},
                "base_latency_s": 0.4, "per_request_s": 0.1, "slowdown_applied": 1.0, "arrival_rate_per_s": rates}

    low = {"critical": [1.0, 0.5], "standard": [2.0, 2.5], "sheddable": [1.5, 2.0]}
    high = {"critical": [5.0, 6.0], "standard": [12.0, 14.0], "sheddable": [8.0, 9.0]}
    doc = {"runs": [{"name": "adaptive step", "load_steps_s": [15.0, 40.0], "admission": [
        poll(1.0, {"sheddable:class_share_exhausted": 3}, low),
        poll(1.5, {"sheddable:class_share_exhausted": 4}, low),  # one more: a clump at half load
        poll(2.0, {"sheddable:class_share_exhausted": 4}, low),  # none: no row
        poll(15.5, {"sheddable:class_share_exhausted": 6, "standard:class_share_exhausted": 2}, high),
        poll(16.0, {"sheddable:class_share_exhausted": 6, "standard:class_share_exhausted": 2}, None),  # old polls
    ]}, {"name": "pinned0 @3x", "admission": [poll(1.0, {"x:y": 1}, low), poll(1.5, {"x:y": 2}, low)]}]}
    rows = step_levels.refusals(doc, "r.json")
    # cap 5 on the line: 5 / (0.4 + 0.1 * 4) = 6.25 req/s drained
    assert [(r["phase"], r["class"], r["refused"], r["drain_per_s"], r["arrivals_long_per_s"], r["long_over_drain"])
            for r in rows] == [("before the step", "sheddable", 1, 6.25, 4.5, 0.72),
                               ("step up", "sheddable", 2, 6.25, 25.0, 4.0),
                               ("step up", "standard", 2, 6.25, 25.0, 4.0)]
    assert rows[0]["fast_over_drain"] == 0.8  # 5.0 / 6.25
