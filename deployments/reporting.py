"""Replica <-> policy actor plumbing: periodic signal reports and a resilient actor link.

Reporting never blocks a request: it runs in its own asyncio task, each send has a timeout, and
a failure (actor dead, restarting, slow) is counted and logged at most once a minute, never
raised. The request path reads only in-memory state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

logger = logging.getLogger("ray.serve")


class ActorLink:
    """Calls the shared policy actor, re-resolving it by name after it died for good.

    ``resolve`` returns a handle (``get_or_create_policy_actor``). Ray restarts the actor
    itself (``max_restarts=-1``) and the old handle keeps working; a handle to an actor killed
    without restart is replaced by resolving again.
    """

    def __init__(self, resolve: Callable[[], Any], timeout_s: float = 2.0) -> None:
        self._resolve = resolve
        self._handle: Any = None
        self.timeout_s = timeout_s
        self.failures = 0
        self._last_log = 0.0

    def handle(self) -> Any:
        if self._handle is None:
            self._handle = self._resolve()
        return self._handle

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            ref = getattr(self.handle(), method).remote(*args, **kwargs)
            return await asyncio.wait_for(ref, timeout=self.timeout_s)
        except Exception as err:
            self.failures += 1
            if _actor_gone(err):
                self._handle = None  # resolve again next time
            now = time.monotonic()
            if now - self._last_log > 60:
                self._last_log = now
                logger.warning("policy actor call %s failed (%d failures so far): %r", method, self.failures, err)
            raise


def _actor_gone(err: BaseException) -> bool:
    name = type(err).__name__
    return name in ("ActorDiedError", "RayActorError", "ActorUnavailableError", "ValueError")


class PeriodicTask:
    """Runs ``step()`` every ``interval_s`` in the background; failures counted, never raised."""

    def __init__(self, name: str, step: Callable[[], Awaitable[Any]], interval_s: float) -> None:
        self.name = name
        self._step = step
        self.interval_s = interval_s
        self.runs = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def _loop(self) -> None:
        while True:
            try:
                await self._step()
                self.runs += 1
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - counted; ActorLink logs the cause
                self.failures += 1
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._task = None


def signal_reporter(
    link: ActorLink, source: str, collect: Callable[[], Mapping[str, float | None]], interval_s: float = 0.25
) -> PeriodicTask:
    """A `PeriodicTask` sending ``collect()`` to the policy actor as ``source``.

    A signal ``collect`` gives as None is one the replica tried to read and could not: it is
    sent as stale (the actor counts it and will not recover on it), never silently left out.
    """

    async def step() -> None:
        collected = collect()
        signals = {k: float(v) for k, v in collected.items() if v is not None}
        stale = sorted(k for k, v in collected.items() if v is None)
        if stale:
            await link.call("report", source, signals, stale)
        else:
            await link.call("report", source, signals)

    return PeriodicTask(f"report:{source}", step, interval_s)


def replica_source(default: str) -> str:
    """A stable report source name: the Serve replica id where there is one."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return f"{ctx.deployment}:{ctx.replica_id.unique_id}"
    except Exception:  # noqa: BLE001 - outside a replica (tests, scripts)
        return default
