"""Replica <-> actor plumbing: failures counted and never raised into the caller's loop."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from deployments.reporting import ActorLink, LinkBackoff, PeriodicTask, ReportBatcher, signal_reporter


class _Ref:
    def __init__(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self._fn, self._args, self._kwargs = fn, args, kwargs

    def __await__(self) -> Any:
        return self._fn(*self._args, **self._kwargs).__await__()


class _Method:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> _Ref:
        return _Ref(self._fn, *args, **kwargs)


class FakeActor:
    """A handle shaped like Ray's: ``handle.method.remote(...)`` gives an awaitable."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, dict[str, float]]] = []
        self.error: Exception | None = None
        self.delay_s = 0.0

    def __getattr__(self, name: str) -> _Method:
        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.error is not None:
                raise self.error
            if name in ("report", "report_batch"):
                self.reports.append(args)
            return {"ok": True, "method": name}

        return _Method(call)


class ActorDiedError(Exception):
    """Named like Ray's: the link treats it as "resolve the actor again"."""


def test_link_calls_and_resolves_once() -> None:
    resolved: list[FakeActor] = []

    def resolve() -> FakeActor:
        resolved.append(FakeActor())
        return resolved[-1]

    link = ActorLink(resolve)

    async def run() -> None:
        assert await link.call("view") == {"ok": True, "method": "view"}
        assert await link.call("view") == {"ok": True, "method": "view"}

    asyncio.run(run())
    assert len(resolved) == 1 and link.failures == 0


def test_dead_actor_is_counted_raised_and_resolved_again() -> None:
    actors = [FakeActor(), FakeActor()]
    actors[0].error = ActorDiedError("gone")
    clock = [0.0]
    link = ActorLink(lambda: actors.pop(0), clock=lambda: clock[0])

    async def run() -> None:
        with pytest.raises(ActorDiedError):
            await link.call("view")
        clock[0] += link.min_backoff_s  # the back-off is over
        assert await link.call("view") == {"ok": True, "method": "view"}

    asyncio.run(run())
    assert link.failures == 1 and actors == []


def test_slow_actor_times_out_and_keeps_its_handle() -> None:
    actor = FakeActor()
    actor.delay_s = 1.0
    calls = []
    link = ActorLink(lambda: calls.append(1) or actor, timeout_s=0.05)

    async def run() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await link.call("view")

    asyncio.run(run())
    assert link.failures == 1 and len(calls) == 1  # a timeout is not a death: no re-resolve
    assert link.backoff_s == link.min_backoff_s  # but the next calls wait: a stuck actor gets no pile


def test_a_failing_actor_gets_no_calls_during_the_back_off_which_doubles_then_resets() -> None:
    actor = FakeActor()
    actor.error = ActorDiedError("gone")
    sent: list[int] = []
    clock = [100.0]

    def resolve() -> FakeActor:
        sent.append(1)
        return actor

    link = ActorLink(resolve, min_backoff_s=0.5, max_backoff_s=2.0, clock=lambda: clock[0])

    async def run() -> list[float]:
        backoffs = []
        for _ in range(4):
            with pytest.raises(ActorDiedError):
                await link.call("report")
            backoffs.append(link.backoff_s)
            with pytest.raises(LinkBackoff):  # within the back-off: not sent
                await link.call("report")
            clock[0] += link.backoff_s
        actor.error = None
        assert await link.call("report") == {"ok": True, "method": "report"}
        return backoffs

    assert asyncio.run(run()) == [0.5, 1.0, 2.0, 2.0]
    assert link.backoff_s == 0.0 and link.state()["retry_in_s"] == 0.0
    assert link.failures == 4 and link.skipped == 4 and len(sent) == 5  # resolved after each death


def test_an_error_the_actor_raised_is_not_a_reason_to_back_off() -> None:
    actor = FakeActor()
    actor.error = KeyError("no such feature")
    link = ActorLink(lambda: actor, clock=lambda: 0.0)

    async def run() -> None:
        for _ in range(3):
            with pytest.raises(KeyError):
                await link.call("set_override")

    asyncio.run(run())
    assert link.failures == 3 and link.skipped == 0 and link.backoff_s == 0.0


