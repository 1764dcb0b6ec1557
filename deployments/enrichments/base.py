"""The Enrichment contract: one optional feature's real work, behind a plain async interface.

An `Enrichment` is a plain object (no Ray). Where its features say so it runs inside the ingress
process (pure, cheap work: no RPC); otherwise `deployments/enrichments/host.py` puts it behind a
thin Serve deployment, and the ingress sends it every call of one request phase in one
``host.call_many.remote([(feature, payload), ...])``. Contract:

- ``features``: the registered feature names (``policies.features.REGISTRY``) it serves. One
  object may serve several (the semantic cache serves lookup and write).
- ``await call(feature, payload) -> dict``: do the work for ``feature``. ``payload`` and the
  result are plain JSON-able dicts (they may cross process boundaries). Each feature's
  `deployments.enrichments.feature.Feature` builds its payload and applies its result; side
  effects always receive ``{"records": [record, ...]}`` (see
  `deployments.enrichments.feature.RequestState.record`) and return ``{"ok": True, ...}``.
- It raises on failure; the pipeline times each call out, counts failures and goes on without
  the stage. It must never block the event loop for long: CPU-heavy work (embeddings) and
  blocking I/O (fsync, SQLite) run in a worker thread, through `offload` (``asyncio.to_thread``
  that also meters the thread's CPU time for the call).
- ``counters() -> dict[str, int]``: calls per feature since start (the acceptance tests use
  these to prove a bypassed feature received no call); `Enrichment.call` counts them.

CPU time per call (issue 13's cost accounting), measured where the work runs: `Enrichment.call`
drives the feature's coroutine step by step (`_Metered`) and adds ``time.thread_time()`` of each
step, so CPU spent by other requests' coroutines while this one waits is not charged to it;
work handed to `offload` adds its worker thread's ``thread_time``. `run_calls` returns it in
``Outcome.cpu_s`` (the ingress's `serve_app.pipeline` adds it to the feature's cost); the
enrichment keeps its own sum per feature (``stats()["cpu_s"]`` through the host).
- ``stats() -> dict``: anything else worth showing an operator (sizes, hit rates).
- ``warmup()``: load what the first call would otherwise load (a model): the host awaits it
  before the replica reports ready, so no request pays for it.
- ``close()``: release files and connections.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")


class CpuMeter:
    """Seconds of thread CPU time charged to one call (added from the loop and worker threads)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                self.seconds += seconds


_METER: contextvars.ContextVar[CpuMeter | None] = contextvars.ContextVar("brownout_cpu_meter", default=None)


class _Metered:
    """Await a coroutine, adding the thread CPU time of each of its steps (from one resumption
    to its next suspension, all on this thread) to ``meter``. Futures it yields pass through to
    the running task unchanged, so it behaves as the coroutine itself."""

    def __init__(self, coro: Coroutine[Any, Any, T], meter: CpuMeter) -> None:
        self._coro = coro
        self._meter = meter

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value, error = self._coro, None, None
        while True:
            t0 = time.thread_time()
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                self._meter.add(time.thread_time() - t0)
            try:
                value, error = (yield yielded), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as err:  # noqa: BLE001 - thrown in by the task (a cancellation): pass it on
                value, error = None, err


async def offload(fn: Callable[..., T], *args: Any) -> T:
    """``asyncio.to_thread(fn, *args)``, charging the worker thread's CPU time to the
    `Enrichment.call` it runs under (if any)."""
    meter = _METER.get()

    def timed() -> T:
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            if meter is not None:
                meter.add(time.thread_time() - t0)

    return await asyncio.to_thread(timed)


class Enrichment(abc.ABC):
    features: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._calls: Counter[str] = Counter()
        self._cpu_s: Counter[str] = Counter()

    async def call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        return (await self.call_metered(feature, payload))[0]

    async def call_metered(self, feature: str, payload: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """`call`, and the CPU seconds the feature's work took (see the module docstring). A
        call that raises still adds its CPU time to ``cpu_seconds()``."""
        if feature not in self.features:
            raise ValueError(f"{type(self).__name__} does not serve feature {feature!r}; it serves {self.features}")
        self._calls[feature] += 1
        meter = CpuMeter()
        token = _METER.set(meter)
        try:
            result = await _Metered(self._call(feature, payload), meter)
        finally:
            _METER.reset(token)
            self._cpu_s[feature] += meter.seconds
        return result, meter.seconds

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds per feature since start (calls that failed included)."""
        return {f: round(self._cpu_s.get(f, 0.0), 6) for f in self.features}

    @abc.abstractmethod
    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Do the work of ``feature`` (already checked to be one of ``features``)."""

    def counters(self) -> dict[str, int]:
        return {f: self._calls.get(f, 0) for f in self.features}

    def stats(self) -> dict[str, Any]:
        return {}

    async def warmup(self) -> None:
        return None

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class Outcome:
    """One stage call's outcome, as it crosses back from a host: a result or an error text."""

    result: dict[str, Any] | None = None
    error: str | None = None
    cpu_s: float | None = None  # the worker's CPU time for this call (None: not measured)


async def run_calls(by_feature: Mapping[str, Enrichment], calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Outcome]:
    """Run a batch of ``(feature, payload)`` calls concurrently; one failure fails only its call."""

    async def one(feature: str, payload: dict[str, Any]) -> Outcome:
        enrichment = by_feature.get(feature)
        if enrichment is None:
            return Outcome(error=f"no enrichment here serves {feature!r}; served: {sorted(by_feature)}")
        try:
            result, cpu_s = await enrichment.call_metered(feature, payload)
            return Outcome(result=result, cpu_s=cpu_s)
        except Exception as err:  # noqa: BLE001 - reported to the caller, who bypasses the stage
            # the type only: an exception's text may quote the request (prompt, user), and this
            # string is logged
            return Outcome(error=type(err).__name__)

    return list(await asyncio.gather(*(one(f, p) for f, p in calls)))
