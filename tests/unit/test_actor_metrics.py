"""The policy actor's operator accounting and metrics, without a cluster.

`threshold_table`, `off_causes` and `FeatureClock` (policies/service.py) are pure; `PolicyMetrics`
(policies/actor.py) is driven here with recording stand-ins for Ray's metric classes, so every
name, tag and value it exports is checked against a `PolicyCore` on a fake clock.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytest

from policies.config import parse_policy
from policies.service import FeatureClock, PolicyCore, off_causes, threshold_table
from tests.fakes.clock import FakeClock

POLICY = {
    "stale_after_s": 2,
    "level1": {"trigger": {"queue_length": 4}, "recover": {"queue_length": 1},
               "recover_dwell_s": 3, "cooldown_s": 1, "disable": ["debug_capture"]},
    "level2": {"trigger": {"queue_length": 8, "kv_cache_usage": 0.9}, "recover_dwell_s": 3, "cooldown_s": 1,
               "disable": ["ab_test"]},
    "level3": {"trigger": {"queue_length": 12}, "recover_dwell_s": 3, "cooldown_s": 1,
               "disable": ["all_non_critical"]},
}


# -- threshold_table / off_causes ------------------------------------------------------------------


def test_threshold_table_has_every_trigger_with_its_recover_value() -> None:
    table = threshold_table(parse_policy(POLICY))
    assert table["queue_length"] == {"1": {"trigger": 4.0, "recover": 1.0},
                                     "2": {"trigger": 8.0, "recover": pytest.approx(8 * 5 / 6)},
                                     "3": {"trigger": 12.0, "recover": pytest.approx(12 * 5 / 6)}}
    assert table["kv_cache_usage"] == {"2": {"trigger": 0.9, "recover": pytest.approx(0.75)}}


@pytest.mark.parametrize(("enabled", "by_level", "expected"), [
    # on by the level and not overridden: not listed
    ({"ab_test", "debug_capture"}, {"ab_test", "debug_capture"}, {}),
    # the level turns it off
    ({"ab_test"}, {"ab_test"}, {"debug_capture": "level"}),
    # the level allows it, an override forced it off
    ({"debug_capture"}, {"ab_test", "debug_capture"}, {"ab_test": "override"}),
])
def test_off_causes(enabled: set[str], by_level: set[str], expected: dict[str, str]) -> None:
    from policies.features import optional_names

    others = set(optional_names()) - {"ab_test", "debug_capture"}
    got = off_causes(frozenset(enabled | others), frozenset(by_level | others))
    assert got == expected


# -- FeatureClock ------------------------------------------------------------------------------


def test_feature_clock_charges_time_between_ticks_and_counts_edges() -> None:
    clock = FeatureClock(window_s=10)
    assert clock.update(0.0, {"ab_test": "level"}) == ({}, [])  # the first update only sets the state
    assert clock.update(1.0, {"ab_test": "level"}) == ({"ab_test": 1.0}, [])
    assert clock.update(2.0, {}) == ({}, [])  # back on: the second between is not charged
    assert clock.update(3.0, {"ab_test": "override"}) == ({}, [("ab_test", "override")])
    assert clock.update(5.0, {"ab_test": "override"}) == ({"ab_test": 2.0}, [])
    snap = clock.snapshot(5.0)["ab_test"]
    assert snap == {"off": True, "cause": "override", "disabled_s": 3.0, "turned_off": {"override": 1},
                    "disabled_s_window": 3.0, "turned_off_window": {"override": 1}}
    assert clock.snapshot(5.0)["debug_capture"]["disabled_s"] == 0.0


def test_feature_clock_window_forgets_old_time_but_not_the_totals() -> None:
    clock = FeatureClock(window_s=10)
    clock.update(0.0, {})
    clock.update(1.0, {"ab_test": "level"})  # turned off at 1
    for t in range(2, 6):
        clock.update(float(t), {"ab_test": "level"})  # off 1..5: 4 s
    for t in range(6, 14):
        clock.update(float(t), {})
    snap = clock.snapshot(13.0)["ab_test"]  # window [3, 13]: 2 s of the 4; the turn-off at 1 is out
    assert snap["disabled_s"] == 4.0 and snap["turned_off"] == {"level": 1}
    assert snap["disabled_s_window"] == pytest.approx(2.0) and snap["turned_off_window"] == {}
    for t in range(14, 20):
        clock.update(float(t), {})
    assert clock.snapshot(19.0)["ab_test"]["disabled_s_window"] == 0.0
    assert clock.snapshot(19.0)["ab_test"]["disabled_s"] == 4.0


def test_feature_clock_ignores_a_clock_going_backwards() -> None:
    clock = FeatureClock()
    clock.update(10.0, {"ab_test": "level"})
    assert clock.update(9.0, {"ab_test": "level"}) == ({}, [])


# -- PolicyCore carries them ---------------------------------------------------------------------


def test_core_state_has_thresholds_and_feature_time() -> None:
    fake = FakeClock()
    core = PolicyCore(parse_policy(POLICY), clock=fake)
    core.report("model:a", {"queue_length": 10})
    core.tick()  # level 2: debug_capture and ab_test off (first tick: state only)
    fake.advance(1.0)
    core.tick()
    state = core.get_state()
    assert state["thresholds"]["queue_length"]["2"]["trigger"] == 8.0
    times = state["feature_time"]
    assert times["ab_test"]["off"] and times["ab_test"]["cause"] == "level"
    assert times["ab_test"]["disabled_s"] == pytest.approx(1.0)
    assert not times["personalization"]["off"]
    core.take_accounting()
    core.set_override(feature="personalization", enabled=False, ttl_s=60)
    assert core.take_accounting()[1] == [("personalization", "override")]  # at once, not at the next tick
    fake.advance(0.25)
    core.tick()
    assert core.take_accounting() == ({"ab_test": 0.25, "debug_capture": 0.25, "personalization": 0.25}, [])
    assert core.get_state()["feature_time"]["personalization"]["turned_off"] == {"override": 1}


# -- the override turn-off lost after policy-actor restarts (issue 13) -------------------------------


def _restarted(fake: FakeClock) -> PolicyCore:
    """A core that ran at level 2 and persisted it, then a new one restored from its snapshot
    (what Ray's restart of the actor does)."""
    store: dict[str, bytes] = {}
    first = PolicyCore(parse_policy(POLICY), clock=fake, persist=lambda b: store.__setitem__("k", b),
                       restore=lambda: store.get("k"))
    first.report("model:a", {"queue_length": 10})
    first.tick()
    assert first.state.level == 2
    fake.advance(1.0)
    return PolicyCore(parse_policy(POLICY), clock=fake, persist=lambda b: store.__setitem__("k", b),
                      restore=lambda: store.get("k"))


def test_restarted_actor_counts_no_turn_off_for_what_was_off_before_it_started() -> None:
    fake = FakeClock()
    core = _restarted(fake)
    assert core.state.level == 2
    fake.advance(0.25)
    core.tick()
    assert core.take_accounting()[1] == []  # ab_test was off by the level before: not turned off now
    assert core.feature_clock.snapshot(fake())["ab_test"]["cause"] == "level"


def test_restarted_actor_counts_an_override_set_before_its_first_tick() -> None:
    """The restored actor's first tick only established the state: an override set before it
    (the loop starts on the first call) was never an edge."""
    fake = FakeClock()
    core = _restarted(fake)
    core.take_accounting()
    core.set_override(level=0, ttl_s=30)
    core.set_override(feature="personalization", enabled=False, ttl_s=30)
    fake.advance(0.25)
    core.tick()
    assert ("personalization", "override") in core.take_accounting()[1]


def test_an_override_followed_at_once_by_a_level_pin_is_counted_as_the_override() -> None:
    """The metrics test's sequence, with no tick between the override and the pin (a restarted
    actor's loop late by a tick): the turn-off is the override's, once."""
    fake = FakeClock()
    core = _restarted(fake)
    core.set_override(level=0, ttl_s=30)
    fake.advance(0.25)
    core.tick()
    core.take_accounting()
    core.set_override(feature="ab_test", enabled=False, ttl_s=30)
    core.set_override(level=2, ttl_s=30)  # turns ab_test off by the level too
    for _ in range(3):
        fake.advance(0.25)
        core.tick()
    added, edges = core.take_accounting()
    assert [e for e in edges if e[0] == "ab_test"] == [("ab_test", "override")]
    assert added["ab_test"] == pytest.approx(0.75)
    assert core.get_state()["feature_time"]["ab_test"]["turned_off"] == {"override": 1}


def test_increments_wait_until_the_metrics_take_them(recorder: "Recorder") -> None:
    """Ticks that ran without the metrics taking their increments (a tick whose export failed,
    an override between ticks) lose nothing: the next `account` adds them all."""
    from policies.actor import PolicyMetrics

    fake = FakeClock()
    metrics = PolicyMetrics()
    core = PolicyCore(parse_policy(POLICY), clock=fake)
    core.set_override(feature="ab_test", enabled=False, ttl_s=60)
    for _ in range(4):
        fake.advance(0.25)
        core.tick()
    metrics.account(core)
    assert recorder.value("brownout_feature_turned_off_total", feature="ab_test", cause="override") == 1
    assert recorder.value("brownout_feature_disabled_seconds_total", feature="ab_test") == pytest.approx(1.0)
    metrics.account(core)  # nothing new: nothing added twice
    assert recorder.value("brownout_feature_turned_off_total", feature="ab_test", cause="override") == 1


# -- PolicyMetrics with recording metric classes -------------------------------------------------


class Recorder:
    """Every metric created, by name: its kind, tag keys, and what was recorded per tag set."""

    def __init__(self) -> None:
        self.metrics: dict[str, dict[str, Any]] = {}

    def kind(self, kind: str) -> type:
        recorder = self

        class Metric:
            def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = (),
                         boundaries: list[float] | None = None) -> None:
                assert description, f"{name} has no description"
                self.name = name
                recorder.metrics[name] = {"kind": kind, "tag_keys": tuple(tag_keys or ()),
                                          "values": defaultdict(float), "boundaries": boundaries}

            def _key(self, tags: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
                tags = tags or {}
                entry = recorder.metrics[self.name]
                assert set(tags) == set(entry["tag_keys"]), (self.name, tags)
                assert all(isinstance(v, str) for v in tags.values())
                return tuple(sorted(tags.items()))

            def set(self, value: float, tags: dict[str, str] | None = None) -> None:
                recorder.metrics[self.name]["values"][self._key(tags)] = value

            def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
                assert value > 0
                recorder.metrics[self.name]["values"][self._key(tags)] += value

            def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
                recorder.metrics[self.name].setdefault("observed", []).append(value)

        return Metric

    def value(self, name: str, **tags: str) -> float:
        return self.metrics[name]["values"][tuple(sorted(tags.items()))]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    import ray.util.metrics as ray_metrics

    rec = Recorder()
    monkeypatch.setattr(ray_metrics, "Counter", rec.kind("counter"))
    monkeypatch.setattr(ray_metrics, "Gauge", rec.kind("gauge"))
    monkeypatch.setattr(ray_metrics, "Histogram", rec.kind("histogram"))
    return rec


def test_policy_metrics_names_tags_and_values(recorder: Recorder) -> None:
    from policies.actor import PolicyMetrics

    fake = FakeClock()
    metrics = PolicyMetrics()
    core = PolicyCore(parse_policy(POLICY), clock=fake, on_transition=metrics.transition)
    core.report("model:a", {"queue_length": 10, "kv_cache_usage": 0.5}, stale=["gpu_util"])
    metrics.report(True, True)
    metrics.report(False, False)
    core.tick()
    metrics.tick(core, 0.3)
    fake.advance(0.5)
    core.tick()
    metrics.tick(core, 0.2)

    assert recorder.value("brownout_level") == 2
    assert recorder.value("brownout_policy_level") == 2
    assert recorder.value("brownout_level_pinned") == 0
    assert recorder.value("brownout_level_transitions_total", **{"from": "0", "to": "2", "direction": "up",
                                                                 "reason": "trigger"}) == 1
    assert recorder.value("brownout_feature_enabled", feature="ab_test") == 0
    assert recorder.value("brownout_feature_enabled", feature="personalization") == 1
    assert recorder.value("brownout_feature_disabled_seconds_total", feature="ab_test") == pytest.approx(0.5)
    assert recorder.value("brownout_signal", signal="queue_length") == 10
    assert recorder.value("brownout_signal_stale", signal="gpu_util") == 1
    assert recorder.value("brownout_signal_stale", signal="queue_length") == 0
    assert recorder.value("brownout_stale_signals") == 1
    assert recorder.value("brownout_policy_sources") == 1
    assert recorder.value("brownout_signal_threshold", level="2", signal="kv_cache_usage", bound="trigger") == 0.9
    assert recorder.value("brownout_signal_threshold", level="1", signal="queue_length", bound="recover") == 1
    assert math.isnan(recorder.value("brownout_slo_ms", objective="e2e_p99"))  # this policy has no slo
    assert recorder.metrics["brownout_policy_tick_ms"]["observed"] == [0.3, 0.2]
    assert recorder.value("brownout_report_errors_total", reason="failed_read") == 1
    assert recorder.value("brownout_report_errors_total", reason="rejected") == 1

    # an operator pin: counted as an override transition, and the pin shows
    # (forced on first: each operator change is accounted at once, so forcing it on after the
    # pin would count the pin's turn-off in between)
    core.set_override(feature="personalization", enabled=True, ttl_s=30)
    core.set_override(level=3, ttl_s=30)
    fake.advance(0.25)
    core.tick()
    metrics.tick(core, 0.1)
    assert recorder.value("brownout_level") == 3 and recorder.value("brownout_level_pinned") == 1
    assert recorder.value("brownout_level_transitions_total", **{"from": "2", "to": "3", "direction": "up",
                                                                 "reason": "override"}) == 1
    assert recorder.value("brownout_feature_enabled", feature="personalization") == 1  # forced on
    assert recorder.value("brownout_feature_turned_off_total", feature="semantic_cache_lookup",
                          cause="level") == 1
    assert ("brownout_feature_turned_off_total" not in recorder.metrics
            or recorder.value("brownout_feature_turned_off_total", feature="personalization", cause="level") == 0)

    # a new policy without the kv_cache_usage trigger: its threshold reads NaN, not 0
    document = {**POLICY, "level2": {**POLICY["level2"], "trigger": {"queue_length": 8}},
                "slo": {"e2e_p99_ms": 4000}, "admission": {"enabled": False}}
    assert core.update_config(document)["ok"]
    metrics.tick(core, 0.1)
    assert math.isnan(recorder.value("brownout_signal_threshold", level="2", signal="kv_cache_usage",
                                     bound="trigger"))
    assert recorder.value("brownout_slo_ms", objective="e2e_p99") == 4000


def test_every_actor_metric_is_documented() -> None:
    """The module docstring (and docs/OPERATIONS.md) name every metric the actor creates."""
    import inspect
    import re

    from policies import actor

    created = set(re.findall(r'(?:Counter|Gauge|Histogram)\(\s*"(brownout_[a-z_]+)"',
                             inspect.getsource(actor.PolicyMetrics)))
    assert len(created) >= 14
    from pathlib import Path

    ops = (Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md").read_text()
    for name in created:
        assert name in (actor.__doc__ or ""), f"{name} missing from policies/actor.py's docstring"
        assert f"ray_{name}" in ops, f"ray_{name} missing from docs/OPERATIONS.md"