def test_calls_beyond_max_pending_are_not_sent() -> None:
    actor = FakeActor()
    actor.delay_s = 0.2
    link = ActorLink(lambda: actor, timeout_s=5.0, max_pending=2)

    async def run() -> list[Any]:
        return await asyncio.gather(*(link.call("view") for _ in range(3)), return_exceptions=True)

    results = asyncio.run(run())
    assert sum(isinstance(r, LinkBackoff) for r in results) == 1
    assert sum(r == {"ok": True, "method": "view"} for r in results) == 2
    assert link.pending == 0 and link.skipped == 1


def test_periodic_task_counts_failures_and_keeps_running() -> None:
    outcomes = iter([None, RuntimeError("x"), None, RuntimeError("y"), None])

    async def step() -> None:
        outcome = next(outcomes, None)
        if outcome is not None:
            raise outcome

    async def run() -> PeriodicTask:
        task = PeriodicTask("t", step, 0.001)
        task.start()
        while task.runs + task.failures < 5:
            await asyncio.sleep(0.001)
        await task.stop()
        return task

    task = asyncio.run(run())
    assert task.failures == 2 and task.runs >= 3


def test_stop_ends_a_task_whose_cancel_wait_for_swallowed() -> None:
    """Python 3.11's `asyncio.wait_for` returns the result instead of raising when the cancel lands
    while the future it waits on has completed but not yet woken it; the loop then runs on. The
    stop repeats the cancel until the task has ended (it used to await it once: forever)."""

    async def step() -> int:  # as a link whose call has just answered
        answered = asyncio.get_running_loop().create_future()
        answered.set_result(1)
        return await asyncio.wait_for(answered, 5)

    async def run() -> tuple[bool, bool]:
        task = PeriodicTask("t", step, 0.01)
        task.start()
        await asyncio.sleep(0)  # into wait_for, its wake-up queued behind the cancel below
        running = task._task
        assert running is not None
        stopping = asyncio.get_running_loop().create_task(task.stop())
        await asyncio.sleep(0)  # the first cancel lands now, and is swallowed
        done, _ = await asyncio.wait({stopping}, timeout=2.0)  # before the fix: never done
        ended = running.done()
        if not ended:  # clean up what the old stop left running
            while not running.done():
                running.cancel()
                await asyncio.sleep(0.01)
        return stopping in done, ended

    stopped, ended = asyncio.run(run())
    assert stopped and ended


def test_signal_reporter_sends_floats_and_failed_reads_as_stale() -> None:
    actor = FakeActor()
    link = ActorLink(lambda: actor)

    async def run() -> None:
        reporter = signal_reporter(link, "model:1", lambda: {"queue_length": 3, "gpu_util": None}, 0.001)
        reporter.start()
        while not actor.reports:
            await asyncio.sleep(0.001)
        await reporter.stop()

    asyncio.run(run())
    source, signals, stale = actor.reports[0]
    assert source == "model:1" and signals == {"queue_length": 3.0} and stale == ["gpu_util"]
    assert isinstance(signals["queue_length"], float)


def test_reporter_survives_a_dead_actor() -> None:
    actor = FakeActor()
    actor.error = RuntimeError("actor restarting")
    link = ActorLink(lambda: actor)

    async def run() -> PeriodicTask:
        reporter = signal_reporter(link, "ingress", lambda: {"inflight": 1}, 0.001)
        reporter.start()
        while reporter.failures < 3:
            await asyncio.sleep(0.001)
        actor.error = None
        while not actor.reports:
            await asyncio.sleep(0.001)
        await reporter.stop()
        return reporter

    reporter = asyncio.run(run())
    assert reporter.failures >= 3 and link.failures >= 3 and actor.reports


