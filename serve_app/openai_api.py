"""OpenAI-compatible request schemas, response builders and the error shape.

Requests are validated strictly (``extra="forbid"``): an unknown or out-of-range field is a 400
whose message and ``param`` name the field, in OpenAI's error JSON shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.responses import JSONResponse


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Req):
    type: Literal["text"]
    text: str


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Req):
    include_usage: bool = False


class _Sampling(_Req):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = Field(default=False, description="vLLM extension: generate past end-of-sequence")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(v)}")
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError(f"exactly one prompt is supported, got a list of {len(v)}")
        return v

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class RequestError(Exception):
    """An error bound for the client: HTTP status, message, offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}

    def response(self, extra_headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(extra_headers or {})})


def body_too_large(size: int, max_body_bytes: int) -> RequestError:
    return RequestError(413, f"request body is {size} bytes; the limit is {max_body_bytes} (max_body_bytes)", None)


def parse_body(raw: bytes, schema: type[_Req], max_body_bytes: int) -> Any:
    """Size check, JSON decode and schema validation, each failure a `RequestError`."""
    if len(raw) > max_body_bytes:
        raise body_too_large(len(raw), max_body_bytes)
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(400, f"request body is not valid JSON: {err}", None) from None
    if not isinstance(doc, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(doc).__name__}", None)
    try:
        return schema.model_validate(doc)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = "unknown or unsupported field"
        elif first["type"] == "missing":
            msg = "field required"
        got = first.get("input")
        detail = f" (got {got!r})" if first["type"] not in ("missing",) and not isinstance(got, (dict, list)) else ""
        raise RequestError(400, f"{param}: {msg}{detail}", param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(rid: str, model: str, text: str, finish: str | None, pt: int, ct: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": finish}],
        "usage": usage(pt, ct),
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def text_completion(rid: str, model: str, text: str, finish: str | None, pt: int, ct: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": usage(pt, ct),
    }


def text_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
