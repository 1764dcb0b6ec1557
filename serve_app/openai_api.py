"""OpenAI-compatible request schemas, response builders and the error shape.

Requests are validated strictly (``extra="forbid"``): an unknown or out-of-range field is a 400
whose message and ``param`` name the field, in OpenAI's error JSON shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Besides OpenAI's sampling fields, vLLM's sampling extensions that its own OpenAI server accepts
(``min_tokens``, ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ...) are accepted and
passed to the engine (`deployments.engine.SAMPLING_KEYS`); their ranges are vLLM's. Fields this
server does not implement (log probabilities, tools, response formats, ...) are accepted only with
the value that asks for nothing (``logprobs: false``, ``tools: []``, ...), so clients and
benchmark tools that send the defaults explicitly work; any other value is a 400 naming the field.

Nothing a client sends may reach the engine in a form that can fail there, where a failure is a
500 or, worse, kills the engine process for everyone: so, at the door, each a 400 naming the field,
a body nested deeper than `MAX_JSON_DEPTH` (checked on the raw bytes before parsing: Python's
parser recurses and fails with a RecursionError), a string UTF-8 cannot hold (a lone surrogate
escape such as ``"\ud800"``), a non-finite number (``NaN``, ``Infinity``, ``1e400``), and an
integer outside the range vLLM's own OpenAI server accepts (``seed`` and token ids: 64-bit).

The request and error models here are also what ``/openapi.json`` publishes (`openapi_components`),
so schema-driven clients and fuzzers see the same rules the server applies.
"""

from __future__ import annotations

import json
import time
import uuid
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.json_schema import models_json_schema
from starlette.responses import JSONResponse


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's OpenAI server: the range of ``seed``
MAX_JSON_DEPTH = 32  # the deepest valid request nests 5 levels (body, messages, [i], content, [j])

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Req(BaseModel):
    # allow_inf_nan=False: NaN, Infinity and 1e400 (which JSON decoding makes infinite) are 400s
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


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


def _is_empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


# Fields accepted only with the value that asks for nothing: field -> (test, what is accepted).
_NO_OP_COMMON: dict[str, tuple[Any, str]] = {
    "logit_bias": (_is_empty, "null or {}"),
    "use_beam_search": (lambda v: v in (None, False), "false"),
    "best_of": (lambda v: v is None or (v == 1 and type(v) is int), "1"),
    "prompt_logprobs": (lambda v: v is None, "null"),
    "priority": (lambda v: v is None or (v == 0 and type(v) is int), "0"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "'auto' or 'default'"),
    "store": (lambda v: v in (None, False), "false"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "{'type': 'text'}"),
    "add_special_tokens": (lambda v: v in (None, False), "false"),
}
_NO_OP_CHAT: dict[str, tuple[Any, str]] = {
    "logprobs": (lambda v: v in (None, False), "false"),
    "top_logprobs": (lambda v: v is None or (v == 0 and type(v) is int), "0"),
    "tools": (_is_empty, "[]"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "'none' or 'auto' (no tools)"),
    # Only meaningful with tools, and tools must be empty: any boolean asks for nothing.
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "functions": (_is_empty, "[]"),
    "function_call": (lambda v: v in (None, "none", "auto"), "'none' or 'auto'"),
    "modalities": (lambda v: v is None or v == ["text"], "['text']"),
    "echo": (lambda v: v in (None, False), "false"),
    "add_generation_prompt": (lambda v: v in (None, True), "true"),
    "continue_final_message": (lambda v: v in (None, False), "false"),
}
_NO_OP_COMPLETION: dict[str, tuple[Any, str]] = {
    "logprobs": (lambda v: v is None or (v == 0 and type(v) is int), "null or 0"),
    "suffix": (lambda v: v in (None, ""), "null"),
}


def _check_no_op(table: dict[str, tuple[Any, str]], v: Any, info: ValidationInfo) -> Any:
    ok, accepted = table[info.field_name]  # type: ignore[index]
    if not ok(v):
        raise ValueError(f"not supported by this server: only {accepted} is accepted (the value that asks for nothing)")
    return v


