"""bench/latency_by_concurrency.py: each served request's concurrency is the time average of the
served requests in flight over its life; refusals do not count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import latency_by_concurrency as lbc

RECORDS = [
    {"status": 200, "sent_s": 0.0, "done_s": 2.0, "criticality": "critical"},
    {"status": 200, "sent_s": 1.0, "done_s": 2.0, "criticality": "standard"},
    {"status": 429, "sent_s": 1.5, "done_s": 1.52, "criticality": "sheddable"},  # refused: not in flight
    {"status": 200, "sent_s": 2.0, "done_s": 2.5, "criticality": "standard"},  # starts as the two end
]


def test_concurrency_is_the_time_average_over_each_life() -> None:
    rows = lbc.concurrency(RECORDS)
    assert [r["m"] for r in rows] == pytest.approx([1.5, 2.0, 1.0])  # (1 s x 1 + 1 s x 2) / 2 s; 2; alone
    assert [r["at_send"] for r in rows] == [1, 2, 1]
    doc = lbc.table(rows, slo_s=1.5)
    assert doc["by_concurrency"] == {1: {"n": 1, "median_s": 0.5, "p90_s": 0.5, "max_s": 0.5},
                                     2: {"n": 2, "median_s": 1.5, "p90_s": 1.9, "max_s": 2.0}}  # linear between ranks
    assert doc["late"] == [{"m": 1.5, "e2e_s": 2.0, "at_send": 1, "criticality": "critical", "sent_s": 0.0}]


def test_main_names_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"name": "adaptive @3x", "records": RECORDS}) + "\n")
    assert lbc.main([str(raw), "--run", "adaptive @3x", "--slo-ms", "1500"]) == 0
    out = capsys.readouterr().out
    assert "2 in flight:    2 requests" in out and "late: 2.00 s at m 1.5" in out
    with pytest.raises(SystemExit):
        lbc.main([str(raw), "--run", "pinned0 @3x"])
    assert "no run 'pinned0 @3x'" in capsys.readouterr().err
