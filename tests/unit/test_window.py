"""SlidingWindow and percentile: the window's time rule, its bound, numpy's percentile rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deployments.window import SlidingWindow, percentile
from tests.fakes.clock import FakeClock


def test_empty_window_has_no_figures() -> None:
    w = SlidingWindow(FakeClock(), window_s=10)
    assert (len(w), w.mean(), w.percentile(95)) == (0, None, None)


def test_sample_counts_until_window_has_passed_since_it_was_added() -> None:
    clock = FakeClock(100.0)
    w = SlidingWindow(clock, window_s=10)
    w.add(1.0)
    clock.advance(5)
    w.add(3.0)
    assert w.values() == [1.0, 3.0] and w.mean() == 2.0
    clock.advance(4.999)
    assert w.values() == [1.0, 3.0]
    clock.advance(0.001)  # exactly window_s after the first sample: it is out
    assert w.values() == [3.0]
    clock.advance(5)
    assert w.values() == [] and w.mean() is None


def test_max_samples_drops_the_oldest_first() -> None:
    w = SlidingWindow(FakeClock(), window_s=60, max_samples=3)
    for v in (1.0, 2.0, 3.0, 4.0):
        w.add(v)
    assert w.values() == [2.0, 3.0, 4.0] and len(w) == 3


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([5.0], 95, 5.0),
    ([1.0, 2.0], 50, 1.5),
    ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
    ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
    ([4.0, 1.0, 3.0, 2.0], 25, 1.75),  # unsorted input; rank 0.75 between 1 and 2
    ([], 50, None),
])
def test_percentile_table(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("q", [-1, 100.5])
def test_percentile_out_of_range_is_an_error(q: float) -> None:
    with pytest.raises(ValueError, match=r"q=.* must be within \[0, 100\]"):
        percentile([1.0], q)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"window_s": 0}, r"window_s=0 must be > 0"),
    ({"max_samples": 0}, r"max_samples=0 must be >= 1"),
])
def test_bad_window_settings_rejected(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SlidingWindow(FakeClock(), **kwargs)  # type: ignore[arg-type]
