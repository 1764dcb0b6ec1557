"""The core path for real: serve deploy, the vLLM engine on the tiny model, OpenAI clients."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.integration.conftest import Cluster, model_stats

pytestmark = pytest.mark.integration
MODEL = "brownout-tiny"
CHAT = "/v1/chat/completions"


def test_serve_deploy_reaches_running_and_answers(deployed: Cluster) -> None:
    from ray import serve

    app = serve.status().applications["brownout"]
    assert app.status == "RUNNING"
    assert set(app.deployments) >= {"Ingress", "VLLMModel"}
    r = httpx.post(deployed.base_url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 8}, timeout=60, headers=deployed.headers)
    assert r.status_code == 200, r.text


def test_openai_sdk_chat_whole(deployed: Cluster) -> None:
    client = openai.OpenAI(base_url=deployed.base_url + "/v1", api_key=deployed.secrets.api_key)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                                         max_tokens=12, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens >= 1 and out.usage.prompt_tokens >= 1
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_openai_sdk_chat_stream_ends_cleanly(deployed: Cluster) -> None:
    client = openai.OpenAI(base_url=deployed.base_url + "/v1", api_key=deployed.secrets.api_key)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Stream please."}],
                                            max_tokens=16, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 2
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert 1 <= usage.completion_tokens <= 16


def test_sse_wire_format_ends_with_done(http: httpx.Client) -> None:
    with http.stream("POST", CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    # Every line is an event or an SSE comment; the only comment is the deferral notice, which
    # a raised level (an earlier test may leave one) adds before [DONE].
    comments = [e for e in events if e.startswith(":")]
    assert all(e.startswith("data: ") for e in events if not e.startswith(":")), events
    assert all(c.startswith(": X-Brownout-Deferred: ") for c in comments), comments
    assert not comments or events.index(comments[0]) == len(events) - 1 - len(comments), events
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_an_open_stream_counts_as_inflight_until_its_last_byte(http: httpx.Client) -> None:
    """The ingress's `inflight` signal keeps a stream until it ends, not until its headers go out."""

    def inflight() -> int:
        return http.get("/admin/brownout").json()["ingress"]["inflight"]

    before = inflight()  # 0 unless an earlier test left a request running
    with http.stream("POST", CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "count"}],
                                         "max_tokens": 64, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # headers and a first event are out
        assert inflight() == before + 1
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    deadline = time.monotonic() + 5
    while inflight() != before:
        assert time.monotonic() < deadline, "the finished stream is still counted in flight"
        time.sleep(0.1)


def test_openai_sdk_completions(deployed: Cluster) -> None:
    client = openai.OpenAI(base_url=deployed.base_url + "/v1", api_key=deployed.secrets.api_key)
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10)
    assert out.object == "text_completion" and out.choices[0].text
    assert out.usage.completion_tokens >= 1
    texts = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="abc", max_tokens=6, stream=True)]
    assert "".join(texts)


def test_models_lists_the_served_model(deployed: Cluster) -> None:
    client = openai.OpenAI(base_url=deployed.base_url + "/v1", api_key=deployed.secrets.api_key)
    assert [m.id for m in client.models.list().data] == [MODEL]


def _chat(**over):  # type: ignore[no-untyped-def]
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **over}


@pytest.mark.parametrize(
    "body, status, param, pattern",
    [
        (_chat(model="gpt-17"), 404, "model", r"model 'gpt-17' does not exist"),
        (_chat(max_tokens=100_000), 400, "max_tokens", r"max_tokens=100000 exceeds the limit of 512"),
        (_chat(max_tokens=0), 400, "max_tokens", r"max_tokens: Input should be greater than or equal to 1"),
        (_chat(temperature=7), 400, "temperature", r"temperature: .*less than or equal to 2"),
        (_chat(messages=[]), 400, "messages", r"messages: .*at least 1 item"),
        (_chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role", r"messages\.0\.role"),
        (_chat(n=3), 400, "n", r"only n=1 is supported, got 3"),
        (_chat(logprobs=True), 400, "logprobs", r"logprobs: not supported by this server: only false is accepted"),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model", r"model: field required"),
        (_chat(messages=[{"role": "user", "content": "word " * 7000}]), 400, "messages",
         r"messages is 35000 characters; the limit is 32000"),
        (_chat(messages=[{"role": "user", "content": "zq " * 3000}]), 400, "messages",
         r"messages is \d+ tokens; the limit is 768"),
    ],
)
def test_bad_requests_name_the_field(http: httpx.Client, body: dict, status: int, param: str, pattern: str) -> None:
    r = http.post(CHAT, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    import re

    assert re.search(pattern, err["message"]), err["message"]


def test_malformed_json_is_400(http: httpx.Client) -> None:
    r = http.post(CHAT, content=b'{"model": "brownout-tiny", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = http.post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]


def test_oversized_body_is_413(http: httpx.Client) -> None:
    r = http.post(CHAT, content=b'{"pad": "' + b"x" * (1 << 20) + b'"}', headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert "limit is 1048576 (max_body_bytes)" in r.json()["error"]["message"]


def test_completions_bad_prompt_names_field(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_client_disconnect_aborts_the_engine_request(deployed: Cluster) -> None:
    """Closing the connection mid-stream aborts the vLLM request: its slot is freed and it is
    counted as aborted, not left to run to its 500 tokens.

    The 10 s bound only catches a hang; whether the request was aborted is decided by the
    abort counter (a request that ran to its end is not counted), not by a stopwatch, which
    on a slow 2-core machine once read 1.02 s for the whole disconnect-to-free path.
    """
    before = model_stats()
    assert before["num_running_reqs"] == 0
    body = _chat(max_tokens=500, ignore_eos=True, stream=True,
                 messages=[{"role": "user", "content": "go on forever"}])
    client = deployed.client()
    with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any('"content"' in g for g in got)
        running = model_stats()["num_running_reqs"]
        assert running == 1, running
        closed_at = time.monotonic()
    client.close()  # the connection goes away
    while True:
        stats = model_stats()
        if stats["num_running_reqs"] == 0 and stats["inflight"] == 0:
            break
        assert time.monotonic() - closed_at < 10.0, stats
        time.sleep(0.05)
    assert stats["aborted_total"] == before["aborted_total"] + 1, (before, stats)
