"""Replica <-> policy actor plumbing: periodic signal reports and a resilient actor link.

Reporting never blocks a request: it runs in its own asyncio task, each send has a timeout, and
a failure (actor dead, restarting, slow) is counted and logged at most once a minute, never
raised. The request path reads only in-memory state.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

logger = logging.getLogger("ray.serve")


class LinkBackoff(RuntimeError):
    """A call not sent: the policy actor failed recently (the link backs off), or too many
    calls to it are still pending."""


class ThrottledLog:
    """Warnings at most once per ``every_s`` (60 s): a failure that repeats on every report is
    counted where it happens and logged once a minute, not at the report rate."""

    def __init__(self, log: logging.Logger, every_s: float = 60.0) -> None:
        self.log, self.every_s = log, every_s
        self._last = -math.inf

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last > self.every_s:
            self._last = now
            self.log.warning(msg, *args)


class ReportLink(Protocol):
    """What `signal_reporter` sends through: an `ActorLink`, or a replica's
    `deployments.node_reporter.NodeReportLink` to its node's reporter."""

    failures: int
    skipped: int

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def state(self) -> dict[str, Any]: ...


class ActorLink:
    """Calls the shared policy actor, re-resolving it by name after it died for good.

    ``resolve`` returns a handle (``get_or_create_policy_actor``). Ray restarts the actor
    itself (``max_restarts=-1``) and the old handle keeps working; a handle to an actor killed
    without restart is replaced by resolving again.

    Calls to a dead or stuck actor do not pile up:

    - each call has a time-out (``timeout_s``); a timed-out call is cancelled (`ray.cancel`), not
      left queued behind the actor;
    - after a time-out or a dead actor the link backs off: calls within ``backoff_s`` (doubling
      from ``min_backoff_s`` up to ``max_backoff_s`` while failures go on) fail at once with
      `LinkBackoff`, without a remote call; the first success ends it;
    - at most ``max_pending`` calls are outstanding; one more fails at once with `LinkBackoff`.

    An error the actor itself raised (it answered) is not a reason to back off. Every failure is
    counted (``failures``; calls not sent: ``skipped``) and logged at most once a minute.
    """

    def __init__(self, resolve: Callable[[], Any], timeout_s: float = 2.0, min_backoff_s: float = 0.25,
                 max_backoff_s: float = 5.0, max_pending: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._resolve = resolve
        self._handle: Any = None
        self.timeout_s = timeout_s
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.max_pending = max_pending
        self._clock = clock
        self.failures = 0
        self.skipped = 0
        self.pending = 0
        self.backoff_s = 0.0
        self._retry_at = 0.0
        self._log = ThrottledLog(logger)

    def handle(self) -> Any:
        if self._handle is None:
            self._handle = self._resolve()
        return self._handle

    def forget(self) -> None:
        """Resolve the actor again before the next call (its caller learnt it is gone)."""
        self._handle = None

    def state(self) -> dict[str, Any]:
        """For ``/admin/brownout``: failures, calls not sent, pending calls, the back-off now."""
        return {"failures": self.failures, "skipped": self.skipped, "pending": self.pending,
                "backoff_s": self.backoff_s, "retry_in_s": round(max(0.0, self._retry_at - self._clock()), 3)}

    async def call(self, method: str, *args: Any, call_timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on the actor; ``call_timeout_s`` (default ``timeout_s``)
        for a call that is meant to wait, e.g. the long-poll ``watch``."""
        now = self._clock()
        if now < self._retry_at:
            self.skipped += 1
            raise LinkBackoff(f"policy actor unreachable; next try in {self._retry_at - now:.2f} s")
        if self.pending >= self.max_pending:
            self.skipped += 1
            raise LinkBackoff(f"{self.pending} calls to the policy actor still pending")
        self.pending += 1
        ref: Any = None
        try:
            ref = getattr(self.handle(), method).remote(*args, **kwargs)
            result = await asyncio.wait_for(ref, timeout=self.timeout_s if call_timeout_s is None else call_timeout_s)
        except Exception as err:
            self.failures += 1
            timed_out = isinstance(err, (asyncio.TimeoutError, TimeoutError))
            if timed_out:
                _cancel(ref)
            gone = actor_gone(err)
            if gone:
                self._handle = None  # resolve again next time
            if timed_out or gone:
                self.backoff_s = min(self.max_backoff_s, max(self.min_backoff_s, 2 * self.backoff_s))
                self._retry_at = self._clock() + self.backoff_s
            self._log.warning("policy actor call %s failed (%d failures so far): %r", method, self.failures, err)
            raise
        finally:
            self.pending -= 1
        self.backoff_s, self._retry_at = 0.0, 0.0
        return result


def _cancel(ref: Any) -> None:
    """Cancel a timed-out actor call, so it does not run (or wait) behind the actor later."""
    if ref is None:
        return
    try:
        import ray

        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - not a Ray ref (tests) or already done: nothing to cancel
        pass


def actor_gone(err: BaseException) -> bool:
    """Whether ``err`` says the actor behind a handle is gone (resolve it again), not that it failed."""
    name = type(err).__name__
    return name in ("ActorDiedError", "RayActorError", "ActorUnavailableError", "ValueError")


class PeriodicTask:
    """Runs ``step()`` every ``interval_s`` in the background; failures counted, never raised."""

    def __init__(self, name: str, step: Callable[[], Awaitable[Any]], interval_s: float,
                 failure_sleep_s: float = 0.0) -> None:
        self.name = name
        self._step = step
        self.interval_s = interval_s
        # after a failure, wait at least this long (a step that itself waits, such as a
        # long-poll, runs with interval 0 and must not spin while its link backs off)
        self.failure_sleep_s = failure_sleep_s
        self.runs = 0
        self.failures = 0
        self.skipped = 0  # steps that chose to send nothing (an unchanged report)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def _loop(self) -> None:
        while True:
            pause = self.interval_s
            try:
                await self._step()
                self.runs += 1
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - counted; ActorLink logs the cause
                self.failures += 1
                pause = max(pause, self.failure_sleep_s)
            await asyncio.sleep(pause)

    async def run_once(self) -> None:
        """One step now, in the caller's task (not counted in ``runs``; failures raise)."""
        await self._step()

    async def stop(self) -> None:
        await _cancel_and_wait(self._task)
        self._task = None


async def _cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended, whatever it raised.

    The cancel is repeated while the task runs on: Python 3.11's `asyncio.wait_for` swallows a
    cancellation that lands while the future it waits on has completed but not yet woken it
    (it returns the result instead), and a loop that called it would then never end; awaiting
    the task once would wait forever (seen: `PeriodicTask.stop` hung with a link whose call had
    just answered).
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    if not task.cancelled():
        task.exception()  # retrieved, so whatever it raised is not reported as never retrieved


HEARTBEAT_S = 1.0  # an unchanged report is sent again after this long (well under stale_after_s)
BATCH_GAP_S = 0.5  # a node's reporter sends routine reports at most once per this long (`ReportBatcher`)


def signal_reporter(
    link: ReportLink, source: str, collect: Callable[[], Mapping[str, float | None]], interval_s: float = 0.25,
    heartbeat_s: float = HEARTBEAT_S, clock: Callable[[], float] = time.monotonic,
) -> PeriodicTask:
    """A `PeriodicTask` sending ``collect()`` to the policy actor as ``source``.

    A signal ``collect`` gives as None is one the replica tried to read and could not: it is
    sent as stale (the actor counts it and will not recover on it), never silently left out.

    Sent only on change: a report equal to the last one sent is skipped (counted in the task's
    ``skipped``) until ``heartbeat_s`` has passed since that was sent, then sent again so the
    actor does not take a quiet replica for a silent one (``stale_after_s``, default 5 s, is
    well above the heartbeat). An idle replica costs the actor one call a second instead of
    four; a change goes out at the next interval as before.
    """
    last: list[Any] = [None, -math.inf]  # what was last sent, when

    async def step() -> None:
        collected = collect()
        signals = {k: float(v) for k, v in collected.items() if v is not None}
        stale = sorted(k for k, v in collected.items() if v is None)
        now = clock()
        if (signals, stale) == last[0] and now - last[1] < heartbeat_s:
            task.skipped += 1
            return
        if stale:
            await link.call("report", source, signals, stale)
        else:
            await link.call("report", source, signals)
        last[0], last[1] = (signals, stale), now

    task = PeriodicTask(f"report:{source}", step, interval_s)
    return task


class ReportBatcher:
    """A node's replicas' reports, sent on to the policy actor as batches (``report_batch``).

    The policy actor answers each call on Ray's call path (about 1 ms of its CPU, whatever the
    call carries), so at a thousand replicas one report call per replica and interval is what
    limits it (bench/POLICY_SCALE.md). One batcher per node (`deployments.node_reporter`) takes
    its replicas' reports (``put``) and sends them on, each source's latest only (a newer report
    replaces the one still waiting), in one call:

    - at most one call per ``min_gap_s`` (`BATCH_GAP_S`, 0.5 s) and never two in flight, so the
      actor answers at most two calls a second per node, however many replicas the node runs (a
      busy node's batch grows instead); a routine report waits at most ``min_gap_s`` plus one
      call's latency, well inside the heartbeat and ``stale_after_s`` (5 s);
    - except a report that may raise the level: every answer carries the actor's
      ``escalate_at`` (`policies.service.PolicyCore.escalation_floor`: per signal, the lowest
      trigger above the policy level), and a report with a value at or above it goes at once
      (as soon as no call is in flight), the gap notwithstanding. The actor decides on such a
      report at once too (`PolicyActor._reported`), so the control path is a local hop longer
      than a direct report, not a batch interval. Before the first answer every report counts
      as one that may.

    Sources stay per replica (the actor keeps and ages each one; a replica that went silent goes
    stale there), and a replica's own heartbeat (`signal_reporter`) keeps it fresh. A failed call
    (actor restarting, the link backing off) keeps the batch and tries again after ``retry_s``,
    with newer reports taking precedence; a report older than ``max_age_s`` is dropped rather than
    sent late, as the actor would stamp it fresh on receipt (a live replica has put a newer one by
    then). Counters: ``received``, ``urgent``, ``calls``, ``forwarded``, ``failures``, ``dropped``.
    """

    def __init__(self, link: ActorLink, min_gap_s: float = BATCH_GAP_S, retry_s: float = 0.25,
                 max_age_s: float = 2 * HEARTBEAT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.link = link
        self.min_gap_s, self.retry_s, self.max_age_s = min_gap_s, retry_s, max_age_s
        self._clock = clock
        self._last_call = -math.inf  # when the last call started
        self._waiting: dict[str, tuple[float, dict[str, float], list[str]]] = {}  # source -> (put at, ...)
        self._escalate_at: Mapping[str, float] | None = None  # None: not known yet
        self._urgent = asyncio.Event()  # a report waiting that may raise the level
        self._sender: asyncio.Task[None] | None = None
        self.received = self.urgent = self.calls = self.forwarded = self.failures = self.dropped = 0

    def may_escalate(self, signals: Mapping[str, float]) -> bool:
        floor = self._escalate_at
        return floor is None or any(name in floor and v >= floor[name] for name, v in signals.items())

    def put(self, source: str, signals: Mapping[str, float], stale: Sequence[str] = ()) -> None:
        """Take one replica's report; it goes on with the next call (see the class docstring)."""
        self.received += 1
        self._waiting[source] = (self._clock(), dict(signals), list(stale))
        if self.may_escalate(signals):
            self.urgent += 1
            self._urgent.set()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send(), name="report-batcher")

    def counters(self) -> dict[str, int]:
        return {"received": self.received, "urgent": self.urgent, "calls": self.calls,
                "forwarded": self.forwarded, "failures": self.failures, "dropped": self.dropped}

    def state(self) -> dict[str, Any]:
        return {**self.counters(), "waiting": len(self._waiting), "link": self.link.state()}

    async def _send(self) -> None:
        while self._waiting:
            pause = self._last_call + self.min_gap_s - self._clock()
            if pause > 0 and not self._urgent.is_set():
                try:
                    await asyncio.wait_for(self._urgent.wait(), pause)
                except asyncio.TimeoutError:
                    pass
            urgent = self._urgent.is_set()
            self._urgent.clear()
            now = self._clock()
            taken = {src: entry for src, entry in self._waiting.items() if now - entry[0] <= self.max_age_s}
            self.dropped += len(self._waiting) - len(taken)
            self._waiting = {}
            if not taken:
                return
            batch = [(src, signals, stale) for src, (_, signals, stale) in taken.items()]
            self._last_call = now
            try:
                answer = await self.link.call("report_batch", batch)
            except Exception:  # noqa: BLE001 - counted; ActorLink logs the cause
                self.failures += 1
                for src, entry in taken.items():  # a report put meanwhile is newer: it wins
                    self._waiting.setdefault(src, entry)
                if urgent:  # the retry does not wait for the gap either
                    self._urgent.set()
                await asyncio.sleep(self.retry_s)
                continue
            self.calls += 1
            self.forwarded += len(batch)
            if isinstance(answer, Mapping) and isinstance(answer.get("escalate_at"), Mapping):
                self._escalate_at = answer["escalate_at"]

    async def stop(self) -> None:
        """Stop sending (what is still waiting is not sent)."""
        await _cancel_and_wait(self._sender)
        self._sender = None


def replica_source(default: str) -> str:
    """A stable report source name: the Serve replica id where there is one."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return f"{ctx.deployment}:{ctx.replica_id.unique_id}"
    except Exception:  # noqa: BLE001 - outside a replica (tests, scripts)
        return default
