"""Request parsing and error mapping of the ingress, without a cluster."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from ray.serve.exceptions import BackPressureError

from deployments.model import ModelError
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
        return ModelError(400, "messages is 900 tokens", "messages")

    with pytest.raises(RequestError) as info:
        asyncio.run(_model_call(record(), IngressLimits()))
    assert (info.value.status, info.value.param) == (400, "messages")


# -- vLLM's sampling extensions and no-op fields (the clients benchmarks use) --------------------

def test_vllm_sampling_extensions_are_accepted_and_reach_the_sampling_keys() -> None:
    from deployments.engine import SAMPLING_KEYS
    from serve_app import ingress

    ext = {"min_tokens": 4, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
           "stop_token_ids": [2], "include_stop_str_in_output": True, "skip_special_tokens": False,
           "spaces_between_special_tokens": False, "bad_words": ["zz"], "allowed_token_ids": [5, 6]}
    for schema, raw in ((ChatCompletionRequest, body(max_tokens=8, **ext)),
                        (CompletionRequest, json.dumps({"model": "m", "prompt": "x", "max_tokens": 8, **ext}).encode())):
        req = parse_body(raw, schema, 10_000)
        sampling = {k: getattr(req, k) for k in SAMPLING_KEYS}
        assert {k: sampling[k] for k in ext} == ext
    assert ingress.SAMPLING_FIELDS is SAMPLING_KEYS  # one definition, shared by ingress and model


def test_sampling_keys_are_vllm_sampling_params_fields() -> None:
    """Read from vLLM's source, not imported: importing vllm costs about 8 s."""
    import ast
    import importlib.util
    from pathlib import Path

    from deployments.engine import SAMPLING_KEYS

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    tree = ast.parse((Path(spec.origin).parent / "sampling_params.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams"]
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert set(SAMPLING_KEYS) <= fields, set(SAMPLING_KEYS) - fields


def test_unset_extensions_stay_none_so_vllm_defaults_apply() -> None:
    req = parse_body(body(), ChatCompletionRequest, 10_000)
    assert (req.min_tokens, req.top_k, req.min_p, req.repetition_penalty) == (None, None, None, None)


@pytest.mark.parametrize("extra", [
    {"logprobs": False}, {"logprobs": None}, {"top_logprobs": 0}, {"tools": []}, {"tool_choice": "none"},
    {"parallel_tool_calls": True}, {"parallel_tool_calls": False}, {"logit_bias": {}}, {"use_beam_search": False},
    {"response_format": {"type": "text"}}, {"service_tier": "auto"}, {"store": False}, {"functions": []},
    {"modalities": ["text"]}, {"echo": False}, {"add_generation_prompt": True}, {"metadata": {"k": "v"}},
    {"priority": 0}, {"best_of": 1},
])
def test_no_op_values_are_accepted(extra: dict) -> None:  # type: ignore[type-arg]
    parse_body(body(**extra), ChatCompletionRequest, 10_000)


@pytest.mark.parametrize("extra, param, pattern", [
    ({"logprobs": True}, "logprobs", r"logprobs: not supported by this server: only false is accepted"),
    ({"top_logprobs": 3}, "top_logprobs", r"only 0 is accepted"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", r"tools: not supported.*only \[\]"),
    ({"tool_choice": "required"}, "tool_choice", r"tool_choice: not supported"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", r"logit_bias: not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", r"response_format: not supported"),
    ({"use_beam_search": True}, "use_beam_search", r"use_beam_search"),
    ({"best_of": 2}, "best_of", r"best_of: not supported.*only 1"),
    ({"min_tokens": -1}, "min_tokens", r"min_tokens: Input should be greater than or equal to 0"),
    ({"top_k": -2}, "top_k", r"top_k: Input should be greater than or equal to -1"),
    ({"min_p": 1.5}, "min_p", r"min_p: Input should be less than or equal to 1"),
    ({"repetition_penalty": 0}, "repetition_penalty", r"repetition_penalty: Input should be greater than 0"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", r"min_tokens=9 exceeds max_tokens=4"),
    ({"min_tokens": 9, "max_completion_tokens": 4}, "max_completion_tokens",
     r"min_tokens=9 exceeds max_completion_tokens=4"),
    ({"frobnicate": 1}, "frobnicate", r"unknown or unsupported field"),
])
def test_unsupported_values_are_400_naming_the_field(extra: dict, param: str, pattern: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(RequestError) as info:
        parse_body(body(**extra), ChatCompletionRequest, 10_000)
    assert (info.value.status, info.value.param) == (400, param)
    assert re.search(pattern, info.value.message), info.value.message


def test_completion_no_op_fields() -> None:
    def raw(**kw):  # type: ignore[no-untyped-def]
        return json.dumps({"model": "m", "prompt": "x", **kw}).encode()

    parse_body(raw(logprobs=None, suffix=None, echo=False, best_of=1), CompletionRequest, 10_000)
    parse_body(raw(logprobs=0), CompletionRequest, 10_000)
    with pytest.raises(RequestError) as info:
        parse_body(raw(logprobs=2), CompletionRequest, 10_000)
    assert info.value.param == "logprobs"
