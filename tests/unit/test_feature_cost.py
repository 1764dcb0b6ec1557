"""Per-feature cost accounting (policies/feature_cost.py): sums, the 5-minute window, the merge
with the policy actor's off-time, and the ranking an operator reads first."""

from __future__ import annotations

import pytest

from policies.feature_cost import FeatureCost, Totals, cost_ms, merge, rank


def test_record_sums_calls_failures_wall_and_cpu_time() -> None:
    c = FeatureCost(window_s=60, bucket_s=10)
    c.record("cache", 0.0, 0.010, 0.004)
    c.record("cache", 1.0, 0.030, 0.002)
    c.record("cache", 2.0, 1.000, None, ok=False)  # a time-out: wall time, no CPU reported
    snap = c.snapshot(2.0)["cache"]
    assert snap["calls"] == 3 and snap["failures"] == 1 and snap["cpu_calls"] == 2
    assert snap["latency_ms"] == pytest.approx(1040.0)
    assert snap["latency_ms_per_call"] == pytest.approx(1040.0 / 3, abs=1e-3)
    assert snap["cpu_ms_per_call"] == pytest.approx(3.0)
    assert snap["cost_ms"] == pytest.approx(1040.0 + 3 * 3.0)
    assert snap["window"] == {k: v for k, v in snap.items() if k != "window"}


@pytest.mark.parametrize(("latency_s", "cpu_s", "latency_ms", "cpu_calls"), [
    (-1.0, None, 0.0, 0),  # a clock that stepped back: not a negative cost
    (float("nan"), float("inf"), 0.0, 0),
    (0.5, -0.1, 500.0, 0),
    (0.5, 0.0, 500.0, 1),  # zero CPU reported is a measurement
])
def test_bad_times_are_taken_as_not_measured(latency_s: float, cpu_s: float | None, latency_ms: float,
                                             cpu_calls: int) -> None:
    c = FeatureCost()
    c.record("f", 0.0, latency_s, cpu_s)
    snap = c.snapshot(0.0)["f"]
    assert (snap["calls"], snap["latency_ms"], snap["cpu_calls"]) == (1, latency_ms, cpu_calls)


def test_window_forgets_old_calls_but_not_the_totals() -> None:
    c = FeatureCost(window_s=30, bucket_s=10)
    for t in range(0, 10):  # bucket [0, 10)
        c.record("f", float(t), 0.1, 0.01)
    c.record("f", 25.0, 0.2, 0.02)  # bucket [20, 30)
    assert c.snapshot(35.0)["f"]["window"]["calls"] == 11  # [0, 10) still overlaps (5, 35]
    assert c.snapshot(40.0)["f"]["window"]["calls"] == 1  # [0, 10) ended at 10 = 40 - 30: gone
    late = c.snapshot(100.0)["f"]
    assert late["calls"] == 11 and late["window"]["calls"] == 0 and late["window"]["cost_ms"] == 0.0
    assert late["latency_ms"] == pytest.approx(1200.0)


def test_memory_is_bounded_by_buckets_not_calls() -> None:
    c = FeatureCost(window_s=300, bucket_s=10)
    for i in range(10_000):
        c.record("f", i * 0.5, 0.001)
    assert len(c._buckets) <= 31
    assert c.snapshot(5000.0)["f"]["calls"] == 10_000


def test_snapshot_lists_features_never_called() -> None:
    snap = FeatureCost().snapshot(0.0, features=["ab_test"])
    assert snap["ab_test"]["calls"] == 0 and snap["ab_test"]["window"]["cost_ms"] == 0.0


@pytest.mark.parametrize(("window_s", "bucket_s"), [(10, 0), (10, 20), (float("inf"), 1), (0, 0)])
def test_bad_window_settings_are_refused(window_s: float, bucket_s: float) -> None:
    with pytest.raises(ValueError, match="bucket_s"):
        FeatureCost(window_s=window_s, bucket_s=bucket_s)


@pytest.mark.parametrize(("totals", "expected"), [
    (Totals(), 0.0),
    (Totals(calls=4, latency_ms=40.0), 40.0),  # no CPU reported: wall time alone
    (Totals(calls=4, latency_ms=40.0, cpu_ms=6.0, cpu_calls=2), 40.0 + 3.0 * 4),  # CPU per reporting call
])
def test_cost_is_per_call_latency_plus_cpu_times_calls(totals: Totals, expected: float) -> None:
    assert cost_ms(totals) == pytest.approx(expected)


CLOCK = {  # FeatureClock.snapshot's shape
    "ab_test": {"off": True, "cause": "override", "disabled_s": 12.0, "turned_off": {"override": 1, "level": 2},
                "disabled_s_window": 4.0, "turned_off_window": {"override": 1}},
    "debug_capture": {"off": False, "cause": None, "disabled_s": 0.0, "turned_off": {},
                      "disabled_s_window": 0.0, "turned_off_window": {}},
}


def test_merge_puts_cost_and_off_time_side_by_side() -> None:
    c = FeatureCost()
    c.record("debug_capture", 0.0, 0.002, 0.001)
    rows = {r["feature"]: r for r in merge(c.snapshot(0.0), CLOCK, {"ab_test": {"override": 3}})}
    assert rows["ab_test"]["calls"] == 0 and rows["ab_test"]["off"] is True and rows["ab_test"]["cause"] == "override"
    assert rows["ab_test"]["turned_off"] == 3 and rows["ab_test"]["turned_off_by_cause"] == {"override": 1, "level": 2}
    assert rows["ab_test"]["window"]["turned_off"] == 1 and rows["ab_test"]["window"]["disabled_s"] == 4.0
    assert rows["ab_test"]["bypassed"] == {"override": 3} and rows["debug_capture"]["bypassed"] == {}
    assert rows["debug_capture"]["calls"] == 1 and rows["debug_capture"]["cost_ms"] == pytest.approx(3.0)
    assert "bypassed" not in merge({}, CLOCK)[0]


def _row(name: str, cost: float = 0.0, turned: int = 0, off_s: float = 0.0, cost_total: float | None = None,
         turned_total: int | None = None) -> dict:
    return {"feature": name, "cost_ms": cost if cost_total is None else cost_total,
            "turned_off": turned if turned_total is None else turned_total, "disabled_s": off_s,
            "window": {"cost_ms": cost, "turned_off": turned, "disabled_s": off_s}}


@pytest.mark.parametrize(("rows", "order"), [
    # most expensive first
    ([_row("a", cost=1.0), _row("b", cost=9.0), _row("c", cost=5.0)], ["b", "c", "a"]),
    # equal cost: the more often turned off first, then the longer off
    ([_row("a", cost=5.0), _row("b", cost=5.0, turned=2), _row("c", cost=5.0, turned=2, off_s=9.0)], ["c", "b", "a"]),
    # a feature never run (always off) still ranks among the cost-free by how often it is off
    ([_row("idle"), _row("off", turned=3, off_s=100.0), _row("busy", cost=0.5)], ["busy", "off", "idle"]),
    # the window decides; since-start figures break its ties
    ([_row("old", cost=0.0, cost_total=1000.0), _row("new", cost=1.0, cost_total=1.0)], ["new", "old"]),
    ([_row("x", cost_total=5.0), _row("y", cost_total=50.0)], ["y", "x"]),
    # all equal: by name, so the order is stable
    ([_row("b"), _row("a")], ["a", "b"]),
])
def test_rank(rows: list[dict], order: list[str]) -> None:
    ranked = rank(rows)
    assert [r["feature"] for r in ranked] == order
    assert [r["rank"] for r in ranked] == list(range(1, len(rows) + 1))