def _check_min_max(min_tokens: int | None, max_tokens: int | None, max_name: str) -> None:
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise ValueError(f"min_tokens={min_tokens} exceeds {max_name}={max_tokens}")


class _Sampling(_Req):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX,
                             description="64-bit, as vLLM's OpenAI server accepts")
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # vLLM's sampling extensions (same names, meanings and ranges as its SamplingParams);
    # None leaves vLLM's default. Ranges are checked here so the 400 names the field.
    ignore_eos: bool = Field(default=False, description="vLLM extension: generate past end-of-sequence")
    min_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX, description="vLLM: tokens to generate before EOS/stop may end it")
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX, description="vLLM: sample from the k likeliest tokens; 0 or -1: all")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="vLLM: minimum probability relative to the likeliest")
    repetition_penalty: float | None = Field(default=None, gt=0.0, description="vLLM: > 1 discourages repeats")
    stop_token_ids: list[TokenId] | None = Field(default=None, description="vLLM: token ids that end the completion")
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = Field(default=None, description="vLLM: words never generated")
    allowed_token_ids: list[TokenId] | None = Field(default=None, description="vLLM: only these token ids")
    # Accepted only with their no-op value (see _NO_OP_COMMON).
    logit_bias: Any = None
    use_beam_search: Any = None
    best_of: Any = None
    prompt_logprobs: Any = None
    priority: Any = None
    service_tier: Any = None
    store: Any = None
    response_format: Any = None
    add_special_tokens: Any = None
    metadata: dict[str, str] | None = None  # informational only: accepted, not used

    @field_validator(*_NO_OP_COMMON)
    @classmethod
    def _common_no_op(cls, v: Any, info: ValidationInfo) -> Any:
        return _check_no_op(_NO_OP_COMMON, v, info)

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, v: int | None, info: ValidationInfo) -> int | None:
        _check_min_max(v, info.data.get("max_tokens"), "max_tokens")
        return v

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
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    # Accepted only with their no-op value (see _NO_OP_CHAT).
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    echo: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None

    @field_validator(*_NO_OP_CHAT)
    @classmethod
    def _chat_no_op(cls, v: Any, info: ValidationInfo) -> Any:
        return _check_no_op(_NO_OP_CHAT, v, info)

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_above_min(cls, v: int | None, info: ValidationInfo) -> int | None:
        _check_min_max(info.data.get("min_tokens"), v, "max_completion_tokens")
        return v


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    # Accepted only with their no-op value (see _NO_OP_COMPLETION).
    logprobs: Any = None
    suffix: Any = None

    @field_validator(*_NO_OP_COMPLETION)
    @classmethod
    def _completion_no_op(cls, v: Any, info: ValidationInfo) -> Any:
        return _check_no_op(_NO_OP_COMPLETION, v, info)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError(f"exactly one prompt is supported, got a list of {len(v)}")
        return v

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str = Field(min_length=1, description="what is wrong; a 400 names the field first")
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, "
                      "not_found_error, rate_limit_error, service_unavailable or server_error")
    param: str | None = Field(default=None, description="the field at fault, dotted (messages.0.content)")
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body: OpenAI's error shape."""

    error: ErrorDetail


