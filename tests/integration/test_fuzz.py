"""The HTTP API fuzzed for real: from its own /openapi.json (schemathesis) and by mutation.

Bounded: a fixed number of examples per operation and a short completion per request (max_tokens
capped at 2 where the generated body asks for more, so the vLLM engine on CPU spends seconds, not
minutes). The properties, for every response: no 5xx except a deliberate 503 (with Retry-After),
every 4xx and 5xx in OpenAI's error JSON with a message, the level header on every response.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import Cluster
from tests.mutations import MALFORMED_UTF8, mutated_bodies

pytestmark = pytest.mark.integration
CHAT = "/v1/chat/completions"


def check_response(status: int, headers: Any, text: str, where: str) -> None:
    """The fuzz's properties for one response (``headers``: httpx's, or schemathesis's lists)."""
    headers = {k.lower(): (v[0] if isinstance(v, list) else v) for k, v in headers.items()}
    assert status < 500 or status == 503, f"{where}: {status} {text[:300]}"
    assert "x-brownout-level" in headers, f"{where}: no level header"
    if status >= 400:
        assert headers.get("content-type", "").startswith("application/json"), f"{where}: {status} {text[:300]}"
        err = json.loads(text)["error"]
        assert isinstance(err["message"], str) and err["message"], f"{where}: {text[:300]}"
        assert err["type"], where
    if status == 503:
        assert headers.get("retry-after"), f"{where}: 503 without Retry-After"


def _cap_tokens(body: Any) -> None:
    """Short completions; and the served model's name where a string is generated (a random one
    is only ever a 404, so the rest of the body would never be looked at)."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = "brownout-tiny"
        for field in ("max_tokens", "max_completion_tokens"):
            v = body.get(field)
            if isinstance(v, int) and not isinstance(v, bool) and v > 2:
                body[field] = 2
        if body.get("ignore_eos") is True or isinstance(body.get("min_tokens"), int):
            body.pop("min_tokens", None)


def _clear_overrides(http: httpx.Client) -> None:
    """The fuzz may pin a level or override features (with the admin token): undo it all."""
    http.delete("/admin/brownout/override", params={"level": "true"})
    state = http.get("/admin/brownout").json()
    for feature in (state.get("overrides") or state.get("feature_overrides") or {}):
        http.delete("/admin/brownout/override", params={"feature": feature})


def test_openapi_describes_every_request_body_and_error(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/admin/brownout/override", "OverrideBody")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert {"400", "401", "403", "404", "408", "413", "429", "503"} <= set(op["responses"])
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_schemathesis_from_the_live_schema(deployed: Cluster, http: httpx.Client) -> None:
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
    seen: dict[str, int] = {}
    started = time.monotonic()
    try:
        for result in schema.get_all_operations():
            op = result.ok()
            label = f"{op.method.upper()} {op.path}"
            examples = 40 if op.path.startswith("/v1/") and op.method.lower() == "post" else 12
            strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def run(case: Any) -> None:
                _cap_tokens(case.body)
                response = case.call(base_url=deployed.base_url, headers=deployed.headers, timeout=60)
                key = f"{label} -> {response.status_code}"
                seen[key] = seen.get(key, 0) + 1
                check_response(response.status_code, response.headers, response.text, label)

            run()
            assert time.monotonic() - started < 600, "the schemathesis run is over its time bound"
    finally:
        _clear_overrides(http)
    print("schemathesis responses:", json.dumps(seen, indent=1, sort_keys=True))
    assert any(k.startswith("POST /v1/chat/completions -> 400") for k in seen), seen
    assert sum(n for k, n in seen.items() if k.startswith("POST /v1/")) >= 40, seen


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(case=mutated_bodies())
def test_mutation_fuzz_against_the_live_service(deployed: Cluster, case: tuple[bytes, list[str]]) -> None:
    raw, kinds = case
    path = CHAT if b'"messages"' in raw or b'"prompt"' not in raw else "/v1/completions"
    r = httpx.post(deployed.base_url + path, content=raw, headers={**deployed.headers, "content-type": "application/json"},
                   timeout=60)
    check_response(r.status_code, r.headers, r.text, f"{path} {kinds}")


@pytest.mark.parametrize("raw", MALFORMED_UTF8)
def test_malformed_utf8_is_a_400_in_openai_shape(http: httpx.Client, raw: bytes) -> None:
    r = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    check_response(r.status_code, r.headers, r.text, "malformed utf-8")
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "brownout-tiny", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "messages"),
    (b"[" * 20000, None),
    (b'{"model": "brownout-tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (b'{"model": "brownout-tiny", "messages": [{"role": "user", "content": "x"}], "stop": "\\ud800"}', "stop"),
    (b'{"model": "brownout-tiny", "messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551616}',
     "seed"),
    (b'{"model": "brownout-tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     "temperature"),
    (b'{"model": "brownout-tiny", "messages": [{"role": "user", "content": "x"}], "stop": ' +
     json.dumps(["x"] * 10_000).encode() + b"}", "stop"),
])
def test_inputs_that_were_plain_text_500s_are_400s_naming_the_field(http: httpx.Client, raw: bytes,
                                                                   param: str | None) -> None:
    r = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    check_response(r.status_code, r.headers, r.text, param or "body")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_seeds_at_the_ends_of_the_64_bit_range_are_served(http: httpx.Client) -> None:
    for seed in (2**63 - 1, -(2**63)):
        r = http.post(CHAT, json={"model": "brownout-tiny", "messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 2, "seed": seed, "temperature": 1.0})
        assert r.status_code == 200, r.text


def test_a_slow_client_gets_a_408_in_openai_shape(deployed: Cluster) -> None:
    """A body trickled slower than auth.body_read_timeout_s (10 s in serve_config.yaml)."""
    body = json.dumps({"model": "brownout-tiny", "messages": [{"role": "user", "content": "x"}]}).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {deployed.secrets.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", deployed.http_port), timeout=60) as sock:
        sock.sendall(head + body[:5])
        deadline = time.monotonic() + 40
        sock.settimeout(1.0)
        answer = b""
        for byte in body[5:]:  # one byte every 2 s: the whole body would take about 2 minutes
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            try:
                chunk = sock.recv(65536)
                if chunk:
                    answer += chunk
                    break
            except TimeoutError:
                pass
            time.sleep(1.0)
            assert time.monotonic() < deadline, "no answer to a trickled body within 40 s"
        sock.settimeout(10)
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            more = sock.recv(65536)
            if not more:
                break
            answer += more
    head_text, _, payload = answer.partition(b"\r\n\r\n")
    assert head_text.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"body_read_timeout_s" in payload and b'"error"' in payload
