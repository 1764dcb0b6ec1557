"""Mutation fuzz of request parsing: valid bodies with 1-3 random mutations (`tests.mutations`).

Whatever arrives, `parse_body` either accepts a body the engine can take (every string valid
Unicode, every number finite, ``seed`` and token ids 64-bit) or refuses it with a 400/413 in
OpenAI's shape whose message is not empty; it never raises anything else (a RecursionError, a
UnicodeEncodeError, an OverflowError would be a plain 500 in the service).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.ingress import OverrideBody
from serve_app.openai_api import (
    INT64_MAX,
    INT64_MIN,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    parse_body,
)
from tests.mutations import MALFORMED_UTF8, mutated_bodies, serialize

LIMIT = 1 << 20


def _safe(value: Any, path: str = "") -> None:
    """Everything an accepted body holds is something the engine, a log or a file can take."""
    if isinstance(value, str):
        value.encode("utf-8")  # raises on a lone surrogate
    elif isinstance(value, float):
        assert math.isfinite(value), path
    elif isinstance(value, bool):
        pass
    elif isinstance(value, int):
        assert INT64_MIN <= value <= INT64_MAX, path
    elif isinstance(value, dict):
        for k, v in value.items():
            _safe(k, path)
            _safe(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _safe(v, f"{path}.{i}")


def _check(raw: bytes, schema: type) -> RequestError | None:
    try:
        req = parse_body(raw, schema, LIMIT)
    except RequestError as err:
        assert err.status in (400, 413), (err.status, err.message)
        body = err.body()["error"]
        assert body["message"] and body["type"] == "invalid_request_error"
        err.response()  # the response itself renders: no text in it that UTF-8 cannot hold
        return err
    _safe(req.model_dump())
    return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_bodies())
def test_a_mutated_body_is_accepted_safe_or_refused_with_a_message(case: tuple[bytes, list[str]]) -> None:
    raw, _kinds = case
    schema = ChatCompletionRequest if b'"messages"' in raw or b'"prompt"' not in raw else CompletionRequest
    _check(raw, schema)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise_anything_but_a_request_error(raw: bytes) -> None:
    _check(raw, ChatCompletionRequest)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["level", "feature", "enabled", "ttl_s", "note", "x"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))))
def test_override_bodies_never_raise_anything_but_a_request_error(doc: dict[str, Any]) -> None:
    _check(serialize(doc), OverrideBody)


@pytest.mark.parametrize("raw", MALFORMED_UTF8)
def test_malformed_utf8_is_a_400(raw: bytes) -> None:
    err = _check(raw, ChatCompletionRequest)
    assert err is not None and err.status == 400