def request_schemas(models: list[type[BaseModel]]) -> dict[str, Any]:
    """JSON schemas of ``models`` (as validated: what a client may send) and every model they
    use, keyed by name, their references pointing into an OpenAPI document's components."""
    _, doc = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    return dict(doc.get("$defs", {}))


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RequestError(Exception):
    """An error bound for the client: HTTP status, message, offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        # the message and field may quote the client's text: escaped where UTF-8 cannot hold it
        # (a lone surrogate in a key), so the response itself can always be encoded
        message, param = _encodable(message), None if param is None else _encodable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, extra_headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(extra_headers or {})})


def body_too_large(size: int, max_body_bytes: int) -> RequestError:
    return RequestError(413, f"request body is {size} bytes; the limit is {max_body_bytes} (max_body_bytes)", None)


# a JSON string, unrolled ("normal* (escape normal*)*"): linear and C-fast on a 1 MiB string
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_KEY_FOLLOWS = re.compile(rb"\s*:")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
LOCATE_DEPTH_UP_TO = 64 * 1024  # bytes: a deeper body of at most this size gets its field named


def json_depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays and objects deeper than ``max_depth``.

    Read on the bytes, before any parser recurses, at C speed: strings are cut out (a bracket
    inside one does not nest) and only the brackets kept; then each round removes every
    innermost ``[]`` and ``{}`` pair, one level everywhere (a pair that becomes adjacent is left
    for the next round). If a pair is still there after ``max_depth`` rounds, something nests
    deeper. Text that is not valid JSON may get either answer; the parser then refuses it anyway.
    """
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False  # too few openers to nest that deep, strings or not: most bodies stop here
    left = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    for _ in range(max_depth):
        # "x" marks a removed pair, so a pair it makes adjacent waits for the next round
        shorter = left.replace(b"[]", b"x").replace(b"{}", b"x").replace(b"x", b"")
        if len(shorter) == len(left):
            return False  # nothing (more) nests: gone, or brackets that do not pair (not JSON)
        left = shorter
    return b"[]" in left or b"{}" in left


def json_deep_field(raw: bytes, max_depth: int) -> tuple[int, str | None] | None:
    """Where ``raw`` first nests deeper than ``max_depth``: (byte offset, the top-level key it is
    under, if any). A walk in Python over every bracket: call it only on small bodies."""
    depth, key = 0, None
    for m in _JSON_TOKEN.finditer(raw):
        token = m.group()
        if token[0] == 0x22:  # a string: at depth 1 and followed by ':', a top-level key
            if depth == 1 and _KEY_FOLLOWS.match(raw, m.end()):
                key = token[1:-1].decode("utf-8", "replace")
        elif token in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return m.start(), key
        else:
            depth -= 1
    return None


def decode_json(raw: bytes) -> Any:
    """The JSON document in ``raw``, or a 400 that says what is wrong with it."""
    if json_depth_exceeds(raw, MAX_JSON_DEPTH):
        where = json_deep_field(raw, MAX_JSON_DEPTH) if len(raw) <= LOCATE_DEPTH_UP_TO else None
        at, key = where if where is not None else (None, None)
        raise RequestError(400, f"{key or 'body'}: nested deeper than {MAX_JSON_DEPTH} levels"
                           + (f" (at byte {at})" if at is not None else "")
                           + "; no request field nests that deep", key)
    try:
        return json.loads(raw)
    except UnicodeDecodeError as err:
        raise RequestError(400, f"request body is not valid UTF-8: {err.reason} at byte {err.start}", None) from None
    except RecursionError:  # nested past Python's own limit, and not valid JSON either
        raise RequestError(400, f"body: nested deeper than {MAX_JSON_DEPTH} levels", None) from None
    except (json.JSONDecodeError, ValueError) as err:
        # ValueError: e.g. an integer literal too long for int() (Python's digit limit)
        raise RequestError(400, f"request body is not valid JSON: {type(err).__name__}: {err}", None) from None


def parse_body(raw: bytes, schema: type[_Req], max_body_bytes: int) -> Any:
    """Size check, JSON decode and schema validation, each failure a `RequestError`."""
    if len(raw) > max_body_bytes:
        raise body_too_large(len(raw), max_body_bytes)
    doc = decode_json(raw)
    if not isinstance(doc, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(doc).__name__}", None)
    bad = _unencodable(doc, "")
    if bad is not None:
        # JSON may escape a lone surrogate (\ud800); no tokenizer, file or log can take it
        raise RequestError(400, f"{bad or 'body'}: text is not valid Unicode (a lone surrogate?)", bad or None)
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
        shown = repr(got)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."  # a 1 MiB value is not echoed whole
        detail = f" (got {shown})" if first["type"] not in ("missing",) and not isinstance(got, (dict, list)) else ""
        raise RequestError(400, f"{param}: {msg}{detail}", param) from None


def _unencodable(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) in ``value`` that UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if _unencodable(k, sub) is not None:
                return sub
            found = _unencodable(v, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _unencodable(v, f"{path}.{i}")
            if found is not None:
                return found
    return None


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
