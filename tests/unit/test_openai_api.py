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


# -- inputs that used to reach the engine and fail there (plain-text 500s) ------------------------

DEEP_STOP = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}"


@pytest.mark.parametrize("raw, param, pattern", [
    (b"[" * 5000, None, r"body: nested deeper than 32 levels"),  # unclosed: the parser's own RecursionError
    (b"[" * 5000 + b"]" * 5000, None, r"body: nested deeper than 32 levels \(at byte 32\)"),
    (DEEP_STOP, "stop", r"stop: nested deeper than 32 levels"),
    (b'{"model": "m", "messages": ' + b"[" * 40 + b"]" * 40 + b"}", "messages", r"messages: nested deeper"),
    (body(messages=[{"role": "user", "content": "\ud800"}]), "messages.0.content", r"not valid Unicode"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]),
     "messages.0.content.0.text", r"not valid Unicode"),
    (body(stop="\ud800"), "stop", r"stop: text is not valid Unicode"),
    (body(stop=["ok", "\udc80"]), "stop.1", r"not valid Unicode"),
    (body(user="\ud800"), "user", r"not valid Unicode"),
    (body(seed=2**64), "seed", r"seed: Input should be less than or equal to 9223372036854775807"),
    (body(seed=-(2**63) - 1), "seed", r"seed: Input should be greater than or equal to"),
    (body(stop_token_ids=[2**63]), "stop_token_ids.0", r"less than or equal to 9223372036854775807"),
    (body(temperature=float("nan")), "temperature", r"temperature: Input should be a finite number"),
    (body(repetition_penalty=float("inf")), "repetition_penalty", r"finite number"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 1e400}', "top_p", r"finite number"),
    (b'{"model": "m", "messages": [], "max_tokens": ' + b"9" * 5000 + b"}", None, r"not valid JSON: .*digits"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xc3\x28"}]}', None,
     r"not valid UTF-8: invalid continuation byte at byte"),
])
def test_inputs_that_once_failed_in_the_engine_are_400s(raw: bytes, param: str | None, pattern: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_body(raw, ChatCompletionRequest, 1 << 20)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    assert re.search(pattern, info.value.message), info.value.message


def test_the_64_bit_seed_range_is_accepted_to_its_ends() -> None:
    assert parse_body(body(seed=2**63 - 1), ChatCompletionRequest, 10_000).seed == 2**63 - 1
    assert parse_body(body(seed=-(2**63)), ChatCompletionRequest, 10_000).seed == -(2**63)


@pytest.mark.parametrize("text, deeper", [
    ("{}", False), ("[" * 32 + "]" * 32, False), ("[" * 33 + "]" * 33, True),
    ('{"a": "' + "[" * 100 + '"}', False),  # brackets inside a string do not nest
    ('{"a": "\\"' + "[" * 100 + '"}', False),  # nor after an escaped quote
    ("[{" * 16 + "}]" * 16, False), ("[{" * 16 + "[]" + "}]" * 16, True),
    ("[[],[[]]]" * 1000, False), ("[" * 10_000, False),  # unpaired: not JSON, the parser says so
    ("]" * 100 + "[" * 100, False), ("[}" * 100, False),
])
def test_json_depth_is_read_on_the_bytes(text: str, deeper: bool) -> None:
    from serve_app.openai_api import json_depth_exceeds

    assert json_depth_exceeds(text.encode(), 32) is deeper


def test_depth_check_is_fast_on_a_hostile_megabyte() -> None:
    import time

    from serve_app.openai_api import json_depth_exceeds

    for raw in (b"[]" * 500_000, (b"[" * 31 + b"]" * 31) * 16_000, b'"a",' * 250_000, b'"' + b"[" * 1_000_000 + b'"'):
        started = time.perf_counter()
        json_depth_exceeds(raw, 32)
        assert time.perf_counter() - started < 1.0


# -- failures mapped to OpenAI's JSON ------------------------------------------------------------

def _ray_errors() -> list[tuple[BaseException, int, bool]]:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    from ray.serve._private.common import DeploymentID

    return [
        (BackPressureError(num_queued_requests=1, max_queued_requests=1), 503, False),
        (DeploymentUnavailableError(DeploymentID(name="VLLMModel", app_name="a")), 503, True),
        (ActorDiedError(), 503, True),
        (RayActorError(), 503, True),
        (ActorUnavailableError("gone", None), 503, True),
        (GetTimeoutError(), 503, False),
        (asyncio.TimeoutError(), 503, False),
        (KeyError("x"), 500, False),
        (RecursionError(), 500, False),
    ]


def test_failures_map_to_openai_json_503_or_500() -> None:
    from serve_app.ingress import failure_error

    for err, status, down in _ray_errors():
        mapped = failure_error(err, retry_after_s=3)
        assert mapped.status == status, (err, mapped.message)
        assert mapped.body()["error"]["message"]
        assert bool(getattr(mapped, "model_down", False)) is down, err
        if status == 503:
            assert mapped.headers["Retry-After"] == "3" and mapped.kind == "service_unavailable"
        else:
            assert mapped.kind == "server_error" and "x" not in mapped.message.split("(")[0]


def test_a_task_error_is_mapped_by_its_cause() -> None:
    from ray.exceptions import ActorDiedError, RayTaskError

    from serve_app.ingress import failure_error

    wrapped = RayTaskError("generate", "traceback", ActorDiedError())
    assert failure_error(wrapped).status == 503
    assert failure_error(RayTaskError("generate", "traceback", ValueError("boom"))).status == 500


def test_an_engine_failure_in_a_model_call_is_a_503_that_says_the_model_is_down() -> None:
    async def dead():  # type: ignore[no-untyped-def]
        return ModelError(503, "the engine died; retry later", None, kind="service_unavailable", engine_dead=True)

    with pytest.raises(RequestError) as info:
        asyncio.run(_model_call(dead(), IngressLimits()))
    assert info.value.status == 503 and info.value.model_down  # type: ignore[attr-defined]


def test_model_health_follows_the_latest_observation() -> None:
    from serve_app.health import ModelHealth

    now = [100.0]
    h = ModelHealth(clock=lambda: now[0])
    assert h.refusal() is None and h.up
    h.observe(False, "engine dead")
    now[0] = 105.0
    h.observe(False, "engine dead")
    assert h.downs == 1 and h.since == 100.0
    assert "engine dead" in (h.refusal() or "") and h.refused == 1
    h.observe(True)
    assert h.refusal() is None and h.state()["up"] and h.since == 105.0


def test_an_expiry_marks_the_model_down_only_where_it_has_not_answered_for_as_long() -> None:
    from serve_app.health import ModelHealth

    now = [100.0]
    h = ModelHealth(clock=lambda: now[0])
    h.observe(True)  # a probe's answer at 100
    now[0] = 101.5
    assert not h.observe_expired(2.0) and h.up  # it answered 1.5 s ago: the replicas were full, not gone
    now[0] = 102.0
    assert h.observe_expired(2.0) and not h.up  # silent for the whole 2 s wait: no replica takes work
    assert "2.0 s" in (h.refusal() or "") and h.downs == 1 and h.since == 102.0
    assert h.heard_at == 100.0  # an expiry is no answer from the model
    now[0] = 103.0
    assert h.observe_expired(2.0) and h.downs == 1  # still down: one transition
    h.observe(True)  # a probe answers again: up at once
    assert h.up and h.refusal() is None and h.heard_at == 103.0
    for bad in (float("nan"), -1.0, float("inf")):
        assert not h.observe_expired(bad) and h.up
    fresh = ModelHealth(clock=lambda: now[0])  # nothing ever answered
    assert fresh.observe_expired(0.5) and "since the ingress started" in (fresh.reason or "")


def _app_with_error_handling():  # type: ignore[no-untyped-def]
    from fastapi import FastAPI
    from starlette.responses import StreamingResponse

    from serve_app.ingress import install_error_handling

    app = FastAPI()
    install_error_handling(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret request text")

    @app.get("/dead")
    async def dead() -> None:
        from ray.exceptions import ActorDiedError

        raise ActorDiedError()

    @app.get("/items")
    async def items(n: int = 1) -> dict:  # type: ignore[type-arg]
        return {"n": n}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body():  # type: ignore[no-untyped-def]
            yield b'data: {"x": 1}\n\n'
            raise RuntimeError("mid-stream")

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def test_every_error_of_the_app_is_openai_json_with_the_level_header() -> None:
    from starlette.testclient import TestClient

    with TestClient(_app_with_error_handling(), raise_server_exceptions=False) as client:
        for method, path, status in (("GET", "/boom", 500), ("GET", "/dead", 503), ("GET", "/nowhere", 404),
                                     ("POST", "/items", 405), ("GET", "/items?n=abc", 400)):
            r = client.request(method, path)
            assert r.status_code == status, (path, r.text)
            assert r.headers["content-type"].startswith("application/json"), path
            err = r.json()["error"]
            assert err["message"] and err["type"], path
            assert "secret" not in err["message"]
            assert "x-brownout-level" in r.headers
        assert client.get("/items?n=abc").json()["error"]["param"] == "n"
        assert client.get("/dead").headers["retry-after"] == "1"
        assert "x-brownout-level" in client.get("/items").headers


def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event_and_done() -> None:
    from starlette.testclient import TestClient

    with TestClient(_app_with_error_handling(), raise_server_exceptions=False) as client:
        r = client.get("/stream")
    events = [line for line in r.text.split("\n") if line]
    assert events[0] == 'data: {"x": 1}'
    assert json.loads(events[-2][len("data: "):])["error"]["type"] == "server_error"
    assert events[-1] == "data: [DONE]"


def test_openapi_describes_every_request_body_and_error() -> None:
    from serve_app.ingress import api

    doc = api.openapi()
    schemas = doc["components"]["schemas"]
    for path, method, model in (("/v1/chat/completions", "post", "ChatCompletionRequest"),
                                ("/v1/completions", "post", "CompletionRequest"),
                                ("/admin/brownout/override", "post", "OverrideBody")):
        op = doc["paths"][path][method]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert model in schemas
        for code in ("400", "401", "403", "404", "408", "413", "429", "503"):
            ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse"), (path, code)
    assert schemas["ChatCompletionRequest"]["properties"]["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    assert "422" not in json.dumps(doc["paths"])
    # every reference resolves inside the document
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs <= set(schemas), refs - set(schemas)


def test_a_lone_surrogate_in_a_key_is_a_400_whose_response_renders() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "\\ud800": 1}'
    with pytest.raises(RequestError) as info:
        parse_body(raw, ChatCompletionRequest, 10_000)
    assert info.value.status == 400 and info.value.param == "\\ud800"
    rendered = json.loads(info.value.response().body)["error"]
    assert rendered["param"] == "\\ud800" and "not valid Unicode" in rendered["message"]


def test_the_retry_after_of_a_model_that_is_down_is_the_predicted_rest_of_its_outage() -> None:
    from serve_app.health import OUTAGES_KEPT, ModelHealth

    now = [1000.0]
    h = ModelHealth(clock=lambda: now[0])
    assert h.retry_after_s(1, 60) == 1  # up: the floor
    h.observe(False, "engine dead")
    assert h.predicted_outage_s() is None and h.retry_after_s(1, 60) == 1  # nothing known: the floor
    for bad in (None, float("nan"), -3.0, float("inf"), "40", True):
        h.observe_start(bad)
        assert h.start_s is None, bad
    h.observe_start(40.0)  # the replica that answered last took 40 s to start
    assert h.predicted_outage_s() == 40.0
    # (seconds down, floor, cap) -> Retry-After
    table = [(0.0, 1, 60, 40), (10.0, 1, 60, 30), (39.5, 1, 60, 1), (10.0, 1, 20, 20), (10.0, 35, 60, 35),
             (40.0, 1, 60, 1),
             (55.0, 1, 60, 15), (70.0, 1, 60, 30), (200.0, 1, 60, 60)]  # overdue by d: d (doubling checks)
    for down_s, floor_s, cap_s, want in table:
        now[0] = h.since + down_s
        assert h.retry_after_s(floor_s, cap_s) == want, (down_s, floor_s, cap_s)
    now[0] = h.since + 90.0
    h.observe(True)  # back after 90 s, as seen from here
    assert h.outages == [90.0] and h.predicted_outage_s() == 90.0 and h.retry_after_s(1, 60) == 1
    assert h.state()["outages_s"] == [90.0] and h.state()["predicted_outage_s"] == 90.0
    for length in (30.0, 120.0, 100.0, 10.0, 80.0, 70.0):  # the median of the last OUTAGES_KEPT
        h.observe(False, "gone")
        now[0] += length
        h.observe(True)
    assert h.outages == [120.0, 100.0, 10.0, 80.0, 70.0] and len(h.outages) == OUTAGES_KEPT
    assert h.predicted_outage_s() == 80.0  # what the replica's start said no longer counts
    h.observe(False, "gone")
    now[0] += 20.0
    assert h.retry_after_s(1, 60) == 60 and h.retry_after_s(1, 100) == 60


def test_the_most_retry_after_is_validated_against_the_least() -> None:
    with pytest.raises(ValueError, match="retry_after_s=30 exceeds max_retry_after_s=10"):
        IngressLimits(retry_after_s=30, max_retry_after_s=10)
    assert IngressLimits().max_retry_after_s == 60 and IngressLimits().retry_after_s == 1


def test_a_model_down_on_silence_alone_gets_the_floor_until_an_answer_says_so() -> None:
    from serve_app.health import ModelHealth

    now = [1000.0]
    h = ModelHealth(clock=lambda: now[0])
    h.observe(True)
    h.observe_start(40.0)
    now[0] = 1005.0
    assert h.observe_expired(2.0) and h.inferred  # silent for the whole wait: down, but only inferred
    assert h.retry_after_s(1, 60) == 1  # a jammed engine is silent too: no minute-long Retry-After
    now[0] = 1006.0
    assert h.observe_expired(2.0) and h.inferred  # more silence changes nothing
    h.observe(True)  # a jam that ended: not an outage to predict the next from
    assert h.up and h.outages == [] and not h.inferred
    now[0] = 1010.0
    assert h.observe_expired(2.0) and h.inferred
    now[0] = 1012.0
    h.observe(False, "replica unreachable: ActorDiedError")  # an answer says so: certain from now
    assert not h.inferred and h.since == 1010.0 and h.retry_after_s(1, 60) == 38
    now[0] = 1015.0
    assert h.observe_expired(2.0) and not h.inferred  # silence does not undo the certainty
    now[0] = 1100.0
    h.observe(True)
    assert h.outages == [90.0] and h.state()["inferred"] is False


def test_the_outages_seen_here_go_to_the_policy_actor_and_its_record_comes_back() -> None:
    """`ModelHealth.share` against a `PolicyCore` (the actor's behaviour) behind a fake link: an
    ingress started later, or restarted, predicts from the outages its neighbours saw."""
    from policies.config import parse_policy
    from policies.service import PolicyCore
    from serve_app.health import ModelHealth

    now = [1000.0]
    actor = PolicyCore(parse_policy({}), clock=lambda: now[0])
    calls: list[tuple[str, tuple]] = []
    fail = [False]

    async def call(method: str, *args):  # type: ignore[no-untyped-def]
        calls.append((method, args))
        if fail[0]:
            raise ConnectionError("policy actor unreachable")
        return getattr(actor, method)(*args)

    first, second = ModelHealth(clock=lambda: now[0]), ModelHealth(clock=lambda: now[0])
    assert asyncio.run(first.share(call)) and calls == [("model_outages", ())]  # read once at the start
    assert not asyncio.run(first.share(call)) and len(calls) == 1  # then nothing to send: no call
    first.observe(False, "engine dead")
    second.observe(False, "engine dead")
    now[0] += 100.0
    first.observe(True)
    now[0] += 0.5
    second.observe(True)  # the same outage, seen end half a second later
    assert first.unshared == [(1100.0, 100.0)] and first.outages == [100.0]
    fail[0] = True
    with pytest.raises(ConnectionError):
        asyncio.run(first.share(call))
    assert first.unshared == [(1100.0, 100.0)]  # kept for the next try
    fail[0] = False
    assert asyncio.run(first.share(call)) and first.unshared == [] and calls[-1] == ("record_outage", (1100.0, 100.0))
    assert asyncio.run(second.share(call)) and second.outages == [100.5]  # one outage, the longest view
    assert asyncio.run(first.share(call)) is False and first.outages == [100.0]  # first reads once only

    late = ModelHealth(clock=lambda: now[0])  # an ingress started (or restarted) after the outage
    late.observe_start(174.0)
    assert late.predicted_outage_s() == 174.0
    assert asyncio.run(late.share(call)) and late.predicted_outage_s() == 100.5
    assert late.state()["outages_shared"] is True and late.state()["outages_unshared"] == 0

    async def bad(method: str, *args):  # type: ignore[no-untyped-def]
        return {"not": "a list"}

    odd = ModelHealth(clock=lambda: now[0])
    with pytest.raises(TypeError, match="not a list of seconds"):
        asyncio.run(odd.share(bad))
    assert odd.shared is False and odd.outages == []
    for record in ([1.0, -2.0], [float("nan")], [True], "3"):
        assert odd.adopt(record) is False and odd.outages == []
