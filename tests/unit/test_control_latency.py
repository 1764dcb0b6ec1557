"""bench/control_latency.py's pure parts: the burst policy, and one burst's figures from the
recorded changes."""

from __future__ import annotations

import copy

import pytest
import yaml

from bench.control_latency import burst_delays, burst_policy, first_at_or_after
from policies.config import parse_policy
from tests.unit.test_config import ROOT


def test_burst_policy_raises_level_1_on_the_queue_alone() -> None:
    doc = yaml.safe_load((ROOT / "configs" / "degradation.yaml").read_text())
    before = copy.deepcopy(doc)
    cfg = parse_policy(burst_policy(doc, 4))
    assert doc == before  # the deployed document is not changed
    assert cfg.slo is None and cfg.admission is None
    assert cfg.trigger_thresholds(1) == {"queue_length": 4.0}
    assert cfg.trigger_thresholds(2) == {"gpu_util": 0.98} and cfg.trigger_thresholds(3) == {"gpu_util": 0.99}
    assert cfg.dwell_s(1) == 2 and cfg.cooldown_s(1) == 0
    assert cfg.off_levels() == parse_policy(doc).off_levels()  # the same features switch off


def test_first_at_or_after() -> None:
    changes = [(1.0, 5), (2.0, 1), (3.0, 4), (4.0, 9)]
    assert first_at_or_after(changes, 1.5, 4) == 3.0
    assert first_at_or_after(changes, 0.0, 4) == 1.0
    assert first_at_or_after(changes, 4.5, 1) is None


def test_burst_delays_split_the_path_at_the_decision() -> None:
    waiting = [(9.0, 6), (10.10, 2), (10.20, 5), (11.0, 0)]  # 9.0: before this burst was sent
    served = {"ingress-a": [(5.0, 1), (5.5, 0), (10.45, 1)], "ingress-b": [(10.38, 1)]}
    row = burst_delays(10.0, waiting, 4, 10.33, served)
    assert row["complete"]
    assert row["crossing_after_send_s"] == pytest.approx(0.2)
    assert row["crossing_to_decision_s"] == pytest.approx(0.13)
    assert row["decision_to_served_all_s"] == pytest.approx(0.12)
    assert row["crossing_to_served_all_s"] == pytest.approx(0.25)  # the slowest replica
    assert row["per_replica_s"] == {"ingress-a": pytest.approx(0.25), "ingress-b": pytest.approx(0.18)}


@pytest.mark.parametrize(
    ("waiting", "decided", "served"),
    [
        ([(10.1, 2)], 10.3, {"a": [(10.4, 1)]}),  # the queue never reached the trigger
        ([(10.1, 5)], None, {"a": [(10.4, 1)]}),  # the actor never decided
        ([(10.1, 5)], 10.3, {"a": [(10.4, 1)], "b": []}),  # one replica never served it
    ],
)
def test_an_incomplete_burst_says_so(waiting: list, decided: float | None, served: dict) -> None:
    assert burst_delays(10.0, waiting, 4, decided, served)["complete"] is False
