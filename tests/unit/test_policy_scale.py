"""The policy scale benchmark's pure parts (bench/policy_scale.py): percentiles, the tick
histogram read from Prometheus text, level-change delays, PASS/FAIL against issue 14's targets,
and the simulated replicas' signal dicts. No Ray, no timed assertions."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter

import pytest

from bench.policy_scale import (
    REPLICA_KINDS,
    SimClient,
    TARGETS,
    TICK_METRIC,
    assign_kinds,
    change_delays,
    draw_signals,
    evaluate,
    histogram_delta,
    histogram_quantile,
    json_safe,
    level_sequence,
    parse_histogram,
    percentile,
    slowest_reader,
    summarize,
)
from policies.config import SIGNAL_AGGREGATION, SIGNALS
from policies.signals import Report


@pytest.mark.parametrize("values, q, expected", [
    ([], 50, None),
    ([7.0], 99, 7.0),
    ([1, 2, 3, 4], 0, 1),
    ([1, 2, 3, 4], 100, 4),
    ([1, 2, 3, 4], 50, 2.5),
    ([4, 1, 3, 2], 50, 2.5),  # order does not matter
    (list(range(1, 101)), 99, 99.01),  # numpy's linear: rank 0.99 * 99 = 98.01
    ([10, 20], 25, 12.5),
])
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    got = percentile(values, q)
    assert got == expected if expected is None else got == pytest.approx(expected)


@pytest.mark.parametrize("q", [-1, 100.5])
def test_percentile_rejects_q_out_of_range(q: float) -> None:
    with pytest.raises(ValueError, match="q"):
        percentile([1.0], q)


def test_summarize() -> None:
    s = summarize([1.0, 2.0, 3.0, 10.0])
    assert s == {"n": 4, "p50": 2.5, "p99": pytest.approx(9.79), "max": 10.0, "mean": 4.0}
    assert summarize([]) == {"n": 0, "p50": None, "p99": None, "max": None, "mean": None}


PROM = f"""# HELP {TICK_METRIC} Duration of one policy tick (ms)
# TYPE {TICK_METRIC} histogram
{TICK_METRIC}_bucket{{Component="core_worker",WorkerId="a",le="1.0"}} 90.0
{TICK_METRIC}_bucket{{Component="core_worker",WorkerId="a",le="2.5"}} 99.0
{TICK_METRIC}_bucket{{Component="core_worker",WorkerId="a",le="50.0"}} 100.0
{TICK_METRIC}_bucket{{Component="core_worker",WorkerId="a",le="+Inf"}} 100.0
{TICK_METRIC}_count{{Component="core_worker",WorkerId="a"}} 100.0
{TICK_METRIC}_sum{{Component="core_worker",WorkerId="a"}} 80.0
{TICK_METRIC}_bucket{{Component="core_worker",WorkerId="b",le="1.0"}} 0.0
{TICK_METRIC}_bucket{{Component="core_worker",WorkerId="b",le="2.5"}} 0.0
{TICK_METRIC}_bucket{{Component="core_worker",WorkerId="b",le="50.0"}} 0.0
{TICK_METRIC}_bucket{{Component="core_worker",WorkerId="b",le="+Inf"}} 10.0
{TICK_METRIC}_count{{Component="core_worker",WorkerId="b"}} 10.0
{TICK_METRIC}_sum{{Component="core_worker",WorkerId="b"}} 900.0
ray_other_metric_bucket{{le="1.0"}} 5.0
{TICK_METRIC}_errors_total 3.0
"""


def test_parse_histogram_sums_label_sets_and_ignores_other_metrics() -> None:
    h = parse_histogram(PROM, TICK_METRIC)
    assert h["buckets"] == [(1.0, 90.0), (2.5, 99.0), (50.0, 100.0), (math.inf, 110.0)]
    assert (h["count"], h["sum"]) == (110.0, 980.0)
    assert parse_histogram("", TICK_METRIC) == {"buckets": [], "count": 0.0, "sum": 0.0}


def test_histogram_delta_and_quantile() -> None:
    before = {"buckets": [(1.0, 50.0), (50.0, 60.0), (math.inf, 60.0)], "count": 60.0, "sum": 40.0}
    after = {"buckets": [(1.0, 140.0), (50.0, 159.0), (math.inf, 160.0)], "count": 160.0, "sum": 200.0}
    d = histogram_delta(before, after)
    assert d == {"buckets": [(1.0, 90.0), (50.0, 99.0), (math.inf, 100.0)], "count": 100.0, "sum": 160.0}
    assert histogram_quantile(d["buckets"], 50) == 1.0
    assert histogram_quantile(d["buckets"], 99) == 50.0  # 99 of 100 within 50 ms
    assert histogram_quantile(d["buckets"], 99.5) == math.inf  # the slowest one is beyond
    assert histogram_quantile([], 99) is None
    assert histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 99) is None


def test_change_delays_per_reader() -> None:
    changes = [(10.0, 1), (13.0, 3), (16.0, 0)]
    seen = [
        [(0.0, 0), (10.2, 1), (13.1, 3), (16.4, 0)],
        [(0.0, 0), (10.5, 1), (13.9, 3)],  # never saw the last change
        [(0.0, 0), (9.0, 1), (10.3, 1), (14.0, 0), (16.1, 0)],  # 9.0 was before the change; never saw 3
    ]
    delays = change_delays(changes, seen, end=19.0)
    assert delays[0] == pytest.approx([0.2, 0.5, 0.3])
    assert delays[1][0] == pytest.approx(0.1) and delays[1][1] == pytest.approx(0.9) and delays[1][2] is None
    assert delays[2][0] == pytest.approx(0.4) and delays[2][1] is None and delays[2][2] == pytest.approx(0.1)
    slow = slowest_reader(delays)
    assert slow[0] == pytest.approx(0.5)
    assert slow[1] == math.inf and slow[2] == math.inf


def test_a_change_seen_only_after_the_next_one_is_a_miss() -> None:
    delays = change_delays([(0.0, 2), (3.0, 1)], [[(3.5, 2), (3.6, 1)]], end=6.0)
    assert delays == [[None], [pytest.approx(0.6)]]


@pytest.mark.parametrize("results, passes", [
    ({"tick_p99_ms": 2.5, "report_p99_ms": 1.2, "level_change_max_s": 0.4}, [True, True, True]),
    ({"tick_p99_ms": 50.0, "report_p99_ms": 4.99, "level_change_max_s": 1.0}, [False, True, False]),  # strict <
    ({"tick_p99_ms": math.inf, "report_p99_ms": 12.0, "level_change_max_s": math.inf}, [False, False, False]),
    ({"tick_p99_ms": None, "report_p99_ms": math.nan}, [False, False, False]),  # not measured: FAIL
])
def test_evaluate(results: dict[str, float | None], passes: list[bool]) -> None:
    verdict = evaluate(results)
    assert [row["pass"] for row in verdict] == passes
    assert [row["key"] for row in verdict] == [key for key, _, _ in TARGETS]
    assert [row["limit"] for row in verdict] == [50.0, 5.0, 1.0]


def test_json_safe_writes_no_infinity() -> None:
    doc = json_safe({"a": math.inf, "b": [1.0, (math.nan, 2)], "c": {"d": -math.inf, "e": "x"}})
    assert doc == {"a": None, "b": [1.0, [None, 2]], "c": {"d": None, "e": "x"}}
    json.loads(json.dumps(doc, allow_nan=False))


def test_level_sequence_changes_every_time() -> None:
    seq = level_sequence(9, start=0)
    assert len(seq) == 9 and seq[0] != 0
    assert all(a != b for a, b in zip(seq, seq[1:]))
    assert set(seq) == {0, 1, 2, 3}
    assert level_sequence(3, start=1)[0] != 1


def test_replica_kinds_and_their_signals_are_what_the_actor_takes() -> None:
    kinds = Counter(assign_kinds(1000))
    assert kinds == {"VLLMModel": 600, "EnrichmentHost": 300, "Ingress": 100}
    assert len(assign_kinds(7)) == 7
    rng = random.Random(0)
    for kind, _, ranges in REPLICA_KINDS:
        assert set(ranges) <= set(SIGNAL_AGGREGATION), kind
        signals = draw_signals(kind, rng, SIGNALS)
        assert set(signals) == set(ranges)
        Report(kind, 0.0, signals)  # the actor's own validation accepts it
        for name, value in signals.items():
            lo, hi = ranges[name]
            assert lo <= value <= hi and isinstance(value, float)
    assert draw_signals("Ingress", rng, {"inflight"}).keys() == {"inflight"}


class FakeMethod:
    def __init__(self, name: str, calls: list[tuple[str, tuple]], answer: object) -> None:
        self.name, self.calls, self.answer = name, calls, answer

    def remote(self, *args: object) -> asyncio.Future:
        self.calls.append((self.name, args))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.answer() if callable(self.answer) else self.answer)
        return fut


class FakeActor:
    """Answers ``report`` and ``view`` at once, as a `PolicyCore` would; records every call."""

    def __init__(self) -> None:
        from policies.config import default_policy
        from policies.service import PolicyCore

        self.core = PolicyCore(default_policy())
        self.calls: list[tuple[str, tuple]] = []
        self.report = FakeMethod("report", self.calls, lambda: self._last_report())
        self.report_batch = FakeMethod("report_batch", self.calls, lambda: {
            "kept": self.core.report_many(self.calls[-1][1][0]), "escalate_at": dict(self.core.escalation_floor())})
        self.view = FakeMethod("view", self.calls, lambda: self.core.view())
        # as a node reporter without a socket: the real replicas' reports then come as Ray calls
        self.address = FakeMethod("address", self.calls, None)

    def _last_report(self) -> bool:
        _, args = self.calls[-1]
        return self.core.report(*args)


@pytest.mark.parametrize("per_node, real, readers_per_node, pollers, task_per_replica, tasks", [
    (1, 0, 1, 2, False, 10), (4, 2, 2, 1, False, 4), (4, 2, 2, 1, True, 10)])
def test_sim_client_sends_the_replicas_calls(per_node: int, real: int, readers_per_node: int, pollers: int,
                                             task_per_replica: bool, tasks: int) -> None:
    """The client actor's code without Ray: 10 replicas and 2 readers for about 0.3 s. Alone, each
    replica reports to the actor; per node of 4, ``real`` of them report to the node reporter (here
    the fake actor itself, which keeps what it gets) and the rest hand on to simulated nodes'
    `ReportBatcher`s, which send ``report_batch``; their reporters are stepped by one task per
    simulated node (2 here) or each run as a task of its own. Every report is one the actor takes,
    every replica stays its own source, readers see the level."""
    actor = FakeActor()
    sources = [(f"{kind}:sim-{i}", kind) for i, kind in enumerate(assign_kinds(10))]

    async def go() -> dict:
        client = SimClient(seed=1)
        started = await client.start(actor, sources, readers=2, report_s=0.05, refresh_s=0.05,
                                     per_node=per_node, readers_per_node=readers_per_node,
                                     reporter=actor if real else None, local_real=real, batch_gap_s=0.05,
                                     task_per_replica=task_per_replica)
        assert started == tasks + pollers
        await asyncio.sleep(0.3)
        return await client.stop()

    out = asyncio.run(go())
    reports = [args for name, args in actor.calls if name == "report"]
    batches = [args[0] for name, args in actor.calls if name == "report_batch"]
    summary = {k: out[k] for k in ("stopped", "failures", "skipped", "bad_views", "batched")}
    assert out["stopped"] and out["failures"] == 0 and out["bad_views"] == 0, summary
    assert len({args[0] for args in reports}) == (10 if per_node == 1 else real)
    views = sum(name == "view" for name, _ in actor.calls)  # one poll per node: about 6 each in 0.3 s
    assert pollers <= views <= pollers * 8
    assert actor.core.report_errors == 0 and len(out["reports"]) == len(reports) >= (10 if per_node == 1 else real)
    assert len(out["seen"]) == 2 and all(seen and seen[0][1] == 0 for seen in out["seen"])
    assert out["views"] and out["lag"]
    snap = actor.core.aggregator.aggregate(actor.core.clock())
    assert snap.sources == 10  # per replica, whichever way its report came
    if per_node > 1:  # two simulated nodes (4 + 4 replicas), each sending batches of its own
        batched = {src for batch in batches for src, _, _ in batch}
        assert len(batched) == 10 - real and len(out["forwards"]) == len(batches) >= 2
        assert out["batched"]["forwarded"] == sum(len(b) for b in batches)
        assert out["batched"]["calls"] < out["batched"]["received"]  # batched, not one call per report
