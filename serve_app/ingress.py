"""The HTTP face: an OpenAI-compatible FastAPI ingress in front of the vLLM deployment.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (whole or SSE streamed, ending
with ``data: [DONE]``), ``GET /v1/models``, ``GET /healthz``.

Errors use OpenAI's error JSON; each names the offending field: 400 invalid field or malformed
JSON, 404 unknown model, 413 oversized body, 503 (with ``Retry-After``) when the model is
unavailable or its bounded queue is full. Rejecting at once is the point: an unbounded queue
turns overload into multi-second waits for everyone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app.openai_api import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    chat_chunk,
    chat_completion,
    new_id,
    parse_body,
    sse,
    text_chunk,
    text_completion,
    usage,
)

logger = logging.getLogger("ray.serve")


class IngressLimits(BaseModel):
    """Request limits enforced before any work is queued."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="largest request body accepted")
    max_tokens_limit: int = Field(default=512, ge=1, description="largest max_tokens a client may ask for")
    default_max_tokens: int = Field(default=64, ge=1, description="max_tokens when the client gives none")
    max_prompt_chars: int = Field(default=32_000, ge=1, description="longest prompt text, before tokenizing")
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After sent with 503s")


api = FastAPI(title="Brownout", description="OpenAI-compatible LLM serving with graceful degradation")


def _unavailable(limits: IngressLimits, why: str) -> RequestError:
    return RequestError(503, why, None, kind="service_unavailable",
                        headers={"Retry-After": str(limits.retry_after_s)})


def _model_error(record: dict[str, Any]) -> RequestError:
    return RequestError(record["status"], record["message"], record.get("param"), record.get("kind", "invalid_request_error"))


async def _model_call(awaitable: Any, limits: IngressLimits) -> dict[str, Any]:
    """Await one model record, mapping Serve's refusals to 503s and error records to theirs."""
    try:
        record = await awaitable
    except BackPressureError:
        raise _unavailable(limits, "the model's queue is full; retry later") from None
    except DeploymentUnavailableError:
        raise _unavailable(limits, "the model is not available; retry later") from None
    if record["type"] == "error":
        raise _model_error(record)
    return record


