"""VLLMModel's answers when its engine fails: values (`ModelError`), never exceptions.

The engine here is a stub with `LLMEngine`'s interface that raises `EngineError` where vLLM's
``AsyncLLM`` would raise ``EngineDeadError`` or a ``GracefulHTTPError`` (the translation itself is
vLLM-specific and runs in the integration fault test, `tests/integration/test_faults.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from deployments.engine import Delta, EngineError, EngineSettings
from deployments.model import Completion, ModelError, Reached, Started, VLLMModel


class StubEngine:
    def __init__(self, fail_after: int | None, error: EngineError) -> None:
        self.fail_after, self.error = fail_after, error
        self.dead = False
        self.stream_intervals: list[int | None] = []  # per generate call: what the model passed

    @property
    def errored(self) -> bool:
        return self.dead

    def encode(self, text: str) -> list[int]:
        return [1] * len(text.split())

    def render_chat(self, messages: Any) -> str:
        return " ".join(m["content"] for m in messages)

    async def check_health(self) -> None:
        if self.dead:
            raise EngineError("the model's engine process has died", dead=True)

    def slowdown(self) -> float:
        return 2.5  # `LLMEngine.slowdown`: what the ingress's door predicts with

    async def generate(self, prompt: str, sampling: Any, request_id: str, prompt_ids: Any = None,
                       priority: int = 0, stream_interval: int | None = None) -> AsyncIterator[Delta]:
        self.stream_intervals.append(stream_interval)
        for i in range(3):
            if self.fail_after is not None and i >= self.fail_after:
                self.dead = self.error.dead
                raise self.error
            yield Delta(text="t", new_tokens=1, prompt_tokens=2, completion_tokens=i + 1,
                        finish_reason="length" if i == 2 else None)


class _Bare(VLLMModel):
    def __del__(self) -> None:  # Serve's async __del__ stops what __init__ started: nothing here
        pass


def model(engine: StubEngine) -> VLLMModel:
    m = object.__new__(_Bare)  # no Serve, no reporter: only the request path
    m.settings = EngineSettings(model="stub")
    m.served_model_name, m.max_prompt_tokens = "stub", 100
    m.engine, m.dropped_late, m.engine_failures = engine, 0, 0  # type: ignore[assignment]
    m.start_s = 12.5
    return m


async def events(m: VLLMModel) -> list[Any]:
    return [e async for e in m.generate_stream({"prompt": "a b", "max_tokens": 3})]


DEAD = EngineError("the model's engine process has died; this replica is being replaced", dead=True)
BUSY = EngineError("The engine is currently busy", status=503)
CONFLICT = EngineError("already active", status=409)


@pytest.mark.parametrize("fail_after, error, status, dead", [
    (0, DEAD, 503, True), (0, BUSY, 503, False), (0, CONFLICT, 409, False),
])
def test_an_engine_failure_before_the_first_token_is_one_model_error(fail_after, error, status, dead) -> None:  # type: ignore[no-untyped-def]
    m = model(StubEngine(fail_after, error))
    reached, only = asyncio.run(events(m))
    assert isinstance(reached, Reached)
    assert isinstance(only, ModelError) and (only.status, only.engine_dead) == (status, dead)
    assert only.kind == ("service_unavailable" if status == 503 else "invalid_request_error")
    assert m.engine_failures == 1
    whole = asyncio.run(_collect(m.generate_whole({"prompt": "a b", "max_tokens": 3})))
    assert [type(e) for e in whole] == [Reached, ModelError]


def test_an_engine_death_mid_stream_ends_it_with_a_model_error() -> None:
    m = model(StubEngine(2, DEAD))
    got = asyncio.run(events(m))
    assert [type(e) for e in got[:4]] == [Reached, Started, Delta, Delta]
    assert isinstance(got[-1], ModelError) and got[-1].status == 503 and got[-1].engine_dead
    # a whole answer: the same start, then the failure in place of the Completion
    whole = asyncio.run(_collect(model(StubEngine(2, DEAD)).generate_whole({"prompt": "a b", "max_tokens": 3})))
    assert [type(e) for e in whole] == [Reached, Started, ModelError] and whole[-1].engine_dead


def test_health_asks_the_engine() -> None:
    engine = StubEngine(0, DEAD)
    m = model(engine)
    health = asyncio.run(m.health())
    assert health["ok"] is True and health["slowdown"] == 2.5 and health["start_s"] == 12.5
    asyncio.run(m.check_health())
    asyncio.run(events(m))  # the engine dies
    dead = asyncio.run(m.health())
    assert dead["ok"] is False and "died" in dead["reason"] and dead["start_s"] == 12.5
    with pytest.raises(EngineError):
        asyncio.run(m.check_health())  # Serve sees the replica unhealthy and replaces it


def test_the_shaped_stream_interval_reaches_the_engine_and_none_leaves_it_the_engines() -> None:
    engine = StubEngine(None, DEAD)
    m = model(engine)
    asyncio.run(events(m))
    got = asyncio.run(_collect(m.generate_stream({"prompt": "a b", "max_tokens": 3, "stream_interval": 8})))
    assert [type(e) for e in got] == [Reached, Started, Delta, Delta, Delta]
    assert engine.stream_intervals == [None, 8]


def test_a_whole_answer_streams_reached_started_then_one_completion() -> None:
    m = model(StubEngine(None, DEAD))
    got = asyncio.run(_collect(m.generate_whole({"prompt": "a b", "max_tokens": 3})))
    assert [type(e) for e in got] == [Reached, Started, Completion]
    assert got[1].prompt_tokens == 2
    assert got[2] == Completion(text="ttt", prompt_tokens=2, completion_tokens=3, finish_reason="length")


@pytest.mark.parametrize("method", ["generate_stream", "generate_whole"])
def test_a_request_past_its_deadline_on_arrival_is_dropped_before_it_is_reached(method: str) -> None:
    engine = StubEngine(None, DEAD)
    m = model(engine)
    late = {"prompt": "a b", "max_tokens": 3, "deadline_at": time.time() - 0.01}
    (only,) = asyncio.run(_collect(getattr(m, method)(late)))
    assert isinstance(only, ModelError) and only.status == 503 and "deadline" in only.message
    assert m.dropped_late == 1 and engine.stream_intervals == []  # the engine never saw it
    in_time = asyncio.run(_collect(getattr(m, method)({**late, "deadline_at": time.time() + 60})))
    assert type(in_time[0]) is Reached and m.dropped_late == 1


async def _collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [e async for e in stream]
