"""bench/engine_start.py's summary (the runs themselves start vLLM: a benchmark, not a test)."""

from __future__ import annotations

import pytest

from bench.engine_start import main, summarize


def test_the_summary_is_the_median_per_mode_and_the_ratio_of_the_cache_to_aot() -> None:
    runs = [{"mode": "aot", "start_s": 60.0, "batch_s": 5.0, "single_s": 2.0},
            {"mode": "cache", "start_s": 30.0, "batch_s": 5.5, "single_s": 2.0},
            {"mode": "aot", "start_s": 70.0, "batch_s": 6.0, "single_s": 2.2},
            {"mode": "cache", "start_s": 40.0, "batch_s": 5.5, "single_s": 2.2},
            {"mode": "aot", "start_s": 100.0, "batch_s": 5.5, "single_s": 2.1}]
    s = summarize(runs)
    assert s["aot"] == {"start_s": 70.0, "batch_s": 5.5, "single_s": 2.1, "runs": 3}
    assert s["cache"] == {"start_s": 35.0, "batch_s": 5.5, "single_s": 2.1, "runs": 2}
    assert s["cache_over_aot"] == {"start_s": 0.5, "batch_s": 1.0, "single_s": 1.0}
    assert "cache_over_aot" not in summarize(runs[:1]) and summarize([]) == {}


def test_bad_arguments_are_refused_before_any_engine_starts() -> None:
    with pytest.raises(SystemExit, match="must be >= 1"):
        main(["--repeats", "0"])