def test_an_unchanged_report_is_sent_again_only_after_the_heartbeat() -> None:
    actor = FakeActor()
    link = ActorLink(lambda: actor)
    now = [0.0]
    values: dict[str, float | None] = {"queue_length": 1.0}
    task = signal_reporter(link, "model:a", lambda: dict(values), interval_s=0.25, heartbeat_s=1.0,
                           clock=lambda: now[0])

    async def run() -> None:
        for _ in range(4):  # 0, 0.25, 0.5, 0.75 s: one report, three skipped
            await task._step()
            now[0] += 0.25
        await task._step()  # 1.0 s: the heartbeat
        values["queue_length"] = 2.0
        now[0] += 0.25
        await task._step()  # changed: sent at once
        values["queue_length"] = None  # a failed read is a change too, sent as stale
        now[0] += 0.25
        await task._step()

    asyncio.run(run())
    assert [r[1] for r in actor.reports] == [{"queue_length": 1.0}, {"queue_length": 1.0},
                                             {"queue_length": 2.0}, {}]
    assert actor.reports[-1][2] == ["queue_length"] and task.skipped == 3


def test_a_call_may_wait_longer_than_the_links_timeout_when_asked() -> None:
    actor = FakeActor()
    actor.delay_s = 0.3
    link = ActorLink(lambda: actor, timeout_s=0.1)

    async def run() -> None:
        assert await link.call("watch", 0, 5.0, call_timeout_s=1.0) == {"ok": True, "method": "watch"}
        link._retry_at = 0.0
        with pytest.raises(asyncio.TimeoutError):
            await link.call("watch", 0, 5.0)

    asyncio.run(run())


def test_a_failing_step_with_no_interval_does_not_spin() -> None:
    calls: list[float] = []

    async def step() -> None:
        calls.append(asyncio.get_running_loop().time())
        raise RuntimeError("actor down")

    async def run() -> None:
        task = PeriodicTask("follow-level", step, 0.0, failure_sleep_s=0.05)
        task.start()
        await asyncio.sleep(0.22)
        await task.stop()

    asyncio.run(run())
    assert 3 <= len(calls) <= 6  # one try per 50 ms, not thousands


# -- ReportBatcher: a node's reports sent on as batches ---------------------------------------


class GatedActor(FakeActor):
    """A fake actor whose ``report_batch`` waits until the test opens its gate; it answers with
    ``escalate_at`` as the policy actor does."""

    def __init__(self, escalate_at: dict[str, float] | None = None) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.escalate_at = escalate_at or {}
        self.at: list[float] = []  # when each batch arrived

    def __getattr__(self, name: str) -> _Method:
        async def call(batch: list[Any]) -> dict[str, Any]:
            await self.gate.wait()
            if self.error is not None:
                raise self.error
            self.reports.append(batch)
            self.at.append(time.monotonic())
            return {"kept": len(batch), "escalate_at": self.escalate_at}

        return _Method(call)


async def _settle(batcher: ReportBatcher) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
    while batcher._sender is not None and not batcher._sender.done():
        await asyncio.sleep(0.001)


def test_a_report_goes_on_at_once_when_no_call_is_in_flight() -> None:
    actor = FakeActor()
    batcher = ReportBatcher(ActorLink(lambda: actor), min_gap_s=0.0)

    async def run() -> None:
        batcher.put("Ingress:a", {"inflight": 2.0}, ["gpu_util"])
        await _settle(batcher)

    asyncio.run(run())
    assert actor.reports == [([("Ingress:a", {"inflight": 2.0}, ["gpu_util"])],)]
    assert (batcher.received, batcher.calls, batcher.forwarded) == (1, 1, 1)


def test_reports_put_during_a_call_go_as_one_batch_with_each_sources_latest() -> None:
    actor = GatedActor()
    batcher = ReportBatcher(ActorLink(lambda: actor), min_gap_s=0.0)

    async def run() -> None:
        batcher.put("m:1", {"queue_length": 1.0})  # sent at once; the call waits at the gate
        await asyncio.sleep(0)
        for value in (2.0, 3.0):
            batcher.put("m:1", {"queue_length": value})
        batcher.put("m:2", {"queue_length": 7.0})
        actor.gate.set()
        await _settle(batcher)

    asyncio.run(run())
    assert actor.reports == [[("m:1", {"queue_length": 1.0}, [])],
                             [("m:1", {"queue_length": 3.0}, []), ("m:2", {"queue_length": 7.0}, [])]]
    assert (batcher.received, batcher.calls, batcher.forwarded) == (4, 2, 3)


