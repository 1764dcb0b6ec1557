"""Replica <-> actor plumbing: failures counted and never raised into the caller's loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deployments.reporting import ActorLink, LinkBackoff, PeriodicTask, signal_reporter


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
            if name == "report":
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
