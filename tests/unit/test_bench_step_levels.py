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