def test_a_failed_call_is_tried_again_and_a_newer_report_wins() -> None:
    actor = GatedActor()
    actor.error = RuntimeError("actor restarting")
    batcher = ReportBatcher(ActorLink(lambda: actor), min_gap_s=0.0, retry_s=0.01)

    async def run() -> None:
        batcher.put("m:1", {"queue_length": 1.0})
        batcher.put("m:2", {"queue_length": 5.0})
        await asyncio.sleep(0)
        actor.gate.set()  # the first call fails
        while batcher.failures < 1:
            await asyncio.sleep(0.001)
        batcher.put("m:1", {"queue_length": 9.0})  # newer than the one that failed
        actor.error = None
        await _settle(batcher)

    asyncio.run(run())
    assert actor.reports == [[("m:1", {"queue_length": 9.0}, []), ("m:2", {"queue_length": 5.0}, [])]]
    assert batcher.failures >= 1 and batcher.calls == 1 and batcher.forwarded == 2


def test_a_report_older_than_max_age_is_dropped_not_sent_late() -> None:
    actor = GatedActor()
    actor.error = RuntimeError("actor down")
    clock = [0.0]
    batcher = ReportBatcher(ActorLink(lambda: actor, min_backoff_s=0.0, max_backoff_s=0.0), min_gap_s=0.0,
                            retry_s=0.001, max_age_s=2.0, clock=lambda: clock[0])

    async def run() -> None:
        batcher.put("m:dead", {"queue_length": 4.0})
        actor.gate.set()
        while batcher.failures < 1:
            await asyncio.sleep(0.001)
        clock[0] = 1.5
        batcher.put("m:live", {"queue_length": 1.0})
        clock[0] = 2.5  # m:dead's report is 2.5 s old, m:live's 1 s
        actor.error = None
        await _settle(batcher)

    asyncio.run(run())
    assert actor.reports == [[("m:live", {"queue_length": 1.0}, [])]]
    assert batcher.dropped == 1 and batcher.state()["waiting"] == 0


def test_routine_reports_wait_for_the_gap_and_one_that_may_escalate_goes_at_once() -> None:
    actor = GatedActor(escalate_at={"queue_length": 10.0})
    actor.gate.set()
    batcher = ReportBatcher(ActorLink(lambda: actor), min_gap_s=0.3)

    async def run() -> float:
        t0 = time.monotonic()
        batcher.put("m:1", {"queue_length": 1.0})  # no floor known yet: at once
        await _settle(batcher)
        for value in (2.0, 3.0):  # below every trigger: held for the gap, then sent together
            batcher.put("m:1", {"queue_length": value})
            batcher.put("m:2", {"queue_length": value})
            await asyncio.sleep(0.005)
        await _settle(batcher)
        batcher.put("m:2", {"queue_length": 12.0})  # reaches a trigger: the gap does not hold it
        await _settle(batcher)
        return t0

    t0 = asyncio.run(run())
    assert actor.reports == [[("m:1", {"queue_length": 1.0}, [])],
                             [("m:1", {"queue_length": 3.0}, []), ("m:2", {"queue_length": 3.0}, [])],
                             [("m:2", {"queue_length": 12.0}, [])]]
    first, second, third = (t - t0 for t in actor.at)
    assert first < 0.1 and second >= 0.3 and third - second < 0.1
    assert batcher.calls == 3 and batcher.urgent == 2  # the first (no floor yet) and the 12


def test_a_failed_report_that_may_escalate_is_retried_without_waiting_for_the_gap() -> None:
    actor = GatedActor(escalate_at={"queue_length": 10.0})
    actor.error = RuntimeError("actor restarting")
    actor.gate.set()
    batcher = ReportBatcher(ActorLink(lambda: actor), min_gap_s=5.0, retry_s=0.01)

    async def run() -> float:
        t0 = time.monotonic()
        batcher.put("m:1", {"queue_length": 12.0})  # no floor yet: urgent, and the call fails
        while batcher.failures < 1:
            await asyncio.sleep(0.001)
        actor.error = None
        await _settle(batcher)
        return time.monotonic() - t0

    took = asyncio.run(run())
    assert actor.reports == [[("m:1", {"queue_length": 12.0}, [])]] and took < 1.0