@serve.ingress(api)
class Ingress:
    """Validates OpenAI requests, calls the model deployment, shapes OpenAI responses."""

    def __init__(self, model: Any, served_model_name: str, limits: dict[str, Any] | None = None) -> None:
        self.model = model
        self.served_model_name = served_model_name
        self.limits = IngressLimits.model_validate(limits or {})
        self.created = int(time.time())

    # -- helpers -------------------------------------------------------------------------------

    async def _parse(self, request: Request, schema: type) -> Any:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise RequestError(413, f"request body is {length} bytes; the limit is "
                               f"{self.limits.max_body_bytes} (max_body_bytes)", None)
        body = parse_body(await request.body(), schema, self.limits.max_body_bytes)
        if body.model != self.served_model_name:
            raise RequestError(404, f"model {body.model!r} does not exist; available: "
                               f"{self.served_model_name!r}", "model", kind="not_found_error")
        return body

    def _max_tokens(self, requested: int | None, field: str) -> int:
        if requested is None:
            return self.limits.default_max_tokens
        if requested > self.limits.max_tokens_limit:
            raise RequestError(400, f"{field}={requested} exceeds the limit of "
                               f"{self.limits.max_tokens_limit} (max_tokens_limit)", field)
        return requested

    def _model_request(self, body: Any, *, messages: list[dict[str, str]] | None = None,
                       prompt: str | None = None, max_tokens: int) -> dict[str, Any]:
        text = prompt if prompt is not None else "".join(m["content"] for m in messages or [])
        if len(text) > self.limits.max_prompt_chars:
            field = "prompt" if prompt is not None else "messages"
            raise RequestError(400, f"{field} is {len(text)} characters; the limit is "
                               f"{self.limits.max_prompt_chars} (max_prompt_chars)", field)
        req: dict[str, Any] = {
            "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "stop": body.stop, "seed": body.seed, "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty, "ignore_eos": body.ignore_eos,
        }
        if prompt is not None:
            req["prompt"] = prompt
        else:
            req["messages"] = messages
        return req

    async def _stream(self, req: dict[str, Any]) -> Any:
        """Start the model stream; its ``start`` record consumed, the deltas to come."""
        gen = self.model.options(stream=True).generate_stream.remote(req)
        await _model_call(gen.__anext__(), self.limits)
        return gen

    async def _whole(self, req: dict[str, Any]) -> dict[str, Any]:
        return await _model_call(self.model.generate.remote(req), self.limits)

    # -- routes --------------------------------------------------------------------------------

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        try:
            body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
            field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            max_tokens = self._max_tokens(body.max_completion_tokens or body.max_tokens, field)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            req = self._model_request(body, messages=messages, max_tokens=max_tokens)
            if body.stream:
                gen = await self._stream(req)
            else:
                result = await self._whole(req)
        except RequestError as err:
            return err.response()
        rid = new_id("chatcmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._chat_sse(gen, rid, include_usage), media_type="text/event-stream")
        return JSONResponse(chat_completion(rid, self.served_model_name, result["text"], result["finish_reason"],
                                            result["prompt_tokens"], result["completion_tokens"]))

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        try:
            body: CompletionRequest = await self._parse(request, CompletionRequest)
            max_tokens = self._max_tokens(body.max_tokens, "max_tokens")
            prompt = body.prompt_text()
            req = self._model_request(body, prompt=prompt, max_tokens=max_tokens)
            if body.stream:
                gen = await self._stream(req)
            else:
                result = await self._whole(req)
        except RequestError as err:
            return err.response()
        rid = new_id("cmpl")
        prefix = prompt if body.echo else ""
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._text_sse(gen, rid, prefix, include_usage), media_type="text/event-stream")
        return JSONResponse(text_completion(rid, self.served_model_name, prefix + result["text"],
                                            result["finish_reason"], result["prompt_tokens"],
                                            result["completion_tokens"]))

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model",
                                            "created": self.created, "owned_by": "brownout"}]}

    @api.get("/healthz")
    async def healthz(self) -> Response:
        try:
            stats = await asyncio.wait_for(self.model.stats.remote(), timeout=5.0)
        except Exception as err:  # noqa: BLE001 - any failure means "not healthy"
            return _unavailable(self.limits, f"model unreachable: {type(err).__name__}").response()
        return JSONResponse({"status": "ok", "model": self.served_model_name, "engine": stats})

    # -- streaming bodies ----------------------------------------------------------------------

    async def _chat_sse(self, gen: Any, rid: str, include_usage: bool) -> AsyncIterator[bytes]:
        created, model = int(time.time()), self.served_model_name
        yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        last = None
        try:
            async for record in gen:
                last = record
                yield sse(chat_chunk(rid, model, created, {"content": record["text"]} if record["text"] else {},
                                     record["finish_reason"]))
        except Exception as err:  # noqa: BLE001 - headers are sent; report in-band
            logger.warning("stream %s failed: %r", rid, err)
            yield sse(RequestError(500, "generation failed", None, kind="server_error").body())
        if include_usage and last is not None:
            yield sse({**chat_chunk(rid, model, created, {}), "choices": [],
                       "usage": usage(last["prompt_tokens"], last["completion_tokens"])})
        yield SSE_DONE

    async def _text_sse(self, gen: Any, rid: str, prefix: str, include_usage: bool) -> AsyncIterator[bytes]:
        created, model = int(time.time()), self.served_model_name
        if prefix:
            yield sse(text_chunk(rid, model, created, prefix))
        last = None
        try:
            async for record in gen:
                last = record
                yield sse(text_chunk(rid, model, created, record["text"], record["finish_reason"]))
        except Exception as err:  # noqa: BLE001
            logger.warning("stream %s failed: %r", rid, err)
            yield sse(RequestError(500, "generation failed", None, kind="server_error").body())
        if include_usage and last is not None:
            yield sse({**text_chunk(rid, model, created, ""), "choices": [],
                       "usage": usage(last["prompt_tokens"], last["completion_tokens"])})
        yield SSE_DONE
