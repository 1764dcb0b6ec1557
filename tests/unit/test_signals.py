from __future__ import annotations

import pytest

from policies.config import SIGNALS
from policies.signals import AGGREGATION, Aggregator, Report


def test_sums_work_and_takes_max_of_one_engines_queue_utilisation_and_latency() -> None:
    agg = Aggregator(stale_after_s=5)
    agg.add(Report("VLLMModel:a", 10.0, {"queue_length": 3, "gpu_util": 0.5}))
    agg.add(Report("VLLMModel:b", 10.5, {"queue_length": 4, "gpu_util": 0.9}))
    agg.add(Report("Ingress:x", 10.0, {"inflight": 5, "model_queued": 1.5, "p95_latency_ms": 200}))
    agg.add(Report("Ingress:y", 10.5, {"inflight": 2, "model_queued": 0.5, "p95_latency_ms": 150}))
    snap = agg.aggregate(now=11.0)
    # each engine has its own waiting queue: the longest, not the sum of two engines' queues
    assert snap.values == {"queue_length": 4, "gpu_util": 0.9, "inflight": 7, "model_queued": 2.0,
                           "p95_latency_ms": 200}
    assert snap.stale == frozenset() and snap.sources == 4
    assert snap.replicas == {"VLLMModel": 2, "Ingress": 2}  # fresh sources per deployment
    assert agg.aggregate(now=15.2).replicas == {"VLLMModel": 1, "Ingress": 1}  # a and x are stale


def test_stale_report_is_ignored_and_its_signals_named() -> None:
    agg = Aggregator(stale_after_s=5, forget_after_s=60)
    agg.add(Report("model-a", 0.0, {"queue_length": 30, "kv_cache_usage": 0.9}))
    agg.add(Report("ingress", 9.0, {"inflight": 2, "queue_length": 1}))
    snap = agg.aggregate(now=10.0)
    assert snap.values == {"inflight": 2, "queue_length": 1}
    # queue_length has a fresh value but one carrier is stale: the sum may under-count
    assert snap.stale == {"queue_length", "kv_cache_usage"}


def test_silent_source_is_forgotten() -> None:
    agg = Aggregator(stale_after_s=5, forget_after_s=30)
    agg.add(Report("gone", 0.0, {"gpu_util": 1.0}))
    assert agg.aggregate(now=10.0).stale == {"gpu_util"}
    snap = agg.aggregate(now=31.0)
    assert snap.stale == frozenset() and "gpu_util" not in snap.values
    assert agg.sources() == []


def test_older_report_does_not_replace_newer() -> None:
    agg = Aggregator()
    agg.add(Report("m", 5.0, {"queue_length": 9}))
    agg.add(Report("m", 4.0, {"queue_length": 1}))
    assert agg.aggregate(now=5.0).values["queue_length"] == 9


def test_a_failed_read_makes_its_signal_stale_not_absent() -> None:
    """A replica that could not read a signal says so: the signal is stale (blocks recovery)
    even though the report itself is fresh, and other replicas' values still count."""
    agg = Aggregator(stale_after_s=5)
    agg.add(Report("model-a", 10.0, {"queue_length": 3}, frozenset({"gpu_util"})))
    agg.add(Report("model-b", 10.0, {"gpu_util": 0.4}))
    snap = agg.aggregate(now=10.0)
    assert snap.values == {"queue_length": 3, "gpu_util": 0.4} and snap.stale == {"gpu_util"}
    with pytest.raises(ValueError, match=r"unknown signal 'gpu_temp'"):
        Report("m", 0.0, {}, frozenset({"gpu_temp"}))


def test_a_failed_read_blocks_recovery_and_is_counted() -> None:
    from policies.config import parse_policy
    from policies.service import PolicyCore
    from tests.fakes.clock import FakeClock

    clock = FakeClock()
    core = PolicyCore(parse_policy({"level1": {"trigger": {"gpu_util": 0.9}, "recover_dwell_s": 1,
                                               "cooldown_s": 0, "disable": ["debug_capture"]}}), clock=clock)
    core.report("model", {"gpu_util": 0.95})
    core.tick()
    assert core.view().level == 1
    for _ in range(5):
        clock.advance(1)
        core.report("model", {"queue_length": 0}, ["gpu_util"])
        core.tick()
    assert core.view().level == 1 and core.get_state()["recovery_blocked_by"] == ["gpu_util"]
    assert core.get_state()["failed_reads"] == 5
    for _ in range(3):
        clock.advance(1)
        core.report("model", {"gpu_util": 0.1})
        core.tick()
    assert core.view().level == 0


def test_unknown_signal_rejected() -> None:
    with pytest.raises(ValueError, match=r"unknown signal 'gpu_temp'"):
        Report("m", 0.0, {"gpu_temp": 80})


@pytest.mark.parametrize("name", SIGNALS)
def test_every_signal_is_folded_by_its_rule(name: str) -> None:
    """Each signal's two reports fold into their sum or their max, as its rule says."""
    agg = Aggregator(stale_after_s=5)
    agg.add(Report("a", 10.0, {name: 0.25}))
    agg.add(Report("b", 10.0, {name: 0.5}))
    expected = {"sum": 0.75, "max": 0.5}[AGGREGATION[name]]
    assert agg.aggregate(now=10.0).values == {name: expected}


def test_bad_windows_rejected() -> None:
    with pytest.raises(ValueError, match="stale_after_s"):
        Aggregator(stale_after_s=10, forget_after_s=5)
