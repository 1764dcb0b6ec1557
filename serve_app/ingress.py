"""The HTTP face: an OpenAI-compatible FastAPI ingress in front of the vLLM deployment.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (whole or SSE streamed, ending
with ``data: [DONE]``), ``GET /v1/models``, ``GET /healthz``, and the admin API under
``/admin/brownout`` (state, history, overrides, policy).

Errors use OpenAI's error JSON; each names the offending field: 400 invalid field or malformed
JSON, 404 unknown model, 413 oversized body, 503 (with ``Retry-After``) when the model is
unavailable or its bounded queue is full. Rejecting at once is the point: an unbounded queue
turns overload into multi-second waits for everyone.

Optional work runs through `serve_app.pipeline.Pipeline`, gated by a `PolicyView` that a
background task refreshes from the policy actor every ``refresh_s``; no request ever waits on
the actor. Features whose worker runs in the ingress process (`Worker.host` None) are built
here; the others are reached through one handle per enrichment deployment. Every response
carries ``X-Brownout-Level`` and ``X-Brownout-Bypassed``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.metrics import Counter as ServeCounter
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from deployments.engine import SAMPLING_KEYS
from deployments.enrichments.base import Enrichment, Outcome, run_calls
from deployments.enrichments.feature import ANONYMOUS, RequestState
from deployments.enrichments.registry import features as feature_impls
from deployments.enrichments.registry import workers
from deployments.enrichments.spool import DurableSpool
from deployments.model import Completion, ModelError
from deployments.reporting import ActorLink, PeriodicTask, replica_source, signal_reporter
from deployments.window import SlidingWindow
from policies.admission import CRITICALITY_HEADER, Criticality
from policies.config import DegradationConfig, PolicyError, parse_policy
from policies.features import PolicyView
from policies.shaping import NO_SHAPING, REQUEST_FIELDS, SHAPED_HEADER, TOKEN_CAP_FIELDS, ShapingPlan, shape
from policies.slo import fit_policy
from serve_app.admission import AdmissionGate, Ticket
from serve_app.breaker import BreakerSettings
from serve_app.openai_api import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    body_too_large,
    chat_chunk,
    chat_completion,
    new_id,
    parse_body,
    sse,
    text_chunk,
    text_completion,
    usage,
)
from serve_app.pipeline import BatchCall, Pipeline
from serve_app.security import AdminGuard, AuthSettings, KeyRecord, KeyStore, RateLimits, read_body

logger = logging.getLogger("ray.serve")

MODEL = "VLLMModel"  # the model deployment, as counted in handle_calls

SAMPLING_FIELDS = SAMPLING_KEYS  # request fields passed to vLLM: one list, in deployments/engine.py


class IngressLimits(BaseModel):
    """Request limits enforced before any work is queued."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="largest request body accepted")
    max_tokens_limit: int = Field(default=512, ge=1, description="largest max_tokens a client may ask for")
    default_max_tokens: int = Field(default=64, ge=1, description="max_tokens when the client gives none")
    max_prompt_chars: int = Field(default=32_000, ge=1, description="longest prompt text, before tokenizing")
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After sent with 503s")

    @model_validator(mode="after")
    def _default_within_limit(self) -> IngressLimits:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} exceeds "
                             f"max_tokens_limit={self.max_tokens_limit}")
        return self


class PipelineSettings(BaseModel):
    """How the ingress runs optional stages and talks to the policy actor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage_timeout_s: float = Field(default=1.0, gt=0, description="timeout of one enrichment call")
    stage_timeouts_s: dict[str, float] = Field(default_factory=dict, description="per-feature timeouts")
    refresh_s: float = Field(default=0.25, gt=0, description="how often the level is refreshed")
    report_s: float = Field(default=0.25, gt=0, description="how often signals are reported")
    drain_s: float = Field(default=1.0, gt=0, description="how often deferred records are drained")
    breaker: BreakerSettings = Field(default_factory=BreakerSettings,
                                     description="each feature's circuit breaker (serve_app/breaker.py)")


class OverrideBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: int | None = Field(default=None, ge=0, le=3)
    feature: str | None = None
    enabled: bool | None = None
    # required and finite: a pin or override that never expires is a clear operator mistake
    ttl_s: float = Field(gt=0, allow_inf_nan=False, description="seconds; at most auth.max_override_ttl_s")
    note: str = Field(default="", max_length=500)


api = FastAPI(title="Brownout", description="OpenAI-compatible LLM serving with graceful degradation")


def _unavailable(limits: IngressLimits, why: str) -> RequestError:
    return RequestError(503, why, None, kind="service_unavailable",
                        headers={"Retry-After": str(limits.retry_after_s)})


async def _model_call(awaitable: Any, limits: IngressLimits) -> Any:
    """Await one model event, mapping Serve's refusals to 503s and a `ModelError` to its status."""
    try:
        event = await awaitable
    except BackPressureError:
        raise _unavailable(limits, "the model's queue is full; retry later") from None
    except DeploymentUnavailableError:
        raise _unavailable(limits, "the model is not available; retry later") from None
    if isinstance(event, ModelError):
        raise RequestError(event.status, event.message, event.param, event.kind)
    return event


