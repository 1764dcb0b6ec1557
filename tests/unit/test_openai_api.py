"""Request parsing and error mapping of the ingress, without a cluster."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from ray.serve.exceptions import BackPressureError

from serve_app.ingress import IngressLimits, _model_call
from serve_app.openai_api import ChatCompletionRequest, CompletionRequest, RequestError, parse_body


def body(**kw) -> bytes:  # type: ignore[no-untyped-def]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}).encode()


def test_valid_request_parses_and_tracks_explicit_fields() -> None:
    req = parse_body(body(temperature=0.2, stream=True), ChatCompletionRequest, 10_000)
    assert req.temperature == 0.2 and req.stream and {"temperature", "stream"} <= req.model_fields_set


@pytest.mark.parametrize("raw, status, param, pattern", [
    (b"x" * 2000, 413, None, r"2000 bytes; the limit is 1024"),
    (b"{", 400, None, r"not valid JSON"),
    (b'"text"', 400, None, r"must be a JSON object, got str"),
    (body(top_p=0), 400, "top_p", r"top_p: Input should be greater than 0"),
    (body(stop=["a", "b", "c", "d", "e"]), 400, "stop", r"at most 4 stop sequences, got 5"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "url": "x"}]}]), 400,
     "messages.0.content.str", r"messages\.0\.content"),
    (body(frequency_penalty=3), 400, "frequency_penalty", r"less than or equal to 2"),
])
def test_bad_bodies(raw: bytes, status: int, param: str | None, pattern: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_body(raw, ChatCompletionRequest, 1024)
    err = info.value
    assert err.status == status and (param is None or err.param.startswith(param.split(".")[0]))
    assert re.search(pattern, err.message), err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_completion_prompt_list_of_one() -> None:
    req = parse_body(json.dumps({"model": "m", "prompt": ["only"]}).encode(), CompletionRequest, 10_000)
    assert req.prompt_text() == "only"


def test_full_model_queue_is_an_immediate_503_with_retry_after() -> None:
    async def refused():  # type: ignore[no-untyped-def]
        raise BackPressureError(num_queued_requests=32, max_queued_requests=32)

    with pytest.raises(RequestError) as info:
        asyncio.run(_model_call(refused(), IngressLimits(retry_after_s=2)))
    assert info.value.status == 503 and info.value.headers == {"Retry-After": "2"}
    assert "queue is full" in info.value.message


def test_model_error_record_keeps_status_and_field() -> None:
    async def record():  # type: ignore[no-untyped-def]
        return {"type": "error", "status": 400, "message": "messages is 900 tokens", "param": "messages"}

    with pytest.raises(RequestError) as info:
        asyncio.run(_model_call(record(), IngressLimits()))
    assert (info.value.status, info.value.param) == (400, "messages")