def _key_text(messages: list[dict[str, str]] | None, prompt: str | None) -> str:
    """The semantic-cache key: the client's own request text, before any enrichment."""
    if messages is None:
        return prompt or ""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _batch_caller(handles: Mapping[str, Any], local: Mapping[str, Enrichment]) -> BatchCall:
    """Host None: the workers in this process, no RPC; else one handle call to that deployment."""

    async def call(host: str | None, calls: list[tuple[str, dict[str, Any]]]) -> list[Outcome]:
        if host is None:
            return await run_calls(local, calls)
        return await handles[host].call_many.remote(calls)

    return call


def _request_id() -> str:
    """Serve's own request id (the proxy's x-request-id), so logs and records share one id."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or uuid.uuid4().hex
    except Exception:  # noqa: BLE001 - outside Serve
        return uuid.uuid4().hex


def _replica_rank() -> int:
    try:
        return int(serve.get_replica_context().rank.rank)
    except Exception:  # noqa: BLE001 - outside a replica
        return 0


class _ReleasingStream:
    """An SSE body that calls ``on_end`` however it ends: exhausted, failed, closed by a client
    that went away, or dropped without ever being started (a client gone before the first byte:
    an async generator that never ran has no ``finally`` to run). ``on_end`` must be idempotent."""

    def __init__(self, body: AsyncIterator[bytes], on_end: Callable[[], None]) -> None:
        self._body, self._on_end = body, on_end

    def __aiter__(self) -> _ReleasingStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._body.__anext__()
        except BaseException:  # StopAsyncIteration included
            self._on_end()
            raise

    async def aclose(self) -> None:
        self._on_end()
        await self._body.aclose()  # type: ignore[attr-defined]

    def __del__(self) -> None:
        self._on_end()


# Helpers the routes call are defined above: @serve.ingress pickles the app at decoration.
@serve.ingress(api)
class Ingress:
    """Validates OpenAI requests, runs the pipeline around the model, shapes OpenAI responses."""

    async def __init__(
        self,
        model: Any,
        served_model_name: str,
        limits: IngressLimits | dict[str, Any] | None = None,
        enrichments: Mapping[str, Any] | None = None,
        local_workers: Mapping[str, Mapping[str, Any]] | None = None,
        pipeline: PipelineSettings | dict[str, Any] | None = None,
        spool_dir: str | None = None,
        auth: AuthSettings | dict[str, Any] | None = None,
        policy_link: ActorLink | None = None,
        model_slots: int = 16,
    ) -> None:
        self.model = model
        self.model_slots = model_slots  # the engine's batch (max_num_seqs): admission and derived levels
        self.served_model_name = served_model_name
        # the builder passes validated models (kept as they are); a dict is validated here
        self.limits = IngressLimits.model_validate(limits or {})
        self.settings = PipelineSettings.model_validate(pipeline or {})
        self.created = int(time.time())
        # The core path's guards (`serve_app.security`): never switched off by a level.
        self.auth = AuthSettings.model_validate(auth if auth is not None else {})
        self.keys = KeyStore(self.auth.keys_file) if self.auth.api_keys == "required" else None
        self.rates = RateLimits(self.auth.default_rate)
        self.admin_guard = AdminGuard(self.auth.admin_token_file)
        self.largest_refused_read = 0  # bytes: the most of an over-limit body this replica read
        auth_refusals = ServeCounter("brownout_auth_refusals", "Requests refused by the core path's guards",
                                     tag_keys=("reason",))
        self._auth_refused = lambda reason: auth_refusals.inc(tags={"reason": reason})
        handles = dict(enrichments or {})
        local_settings = {k: dict(v) for k, v in (local_workers or {}).items()}
        # The features this app runs: hosted ones whose deployment was bound, and the ingress's own.
        features = [f for f in feature_impls()
                    if (f.host in handles if f.host is not None else f.worker.kind in local_settings)]
        kinds = workers(features)
        self.local = {k: kinds[k].build(s) for k, s in local_settings.items() if k in kinds}
        by_feature = {f.name: self.local[f.worker.kind] for f in features if f.host is None}
        source = replica_source("Ingress")
        spool_root = Path(spool_dir).expanduser() if spool_dir else None
        rank = _replica_rank()
        outcomes = ServeCounter("brownout_stage_outcomes", "Optional stages not run as asked, by outcome",
                                tag_keys=("feature", "outcome"))
        self.pipeline = Pipeline(
            features,
            _batch_caller(handles, by_feature),
            (lambda feature: DurableSpool(spool_root, f"{feature}-ingress{rank}")) if spool_root else None,
            timeouts_s=self.settings.stage_timeouts_s,
            default_timeout_s=self.settings.stage_timeout_s,
            settings=local_settings,
            on_outcome=lambda feature, outcome: outcomes.inc(tags={"feature": feature, "outcome": outcome}),
            breaker=self.settings.breaker,
        )
        self.view = PolicyView.all_on()
        self.view_fetched_at = 0.0
        self.enrichment_handles = handles
        if policy_link is None:
            from policies.actor import get_or_create_policy_actor

            policy_link = ActorLink(get_or_create_policy_actor)
        self.policy = policy_link
        self.inflight = 0
        self.latency_ms = SlidingWindow(time.monotonic, 30.0, 4096)
        self.last_policy_error: str | None = None
        refusals = ServeCounter("brownout_admission_refusals", "Requests refused at the door, by class and reason",
                                tag_keys=("criticality", "reason"))
        self.gate = AdmissionGate(model_slots, on_refusal=lambda c, reason: refusals.inc(
            tags={"criticality": c.value, "reason": reason}))
        self.shaping: ShapingPlan = NO_SHAPING
        self.policy_version = -1  # the actor's config_version that admission and shaping follow
        self.tasks = [
            PeriodicTask("refresh-level", self._refresh, self.settings.refresh_s),
            signal_reporter(self.policy, source, self._signals, self.settings.report_s),
            PeriodicTask("drain-deferred", self._drain, self.settings.drain_s),
        ]
        for task in self.tasks:
            task.start()

    # -- background ----------------------------------------------------------------------------

    async def _refresh(self) -> None:
        view = await self.policy.call("view")
        if not isinstance(view, PolicyView):
            raise TypeError(f"the policy actor sent {type(view).__name__}, not a PolicyView")
        if view.config_version != self.policy_version:
            # The actor's policy is the one source of truth: a `serve deploy`, an operator's
            # update_config or a restored copy all reach admission and shaping this way.
            doc = await self.policy.call("get_config")
            self._apply_policy(parse_policy(doc["config"]))
            self.policy_version = doc["config_version"]
        self.view, self.view_fetched_at = view, time.time()
        self.gate.set_level(int(view.level))  # admission uses the service model measured at this level

    def _signals(self) -> dict[str, float]:
        out: dict[str, float] = {"inflight": self.inflight, **self.gate.signals()}
        p95, mean = self.latency_ms.percentile(95), self.latency_ms.mean()
        if p95 is not None:
            out["p95_latency_ms"] = p95
        if mean is not None:
            out["avg_latency_ms"] = mean
        return out

    async def _drain(self) -> None:
        view = self.view
        for feature in self.pipeline.deferrable(view.modes):
            if feature in view.enabled:
                await self.pipeline.drain(feature)
            else:
                self.pipeline.spool(feature)  # open it, so records from a previous replica count

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """serve deploy with a new ``user_config``: validate the policy, push it to the actor.

        Idempotent (Serve may call it twice). An invalid policy is logged with the key and
        value at fault and not pushed: the running policy stays in force.
        """
        doc = (user_config or {}).get("policy")
        if doc is None:
            return
        try:
            # validated here too, so a bad one is reported by the replica that was given it;
            # an `slo` section gets the level triggers it implies for this engine's batch
            fit_policy(parse_policy(doc), self.model_slots)
        except PolicyError as err:
            self.last_policy_error = str(err)
            logger.error("brownout: rejected policy from user_config, running policy kept: %s", err)
            return
        # origin "deploy": applied only if this document changed since the last deploy, so a
        # replica restart or scale-up re-sending it does not undo an operator's change
        result = await self.policy.call("update_config", doc, self.model_slots, "deploy")
        self.last_policy_error = None if result.get("ok") else result.get("error")
        logger.info("brownout: policy from user_config: %s", result)

    def _apply_policy(self, config: DegradationConfig) -> None:
        """The parts of the policy the ingress enforces itself, per request: admission, shaping."""
        self.gate.configure(config)
        self.shaping = ShapingPlan.from_config(config)

    # -- request helpers -----------------------------------------------------------------------

    async def _parse(self, request: Request, schema: type) -> Any:
        try:
            raw = await read_body(request, self.limits.max_body_bytes, self.auth.body_read_timeout_s)
        except RequestError as err:
            # how much of a refused body was ever read here (it must stay near the limit)
            self.largest_refused_read = max(self.largest_refused_read, getattr(err, "bytes_read", 0))
            raise
        body = parse_body(raw, schema, self.limits.max_body_bytes)
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

    def _authenticate(self, request: Request) -> KeyRecord | None:
        """The request's API key record (None when keys are disabled by config), or a 401."""
        if self.keys is None:
            return None
        try:
            return self.keys.authenticate(request.headers.get("authorization"))
        except RequestError:
            self._auth_refused("invalid_key")
            raise

    def _rate_limit(self, key: KeyRecord, ctx: RequestState, body: Any) -> None:
        """Charge one request and its completion tokens (max_tokens as shaped, times n) to the key."""
        tokens = int(ctx.sampling.get("max_tokens") or 0) * max(1, int(getattr(body, "n", None) or 1))
        check = self.rates.check(key, tokens)
        if check.retry_after_s is not None:
            self._auth_refused("rate_limited")
            raise RequestError(429, f"rate limit of API key {key.id!r} reached; retry in {check.retry_after_s} s",
                               None, kind="rate_limit_error", code="rate_limit_exceeded",
                               headers={**check.headers, "Retry-After": str(check.retry_after_s)})
        ctx.headers_out.update(check.headers)

    def _context(self, body: Any, messages: list[dict[str, str]] | None, prompt: str | None,
                 max_tokens: int, tenant: str = "anonymous") -> RequestState:
        text = prompt if prompt is not None else "".join(m["content"] for m in messages or [])
        if len(text) > self.limits.max_prompt_chars:
            field = "prompt" if prompt is not None else "messages"
            raise RequestError(400, f"{field} is {len(text)} characters; the limit is "
                               f"{self.limits.max_prompt_chars} (max_prompt_chars)", field)
        sampling = {k: getattr(body, k) for k in SAMPLING_FIELDS}
        sampling["max_tokens"] = max_tokens
        return RequestState(
            # the engine's id is ours alone: a client's X-Request-ID (Serve's request id) is only
            # echoed and logged, so no client can name, and abort, another's request
            request_id=uuid.uuid4().hex, client_request_id=_request_id(), tenant=tenant,
            model=self.served_model_name,
            user=body.user, messages=messages, prompt=prompt,
            sampling=sampling, explicit=frozenset(body.model_fields_set) & set(SAMPLING_FIELDS),
            view=self.view, key_text=_key_text(messages, prompt),
        )

    def _shape(self, body: Any, ctx: RequestState, field: str, max_tokens: int) -> None:
        """Level-driven shaping (`policies.shaping`): cap tokens, refuse costly fields, say so."""
        fields = {n: getattr(body, n, None) for n in REQUEST_FIELDS if n not in TOKEN_CAP_FIELDS}
        fields[field] = max_tokens
        shaped = shape(self.shaping, self.view.level, fields)
        if shaped.refusal is not None:
            r = shaped.refusal
            raise RequestError(r.status, r.message, r.field, code=r.code,
                               headers={SHAPED_HEADER: f"{r.field}=refused"})
        if shaped.header is not None:
            ctx.sampling = shaped.apply_to(ctx.sampling)
            ctx.headers_out[SHAPED_HEADER] = shaped.header

    def _model_request(self, ctx: RequestState, ticket: Ticket) -> dict[str, Any]:
        req = dict(ctx.sampling, request_id=ctx.request_id, priority=ticket.priority,
                   deadline_at=ticket.deadline_at)
        if ctx.messages is not None:
            req["messages"] = ctx.messages
        else:
            req["prompt"] = ctx.prompt
        return req

    async def _serve(self, ctx: RequestState, ticket: Ticket, stream: bool, include_usage: bool, chat: bool,
                     echo_prefix: str = "", on_stream_end: Callable[[], None] = lambda: None) -> Response:
        """The whole request after admission: pre stages, model (or cache), post, side effects.

        The ticket is released when the model is done with the request: here for a whole
        response, at the end of the stream for a streamed one (`_sse`), which then also calls
        ``on_stream_end`` (idempotent) however the stream ends.
        """
        await self.pipeline.pre(ctx)
        rid = new_id("chatcmpl" if chat else "cmpl")
        if ctx.answer is not None:  # a pre stage answered: the model is not called
            prompt_tokens, completion_tokens = ctx.answer_usage
            result = Completion(text=ctx.answer, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                finish_reason=ctx.answer_finish)
            gen = None
            self.gate.release(ticket, served=False)
        elif stream:
            self.pipeline.handle_calls[MODEL] += 1
            gen = self.model.options(stream=True).generate_stream.remote(self._model_request(ctx, ticket))
            await self._model_call(gen.__anext__())
        else:
            gen = None
            self.pipeline.handle_calls[MODEL] += 1
            result = await self._model_call(self.model.generate.remote(self._model_request(ctx, ticket)))
            self.gate.release(ticket, served=True)

        if stream:
            self.pipeline.plan_side_effects(ctx)
            body = self._sse(ctx, ticket, gen, rid, chat, include_usage, echo_prefix, on_stream_end)
            return StreamingResponse(body, media_type="text/event-stream", headers=ctx.headers())

        ctx.text = result.text
        await self.pipeline.post(ctx)
        self.pipeline.plan_side_effects(ctx)
        record = ctx.record(result.finish_reason, usage(result.prompt_tokens, result.completion_tokens))
        build = chat_completion if chat else text_completion
        doc = build(rid, self.served_model_name, echo_prefix + ctx.text, result.finish_reason,
                    result.prompt_tokens, result.completion_tokens)
        return JSONResponse(doc, headers=ctx.headers(),
                            background=BackgroundTask(self._after_response, ctx, record))

    async def _after_response(self, ctx: RequestState, record: dict[str, Any]) -> None:
        # async, so Starlette runs it on the event loop (a sync callable would go to a thread)
        self.pipeline.side_effects(ctx, record)

    async def _model_call(self, awaitable: Any) -> Any:
        """`_model_call`, with a computed Retry-After on the model's own 503s (a late drop)."""
        try:
            return await _model_call(awaitable, self.limits)
        except RequestError as err:
            if err.status == 503:
                err.headers["Retry-After"] = str(self.gate.drain_s())
            raise

    def _sse(self, ctx: RequestState, ticket: Ticket, gen: Any, rid: str, chat: bool,
             include_usage: bool, echo_prefix: str, on_end: Callable[[], None]) -> AsyncIterator[bytes]:
        def release(served: bool) -> None:
            self.gate.release(ticket, served)

        def ended() -> None:
            release(False)  # no-op when the body released it already
            on_end()

        return _ReleasingStream(self._sse_body(ctx, gen, rid, chat, include_usage, echo_prefix, release), ended)

    async def _sse_body(self, ctx: RequestState, gen: Any, rid: str, chat: bool, include_usage: bool,
                        echo_prefix: str, release: Callable[[bool], None]) -> AsyncIterator[bytes]:
        created, model = int(time.time()), self.served_model_name
        parts: list[str] = []
        finish: str | None = "stop"
        prompt_tokens = completion_tokens = 0

        def chunk(text: str, finish: str | None) -> bytes:
            if chat:
                return sse(chat_chunk(rid, model, created, {"content": text} if text else {}, finish))
            return sse(text_chunk(rid, model, created, text, finish))

        if chat:
            yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        elif echo_prefix:
            yield chunk(echo_prefix, None)
        try:
            if gen is None:  # answered by a pre stage, sent as one chunk, with its own usage
                parts.append(ctx.answer or "")
                finish = ctx.answer_finish
                prompt_tokens, completion_tokens = ctx.answer_usage
                yield chunk(ctx.answer or "", finish)
            else:
                async for delta in gen:
                    finish, prompt_tokens, completion_tokens = (delta.finish_reason, delta.prompt_tokens,
                                                                delta.completion_tokens)
                    parts.append(delta.text)
                    yield chunk(delta.text, delta.finish_reason)
                release(True)  # the model is done with it: a completion that measures its rate
        except Exception as err:  # noqa: BLE001 - headers are sent; report in-band
            release(False)
            logger.warning("stream %s failed: %s", rid, type(err).__name__)  # no request text in logs
            yield sse(RequestError(500, "generation failed", None, kind="server_error").body())
            return
        if include_usage:
            doc = (chat_chunk(rid, model, created, {}) if chat else text_chunk(rid, model, created, ""))
            yield sse({**doc, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield SSE_DONE
        self.latency_ms.add((time.monotonic() - ctx.started) * 1000.0)
        ctx.text = "".join(parts)
        self.pipeline.side_effects(ctx, ctx.record(finish, usage(prompt_tokens, completion_tokens)))

    async def _handle(self, request: Request, chat: bool) -> Response:
        """Validate, shape, admit (or refuse at once), then serve.

        Order matters: the API key first (a 401 reads no body); then a bad request is a 400
        whatever the load; shaping may refuse a field the level does not serve; the key's rate
        limits charge the request as shaped; admission comes last, before any enrichment or
        model work, so a refusal costs nothing but the parse. No level skips the key or its
        limits.
        """
        started = time.monotonic()
        # `inflight` counts the request until its last byte is out: for a stream, that is when
        # the body ends (exhausted, failed or closed by the client), not when headers are sent.
        self.inflight += 1
        counted = True

        def end_inflight() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.inflight -= 1

        streaming = False
        ticket: Ticket | None = None
        try:
            key = self._authenticate(request)
            tenant = key.tenant if key is not None else ANONYMOUS
            if chat:
                body: Any = await self._parse(request, ChatCompletionRequest)
                field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
                max_tokens = self._max_tokens(body.max_completion_tokens or body.max_tokens, field)
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                ctx = self._context(body, messages, None, max_tokens, tenant)
                echo = ""
            else:
                body = await self._parse(request, CompletionRequest)
                field = "max_tokens"
                max_tokens = self._max_tokens(body.max_tokens, field)
                ctx = self._context(body, None, body.prompt_text(), max_tokens, tenant)
                echo = body.prompt_text() if body.echo else ""
            self._shape(body, ctx, field, max_tokens)
            if key is not None:
                self._rate_limit(key, ctx, body)
            ticket = self.gate.admit(request.headers.get(CRITICALITY_HEADER), base=key.tier if key else None)
            ctx.headers_out[CRITICALITY_HEADER] = ticket.criticality.value
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            response = await self._serve(ctx, ticket, body.stream, include_usage, chat, echo, end_inflight)
            streaming = isinstance(response, StreamingResponse)
            if not body.stream:  # a stream's latency is taken when its last byte is out
                self.latency_ms.add((time.monotonic() - started) * 1000.0)
                self.gate.release(ticket, served=False)  # no-op when _serve released it
            return response
        except RequestError as err:
            if ticket is not None:
                self.gate.release(ticket, served=False)
            return err.response({"X-Brownout-Level": str(int(self.view.level))})
        except BaseException:
            if ticket is not None:
                self.gate.release(ticket, served=False)
            raise
        finally:
            if not streaming:
                end_inflight()

    # -- OpenAI routes -------------------------------------------------------------------------

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._authenticate(request)
        except RequestError as err:
            return err.response()
        return JSONResponse({"object": "list", "data": [{"id": self.served_model_name, "object": "model",
                                                         "created": self.created, "owned_by": "brownout"}]})

    @api.get("/healthz")
    async def healthz(self) -> Response:
        try:
            stats = await self.model.stats.remote()
        except Exception as err:  # noqa: BLE001 - any failure means "not healthy"
            return _unavailable(self.limits, f"model unreachable: {type(err).__name__}").response()
        return JSONResponse({"status": "ok", "model": self.served_model_name, "level": int(self.view.level),
                             "engine": stats})

    # -- admin API -----------------------------------------------------------------------------

    def _admin_check(self, request: Request) -> None:
        """Closed (403) without a configured token; 401 without one sent, 403 for a wrong one."""
        try:
            self.admin_guard.check(request.headers)
        except RequestError as err:
            self._auth_refused(f"admin_{err.status}")
            raise

    async def _admin(self, request: Request, method: str, *args: Any, **kwargs: Any) -> Response:
        try:
            self._admin_check(request)
            result = await self.policy.call(method, *args, **kwargs)
        except RequestError as err:
            return err.response()
        except Exception as err:  # noqa: BLE001 - the actor is down or slow: say so
            return _unavailable(self.limits, f"policy actor unavailable: {type(err).__name__}").response()
        if isinstance(result, dict) and result.get("ok") is False:
            return RequestError(400, result.get("error", "rejected"), None).response()
        return JSONResponse(result)

    @api.get("/admin/brownout")
    async def admin_state(self, request: Request) -> Response:
        response = await self._admin(request, "get_state")
        if response.status_code != 200:
            return response
        state = json.loads(response.body)
        state["ingress"] = {
            "snapshot_level": int(self.view.level), "snapshot_age_s": time.time() - self.view_fetched_at,
            "config_version": self.view.config_version,
            "pipeline": self.pipeline.counters(), "policy_link_failures": self.policy.failures,
            "last_policy_error": self.last_policy_error, "inflight": self.inflight, "pid": os.getpid(),
            "admission": self.gate.state(),
            "largest_refused_body_read": self.largest_refused_read,
        }
        return JSONResponse(state)

    @api.get("/admin/brownout/history")
    async def admin_history(self, request: Request, n: int = 100) -> Response:
        return await self._admin(request, "history", n)

    @api.post("/admin/brownout/override")
    async def admin_override(self, request: Request) -> Response:
        try:
            self._admin_check(request)  # before the body is read
            body = parse_body(await read_body(request, 64 * 1024, self.auth.body_read_timeout_s), OverrideBody,
                              64 * 1024)
            if body.ttl_s > self.auth.max_override_ttl_s:
                raise RequestError(400, f"ttl_s: {body.ttl_s:g} exceeds the maximum of "
                                   f"{self.auth.max_override_ttl_s:g} s (auth.max_override_ttl_s)", "ttl_s")
        except RequestError as err:
            return err.response()
        return await self._admin(request, "set_override", level=body.level, feature=body.feature,
                                 enabled=body.enabled, ttl_s=body.ttl_s, note=body.note)

    @api.delete("/admin/brownout/override")
    async def admin_clear(self, request: Request, level: bool = False, feature: str | None = None) -> Response:
        return await self._admin(request, "clear_override", level=level, feature=feature)

    @api.get("/admin/brownout/enrichments")
    async def admin_enrichments(self, request: Request) -> Response:
        try:
            self._admin_check(request)
        except RequestError as err:
            return err.response()
        # the ingress's own workers first: same shape as EnrichmentHost.stats()
        out: dict[str, Any] = {"Ingress": {
            "pid": os.getpid(),
            "counters": {f: n for w in self.local.values() for f, n in w.counters().items()},
            "enrichments": {kind: w.stats() for kind, w in self.local.items()},
        }}
        for name, handle in self.enrichment_handles.items():
            try:
                out[name] = await handle.stats.remote()
            except Exception as err:  # noqa: BLE001
                out[name] = {"error": repr(err)}
        return JSONResponse(out)

    async def __del__(self) -> None:
        for task in getattr(self, "tasks", []):
            await task.stop()
        if hasattr(self, "pipeline"):
            await self.pipeline.wait_idle()
        for worker in getattr(self, "local", {}).values():
            await worker.close()
