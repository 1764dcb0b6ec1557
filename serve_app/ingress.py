"""The HTTP face: an OpenAI-compatible FastAPI ingress in front of the vLLM deployment.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (whole or SSE streamed, ending
with ``data: [DONE]``), ``GET /v1/models``, ``GET /healthz``, and the admin API under
``/admin/brownout`` (state, history, overrides, policy, ``/features``: each optional feature's
cost and how often it is off, ranked).

Errors use OpenAI's error JSON; each names the offending field: 400 invalid field or malformed
JSON, 404 unknown model, 413 oversized body, 503 (with ``Retry-After``) when the model is
unavailable or its bounded queue is full. Rejecting at once is the point: an unbounded queue
turns overload into multi-second waits for everyone.

No error leaves as a plain-text 500, whatever fails: an infrastructure failure (the model's
engine died, a replica died, a handle call timed out, Serve refused) is a 503 with
``Retry-After`` (`failure_error` maps each); an unknown route or method is OpenAI's 404/405; a
bad query parameter a 400 naming it; anything unforeseen a 500 in OpenAI's JSON, from a route's
own handler or, as a backstop, `OpenAIErrors` (an ASGI middleware around the whole app, which
also puts ``X-Brownout-Level`` on every response). A stream that fails after its headers went out
ends with an OpenAI-shaped ``error`` event and ``data: [DONE]``. While the model is known to be
down (`serve_app.health.ModelHealth`, fed by a probe and by the model calls themselves), new
requests get 503 + ``Retry-After`` at once instead of waiting in Serve's router for a replica
that is still starting; before anything has said so, a request's wait there ends at its deadline
(503 ``expired``, `AdmissionGate.until_reached`), and that expiry, with nothing from the model
for as long, says so (`ModelHealth.observe_expired`).

``/openapi.json`` describes every request body (the OpenAI request models, the admin override)
and every error response (OpenAI's error schema), although the routes read the raw body
themselves: they must, to bound the read (`serve_app.security.read_body`) and name the field in
each 400, so the bodies are declared with ``openapi_extra`` from the same pydantic models the
routes validate with.

Optional work runs through `serve_app.pipeline.Pipeline`, gated by a `PolicyView` that a
background task follows by long-poll (the policy actor's ``watch``: answered as soon as the view
changes); no request ever waits on the actor. Features whose worker runs in the ingress process (`Worker.host` None) are built
here; the others are reached through one handle per enrichment deployment. Every response
carries ``X-Brownout-Level`` and ``X-Brownout-Bypassed``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.metrics import Counter as ServeCounter
from ray.serve.metrics import Gauge as ServeGauge
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.engine import SAMPLING_KEYS
from deployments.enrichments.base import Enrichment, Outcome, run_calls
from deployments.enrichments.feature import ANONYMOUS, DEFERRED_HEADER, RequestState
from deployments.enrichments.registry import features as feature_impls
from deployments.enrichments.registry import workers
from deployments.enrichments.spool import DurableSpool
from deployments.model import Completion, ModelError
from deployments.reporting import ActorLink, PeriodicTask, ReportLink, replica_source, signal_reporter
from deployments.window import SlidingWindow
from policies.admission import CRITICALITY_HEADER, Criticality
from policies.config import DegradationConfig, PolicyError, parse_policy
from policies.feature_cost import merge, rank
from policies.service import start_view
from policies.features import PolicyView
from policies.shaping import (
    NO_SHAPING,
    REQUEST_FIELDS,
    SHAPED_HEADER,
    STREAM_FIELD,
    TOKEN_CAP_FIELDS,
    ShapingPlan,
    shape,
)
from policies.slo import fit_policy
from serve_app.admission import AdmissionGate, Ticket
from serve_app.breaker import BreakerSettings
from serve_app.health import ModelHealth
from serve_app.openai_api import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    RequestError,
    body_too_large,
    chat_chunk,
    chat_completion,
    new_id,
    parse_body,
    request_schemas,
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
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After sent with 503s that predict "
                               "nothing (infrastructure refusing), and the least sent for a model that is down")
    max_retry_after_s: int = Field(default=60, ge=1, description="the most Retry-After sent for a model that "
                                   "is down (the predicted rest of its outage: serve_app/health.py)")

    @model_validator(mode="after")
    def _default_within_limit(self) -> IngressLimits:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} exceeds "
                             f"max_tokens_limit={self.max_tokens_limit}")
        if self.retry_after_s > self.max_retry_after_s:
            raise ValueError(f"retry_after_s={self.retry_after_s} exceeds max_retry_after_s={self.max_retry_after_s}")
        return self


class PipelineSettings(BaseModel):
    """How the ingress runs optional stages and talks to the policy actor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage_timeout_s: float = Field(default=1.0, gt=0, description="timeout of one enrichment call")
    stage_timeouts_s: dict[str, float] = Field(default_factory=dict, description="per-feature timeouts")
    refresh_s: float = Field(default=0.25, gt=0, description="after a failed watch of the policy actor, wait "
                             "this long before the next (the level itself arrives by long-poll, at once)")
    watch_s: float = Field(default=5.0, gt=0, le=30, description="one long-poll of the policy actor's view "
                           "waits at most this long for a change before it answers with the view unchanged")
    report_s: float = Field(default=0.25, gt=0, description="how often signals are reported")
    drain_s: float = Field(default=1.0, gt=0, description="how often deferred records are drained")
    model_probe_s: float = Field(default=0.5, gt=0, description="how often a model replica's engine health and "
                                 "speed are probed (the door predicts with the speed: a starved engine is "
                                 "seen within about this long)")
    model_probe_timeout_s: float = Field(default=2.0, gt=0,
                                         description="a probe not answered by then says nothing (a busy replica)")
    breaker: BreakerSettings = Field(default_factory=BreakerSettings,
                                     description="each feature's circuit breaker (serve_app/breaker.py)")
    start_level: int = Field(default=3, ge=0, le=3, description="the level a replica serves at until it first "
                             "hears from the policy actor (3, the most degraded: it cannot know the load yet)")
    policy_push_retry_s: float = Field(default=2.0, gt=0, description="how often a deployed policy the actor "
                                       "could not take (down, restarting) is sent again")


class OverrideBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: int | None = Field(default=None, ge=0, le=3)
    feature: str | None = None
    enabled: bool | None = None
    # required and finite: a pin or override that never expires is a clear operator mistake
    ttl_s: float = Field(gt=0, allow_inf_nan=False, description="seconds; at most auth.max_override_ttl_s")
    note: str = Field(default="", max_length=500)


CIRCUIT_STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}  # brownout_circuit_state
OUTAGE_SHARE_S = 1.0  # how often an outage seen end here is sent on (no call while there is none)

api = FastAPI(title="Brownout", description="OpenAI-compatible LLM serving with graceful degradation")

LEVEL_HEADER = "X-Brownout-Level"
# This replica's current level, for responses built outside a route (the error backstop). One
# Ingress per replica process sets it; until then (or outside Serve) nothing is known: "unknown".
_level_source: list[Callable[[], int]] = []


def _level() -> str:
    try:
        return str(int(_level_source[-1]())) if _level_source else "unknown"
    except Exception:  # noqa: BLE001 - a header must never fail the response
        return "unknown"


def _unavailable(limits: IngressLimits, why: str, retry_after_s: int | None = None) -> RequestError:
    """503 + ``Retry-After``: ``retry_after_s`` where one is predicted, else ``limits.retry_after_s``."""
    return RequestError(503, why, None, kind="service_unavailable",
                        headers={"Retry-After": str(limits.retry_after_s if retry_after_s is None else retry_after_s)})


def failure_error(err: BaseException, retry_after_s: int = 1) -> RequestError:
    """The client's error for an exception a route did not expect to handle itself.

    Infrastructure that is down or refusing is a 503 + ``Retry-After``: Serve's back-pressure
    and unavailable deployments, a Ray actor (replica) that died or is unreachable, a call that
    timed out. Anything else is our own bug: a 500, in OpenAI's shape still, naming only the
    exception's type (its text may hold request content). ``model_down`` is set on errors that
    say the model itself cannot serve (a replica died, the deployment is unavailable).
    """
    if isinstance(err, RequestError):
        return err
    retry = {"Retry-After": str(retry_after_s)}

    def down(message: str, model_down: bool) -> RequestError:
        out = RequestError(503, message, None, kind="service_unavailable", headers=dict(retry))
        out.model_down = model_down  # type: ignore[attr-defined]
        return out

    if isinstance(err, BackPressureError):
        return down("the model's queue is full; retry later", False)
    if isinstance(err, DeploymentUnavailableError):
        return down("the model is not available; retry later", True)
    if isinstance(err, (RayActorError, ActorUnavailableError)):  # ActorDiedError is a RayActorError
        return down(f"a replica serving this request died or is unreachable ({type(err).__name__}); "
                    "retry later", True)
    if isinstance(err, (asyncio.TimeoutError, TimeoutError, GetTimeoutError)):
        return down("the request timed out inside the service; retry later", False)
    if isinstance(err, RayTaskError):
        cause = err.cause if isinstance(getattr(err, "cause", None), BaseException) else None
        if cause is not None and not isinstance(cause, RayTaskError):
            return failure_error(cause, retry_after_s)
    return RequestError(500, f"internal error ({type(err).__name__}); it has been logged", None,
                        kind="server_error")


def model_event_error(event: ModelError) -> RequestError:
    out = RequestError(event.status, event.message, event.param, event.kind)
    out.model_down = bool(getattr(event, "engine_dead", False))  # type: ignore[attr-defined]
    return out


async def _model_call(awaitable: Any, limits: IngressLimits) -> Any:
    """Await one model event, mapping Serve's refusals and Ray's failures to 503s (`failure_error`)
    and a `ModelError` to its status."""
    try:
        event = await awaitable
    except Exception as err:  # noqa: BLE001 - mapped: a 503 for infrastructure, else a JSON 500
        raise failure_error(err, limits.retry_after_s) from err
    if isinstance(event, ModelError):
        raise model_event_error(event)
    return event


def _error_response(err: RequestError, extra: dict[str, str] | None = None) -> JSONResponse:
    return err.response({LEVEL_HEADER: _level(), **(extra or {})})


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (wrong method), in OpenAI's shape."""
    assert isinstance(exc, StarletteHTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _error_response(RequestError(exc.status_code, message, None, kind=kind),
                           dict(exc.headers or {}))


async def _validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI's own parameter validation (query parameters): a 400 naming the parameter."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("query", "path", "header", "body")]
    param = ".".join(loc) or None
    return _error_response(RequestError(400, f"{param or 'request'}: {first.get('msg')}", param))


class OpenAIErrors:
    """ASGI middleware around the whole app: every response gets ``X-Brownout-Level``; an
    exception no route handled becomes OpenAI's JSON (`failure_error`) if nothing was sent yet,
    or, in a stream already under way, a last ``error`` event and ``data: [DONE]``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = stream = False

        async def tracked(message: Message) -> None:
            nonlocal started, ended, stream
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                if LEVEL_HEADER.lower() not in headers:
                    headers[LEVEL_HEADER] = _level()
                stream = headers.get("content-type", "").startswith("text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as err:  # noqa: BLE001 - the backstop: answered, and logged by type only
            logger.error("unhandled %s on %s %s", type(err).__name__, scope.get("method"), scope.get("path"))
            error = failure_error(err)
            try:
                if not started:
                    await _error_response(error)(scope, receive, send)
                elif stream and not ended:
                    await send({"type": "http.response.body", "body": sse(error.body()) + SSE_DONE,
                                "more_body": False})
            except Exception:  # noqa: BLE001 - the client is gone: nothing left to tell it
                pass


def install_error_handling(app: FastAPI) -> None:
    """OpenAI's JSON for every error ``app`` answers: the middleware and FastAPI's own errors."""
    app.add_middleware(OpenAIErrors)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)


install_error_handling(api)

_ERRORS_DOC = {
    400: "invalid request: the message and `param` name the field",
    401: "missing or invalid API key (or admin token)",
    403: "admin API closed, or a wrong admin token",
    404: "unknown model or route",
    408: "the request body was not received in time (auth.body_read_timeout_s)",
    413: "request body over the limit (max_body_bytes)",
    429: "the API key's rate limit: see Retry-After and x-ratelimit-*",
    500: "an internal error (a bug), in OpenAI's shape",
    503: "the model is unavailable or its queue is full: see Retry-After",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in _ERRORS_DOC.items()}


def _json_body(schema: str) -> dict[str, Any]:
    """``openapi_extra`` declaring a required JSON body of the component ``schema``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}}}}}


_COMPLETION_OK = {200: {"description": "the completion (JSON), or its SSE stream when `stream` is true",
                        "content": {"application/json": {}, "text/event-stream": {}}}}


def _openapi() -> dict[str, Any]:
    """FastAPI's document, plus the request models the routes validate with (`_json_body`)."""
    if api.openapi_schema is None:
        doc = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(request_schemas([ChatCompletionRequest, CompletionRequest, OverrideBody]))
        # FastAPI documents a 422 for query parameters; they are answered as 400s (`_validation_error`)
        for ops in doc.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        api.openapi_schema = doc
    return api.openapi_schema


api.openapi = _openapi  # type: ignore[method-assign]


def _key_text(messages: list[dict[str, str]] | None, prompt: str | None) -> str:
    """The semantic-cache key: the client's own request text, before any enrichment."""
    if messages is None:
        return prompt or ""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


FEATURES_DESCRIPTION = """Each optional feature's cost and how often it is off, ranked: the first row is
the most expensive feature (cost_ms: (latency_ms_per_call + cpu_ms_per_call) x calls), ties broken by how
often it was turned off, then how long it was off. Figures under "window" cover the last window_s
(300 s); the others are since start. Per row: feature, rank; off (now) and cause (level or override);
calls, failures (errors and time-outs), latency_ms_per_call (the stage's wall time as this ingress
replica saw it), cpu_ms_per_call (CPU the worker measured, over cpu_calls), cost_ms; disabled_s and
turned_off (with turned_off_by_cause), from the policy actor (all replicas); bypassed: stages not run
for a request on this replica, by cause (level, override, error, timeout, breaker). Calls, latency,
CPU and bypasses are this ingress replica's (each replica keeps its own); off-time is the actor's.
Admin token required (X-Brownout-Admin-Token), as for every /admin route."""


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
        reports: ReportLink | None = None,
        model_slots: int = 16,
        stream_interval: int = 1,
    ) -> None:
        self.model = model
        self.model_slots = model_slots  # the engine's batch (max_num_seqs): admission and derived levels
        self.stream_interval = stream_interval  # the engine's tokens per streamed increment, unshaped
        # deployment names, as report sources carry them (`replica_source`): <deployment>:<id>
        self.model_deployment = str(getattr(model, "deployment_name", "VLLMModel"))
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
        source = self.source = replica_source("Ingress")
        self.deployment = source.partition(":")[0]
        spool_root = Path(spool_dir).expanduser() if spool_dir else None
        rank = _replica_rank()
        outcomes = ServeCounter("brownout_stage_outcomes", "Optional stages not run as asked, by outcome",
                                tag_keys=("feature", "outcome"))
        bypasses = ServeCounter("brownout_feature_bypassed", "Optional stages not run for a request, by cause "
                                "(level, override, error, timeout, breaker)", tag_keys=("feature", "cause"))
        self.pipeline = Pipeline(
            features,
            _batch_caller(handles, by_feature),
            (lambda feature: DurableSpool(spool_root, f"{feature}-ingress{rank}")) if spool_root else None,
            timeouts_s=self.settings.stage_timeouts_s,
            default_timeout_s=self.settings.stage_timeout_s,
            settings=local_settings,
            on_outcome=lambda feature, outcome: outcomes.inc(tags={"feature": feature, "outcome": outcome}),
            on_bypass=lambda feature, cause: bypasses.inc(tags={"feature": feature, "cause": cause}),
            breaker=self.settings.breaker,
        )
        # Until the policy actor answers, serve at the start level (the most degraded by default):
        # a replica started during an outage must not switch every optional feature on.
        self.view = start_view(None, self.settings.start_level)
        self._pending_policy: dict[str, Any] | None = None  # a deployed policy the actor has not taken yet
        self._push_task: asyncio.Task[None] | None = None
        self.view_fetched_at = 0.0
        # (wall time, level) whenever this replica starts serving another level: the end of the
        # control path that bench/control_latency.py times
        self.level_changes: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._view_seq = -1  # the actor's view_seq of self.view (-1: none yet, answered at once)
        self.enrichment_handles = handles
        if policy_link is None:
            from policies.actor import get_or_create_policy_actor

            policy_link = ActorLink(get_or_create_policy_actor)
        self.policy = policy_link
        if reports is None:  # through this node's reporter, batched with its neighbours'
            from deployments.node_reporter import report_link

            reports = report_link()
        self.reports = reports
        self.inflight = 0
        self.latency_ms = SlidingWindow(time.monotonic, 30.0, 4096)
        self.last_policy_error: str | None = None
        refusals = ServeCounter("brownout_admission_refusals", "Requests refused at the door, by class and reason",
                                tag_keys=("criticality", "reason"))
        self.gate = AdmissionGate(model_slots, on_refusal=lambda c, reason: refusals.inc(
            tags={"criticality": c.value, "reason": reason}))
        self.shaping: ShapingPlan = NO_SHAPING
        self.policy_version = -1  # the actor's config_version that admission and shaping follow
        self.model_health = ModelHealth()
        self._circuit_gauge = ServeGauge("brownout_circuit_state", "Circuit breaker per feature: 0 closed, "
                                         "1 half-open, 2 open", tag_keys=("feature",))
        self._model_up_gauge = ServeGauge("brownout_model_up", "1 while the model takes requests as this ingress "
                                          "replica sees it; 0: down, new requests get 503 at once")
        _level_source.append(lambda: int(self.view.level))  # the error backstop's level header
        self.tasks = [
            PeriodicTask("follow-level", self._refresh, 0.0, failure_sleep_s=self.settings.refresh_s),
            signal_reporter(self.reports, source, self._signals, self.settings.report_s),
            PeriodicTask("drain-deferred", self._drain, self.settings.drain_s),
            PeriodicTask("probe-model", self._probe_model, self.settings.model_probe_s),
            # the model's outages seen here go to the policy actor, and its record of every
            # replica's comes back (`ModelHealth.share`): read once at the start, then on each end
            PeriodicTask("share-outages", lambda: self.model_health.share(self.policy.call),
                         OUTAGE_SHARE_S),
        ]
        for task in self.tasks:
            task.start()

    # -- background ----------------------------------------------------------------------------

    async def _refresh(self) -> None:
        """One long-poll of the policy actor (``watch``): back as soon as the view changes (or
        after ``watch_s`` unchanged), so a new level is served within one call of the decision."""
        seq, view = await self.policy.call("watch", self._view_seq, self.settings.watch_s,
                                           call_timeout_s=self.settings.watch_s + 2.0)
        if not isinstance(view, PolicyView):
            raise TypeError(f"the policy actor sent {type(view).__name__}, not a PolicyView")
        if view.config_version != self.policy_version:
            # The actor's policy is the one source of truth: a `serve deploy`, an operator's
            # update_config or a restored copy all reach admission and shaping this way.
            doc = await self.policy.call("get_config")
            self._apply_policy(parse_policy(doc["config"]))
            self.policy_version = doc["config_version"]
        if view.level != self.view.level:
            self.level_changes.append((time.time(), int(view.level)))
        self.view, self.view_fetched_at, self._view_seq = view, time.time(), int(seq)
        self.gate.set_level(int(view.level))  # admission uses the service model measured at this level
        # this replica's share of the model replicas' batches, from who reports (0: not known yet)
        self.gate.set_replicas(view.replicas.get(self.model_deployment, 0), view.replicas.get(self.deployment, 0))

    def _signals(self) -> dict[str, float]:
        self._export_circuits()
        out: dict[str, float] = {"inflight": self.inflight, **self.gate.signals()}
        p95, mean = self.latency_ms.percentile(95), self.latency_ms.mean()
        if p95 is not None:
            out["p95_latency_ms"] = p95
        if mean is not None:
            out["avg_latency_ms"] = mean
        return out

    def _export_circuits(self) -> None:
        """Each feature's circuit state as a metric (0 closed, 1 half-open, 2 open), and whether
        the model takes requests as this replica sees it, every report tick."""
        for name, breaker in self.pipeline.breakers.items():
            self._circuit_gauge.set(CIRCUIT_STATE_VALUE[breaker.state.value], tags={"feature": name})
        self._model_up_gauge.set(1 if self.model_health.up else 0)

    async def _probe_model(self) -> None:
        """Ask a model replica for its engine's health (`ModelHealth`) and speed (the door
        predicts with it: `AdmissionGate.observe_speed`). No answer in time (a busy replica, or
        none yet) says nothing; an answer, or a replica that is gone, does."""
        try:
            health = await asyncio.wait_for(self.model.health.remote(), self.settings.model_probe_timeout_s)
        except (asyncio.TimeoutError, BackPressureError):
            return
        except Exception as err:  # noqa: BLE001 - classified: a dead replica says down
            mapped = failure_error(err)
            if getattr(mapped, "model_down", False):
                self.model_health.observe(False, f"model replica unreachable: {type(err).__name__}")
            return
        self.model_health.observe(bool(health.get("ok")), health.get("reason"))
        self.model_health.observe_start(health.get("start_s"))
        if health.get("slowdown") is not None:  # how much slower its engine steps than lately
            self.gate.observe_speed(health.get("pid"), health["slowdown"])

    async def _drain(self) -> None:
        view = self.view
        for feature in self.pipeline.deferrable(view.modes):
            if feature in view.enabled:
                await self.pipeline.drain(feature)
            else:
                await self.pipeline.open_spool(feature)  # in a thread: records of a previous replica count

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
            config = fit_policy(parse_policy(doc), self.model_slots)
        except PolicyError as err:
            self.last_policy_error = str(err)
            logger.error("brownout: rejected policy from user_config, running policy kept: %s", err)
            return
        if self.view_fetched_at == 0.0:  # not heard from the actor yet: the start level of this policy
            self.view = start_view(config, self.settings.start_level)
        self._pending_policy = doc
        await self._push_policy()

    async def _push_policy(self) -> None:
        """Send the deployed policy to the actor (origin "deploy": applied only if this document
        changed since the last deploy, so a replica restart or scale-up re-sending it does not undo
        an operator's change). An actor that is down does not stop the replica from starting: the
        push is retried every ``policy_push_retry_s`` until the actor takes it."""
        doc = self._pending_policy
        if doc is None:
            return
        try:
            result = await self.policy.call("update_config", doc, self.model_slots, "deploy")
        except Exception as err:  # noqa: BLE001 - the actor is down or restarting: retry, keep serving
            self.last_policy_error = f"policy actor unavailable, deployed policy not pushed yet: {type(err).__name__}"
            if self._push_task is None or self._push_task.done():
                self._push_task = asyncio.get_running_loop().create_task(self._retry_push())
            return
        self._pending_policy = None
        self.last_policy_error = None if result.get("ok") else result.get("error")
        logger.info("brownout: policy from user_config: %s", result)

    async def _retry_push(self) -> None:
        while self._pending_policy is not None:
            await asyncio.sleep(self.settings.policy_push_retry_s)
            await self._push_policy()

    def _apply_policy(self, config: DegradationConfig) -> None:
        """The parts of the policy the ingress enforces itself, per request: admission, shaping."""
        self.gate.configure(config)
        self.shaping = ShapingPlan.from_config(config)
        self.pipeline.off_levels = config.off_levels()  # tells a level's bypass from an override's

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
        fields[STREAM_FIELD] = self.stream_interval if body.stream else None
        shaped = shape(self.shaping, self.view.level, fields)
        if shaped.refusal is not None:
            r = shaped.refusal
            raise RequestError(r.status, r.message, r.field, code=r.code,
                               headers={SHAPED_HEADER: f"{r.field}=refused"})
        if shaped.header is not None:
            ctx.sampling = shaped.apply_to(ctx.sampling)
            ctx.stream_interval = shaped.stream_interval
            ctx.headers_out[SHAPED_HEADER] = shaped.header

    def _model_request(self, ctx: RequestState, ticket: Ticket) -> dict[str, Any]:
        req = dict(ctx.sampling, request_id=ctx.request_id, priority=ticket.priority,
                   deadline_at=ticket.deadline_at)
        if ctx.stream_interval is not None:
            req["stream_interval"] = ctx.stream_interval
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
        await self.gate.until_started(ticket, self.pipeline.pre(ctx))
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
            await self._model_start(ticket, gen)
        else:
            self.pipeline.handle_calls[MODEL] += 1
            whole = self.model.options(stream=True).generate_whole.remote(self._model_request(ctx, ticket))
            await self._model_start(ticket, whole)
            try:
                result = await self._model_call(whole.__anext__())
            except BaseException:
                whole.cancel()  # a client gone (or a failure): vLLM aborts the request
                raise
            gen = None
            self.gate.release(ticket, served=True)

        if stream:
            self.pipeline.decide_side_effects(ctx)  # discloses the skipped ones; promises nothing
            body = self._sse(ctx, ticket, gen, rid, chat, include_usage, echo_prefix, on_stream_end)
            return StreamingResponse(body, media_type="text/event-stream", headers=ctx.headers())

        ctx.text = result.text
        await self.pipeline.post(ctx)
        self.pipeline.decide_side_effects(ctx)
        record = ctx.record(result.finish_reason, usage(result.prompt_tokens, result.completion_tokens))
        # durable before promised: the deferred records are on disk before the headers name them
        await self.pipeline.settle(ctx, record)
        build = chat_completion if chat else text_completion
        doc = build(rid, self.served_model_name, echo_prefix + ctx.text, result.finish_reason,
                    result.prompt_tokens, result.completion_tokens)
        return JSONResponse(doc, headers=ctx.headers())

    async def _model_start(self, ticket: Ticket, gen: Any) -> None:
        """Until the model has started the request (`Started`: vLLM computed its first token),
        through the two waits before it: for a model replica to take it (`Reached`), bounded by
        the request's deadline (`AdmissionGate.until_reached`: 503 ``expired``), then in vLLM's
        queue. Meanwhile a more important request may take its place (`until_started`). Any way
        this ends early (refused, failed, the client gone) cancels the model call."""
        async def reached_then_started() -> None:
            sent = time.monotonic()
            try:
                await self.gate.until_reached(ticket, self._model_call(gen.__anext__()))
            except RequestError:
                if ticket.expired:  # no replica took it: down, if none has answered meanwhile either
                    self.model_health.observe_expired(time.monotonic() - sent)
                raise
            await self._model_call(gen.__anext__())

        try:
            await self.gate.until_started(ticket, reached_then_started(), gen)
        except BaseException:
            gen.cancel()
            raise

    async def _model_call(self, awaitable: Any) -> Any:
        """`_model_call`, with a computed Retry-After on the model's own 503s (a late drop); what
        it says about the model's health goes to `ModelHealth`."""
        try:
            event = await _model_call(awaitable, self.limits)
        except RequestError as err:
            if getattr(err, "model_down", False):
                self.model_health.observe(False, err.message)
                err.headers["Retry-After"] = str(self._down_retry_after_s())
            elif err.status == 503:
                err.headers["Retry-After"] = str(self.gate.drain_s())
            raise
        self.model_health.observe(True)
        return event

    def _failed(self, err: BaseException) -> RequestError:
        """An unexpected exception as the client's error; logged by type (never its text)."""
        mapped = failure_error(err, self.limits.retry_after_s)
        if mapped.status >= 500:
            logger.warning("request failed: %s -> %d", type(err).__name__, mapped.status)
        if getattr(mapped, "model_down", False):
            self.model_health.observe(False, mapped.message)
            mapped.headers["Retry-After"] = str(self._down_retry_after_s())
        return mapped

    def _down_retry_after_s(self) -> int:
        """``Retry-After`` while the model is down: the predicted rest of the outage
        (`ModelHealth.retry_after_s`), within ``[limits.retry_after_s, limits.max_retry_after_s]``."""
        return self.model_health.retry_after_s(self.limits.retry_after_s, self.limits.max_retry_after_s)

    def _sse(self, ctx: RequestState, ticket: Ticket, gen: Any, rid: str, chat: bool,
             include_usage: bool, echo_prefix: str, on_end: Callable[[], None]) -> AsyncIterator[bytes]:
        def release(served: bool) -> None:
            self.gate.release(ticket, served)

        parts: list[str] = []  # the text sent so far: what a dropped stream's audit record holds

        def ended() -> None:
            release(False)  # no-op when the body released it already
            if not ctx.settled:
                ctx.text = "".join(parts)
                self.pipeline.abandon(ctx, "client_dropped")
            on_end()

        return _ReleasingStream(self._sse_body(ctx, gen, rid, chat, include_usage, echo_prefix, release, parts),
                                ended)

    async def _sse_body(self, ctx: RequestState, gen: Any, rid: str, chat: bool, include_usage: bool,
                        echo_prefix: str, release: Callable[[bool], None], parts: list[str]) -> AsyncIterator[bytes]:
        created, model = int(time.time()), self.served_model_name
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
                    if isinstance(delta, ModelError):  # the engine failed mid-stream
                        raise model_event_error(delta)
                    finish, prompt_tokens, completion_tokens = (delta.finish_reason, delta.prompt_tokens,
                                                                delta.completion_tokens)
                    parts.append(delta.text)
                    yield chunk(delta.text, delta.finish_reason)
                release(True)  # the model is done with it: a completion that measures its rate
                self.model_health.observe(True)  # and it answered (`ModelHealth.observe_expired` reads when)
        except Exception as err:  # noqa: BLE001 - headers are sent; report in-band, then end the stream
            release(False)
            logger.warning("stream %s failed: %s", rid, type(err).__name__)  # no request text in logs
            failure = self._failed(err)
            ctx.text = "".join(parts)
            await self.pipeline.settle_outcome(ctx, "failed", failure.status)
            yield sse(failure.body())
            yield SSE_DONE
            return
        if include_usage:
            doc = (chat_chunk(rid, model, created, {}) if chat else text_chunk(rid, model, created, ""))
            yield sse({**doc, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        ctx.text = "".join(parts)
        # durable before promised: a stream's headers are gone, so its deferrals are named here,
        # once on disk, in an SSE comment line before [DONE] (clients ignore comments)
        deferred = await self.pipeline.settle(ctx, ctx.record(finish, usage(prompt_tokens, completion_tokens)))
        if deferred:
            yield f": {DEFERRED_HEADER}: {','.join(deferred)}\n\n".encode()
        yield SSE_DONE
        self.latency_ms.add((time.monotonic() - ctx.started) * 1000.0)

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
        ctx: RequestState | None = None
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
            asked, tier = request.headers.get(CRITICALITY_HEADER), (key.tier if key else None)
            down = self.model_health.refusal()
            if down is not None:
                raise self.gate.refuse_unavailable(asked, tier, down, self._down_retry_after_s())
            ticket = await self.gate.admit_waiting(asked, base=tier)
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
            if ctx is not None:  # audited once, with its outcome (refused: at the door, preempted or expired)
                refused = ticket is None or ticket.preempted or ticket.expired
                self.pipeline.abandon(ctx, "refused" if refused else "failed", err.status)
            return err.response({LEVEL_HEADER: str(int(self.view.level))})
        except Exception as err:  # noqa: BLE001 - infrastructure (503) or our bug (500): JSON either way
            if ticket is not None:
                self.gate.release(ticket, served=False)
            mapped = self._failed(err)
            if ctx is not None:
                self.pipeline.abandon(ctx, "failed", mapped.status)
            return mapped.response({LEVEL_HEADER: str(int(self.view.level))})
        except BaseException:
            if ticket is not None:
                self.gate.release(ticket, served=False)
            if ctx is not None:
                self.pipeline.abandon(ctx, "client_dropped")
            raise
        finally:
            if not streaming:
                end_inflight()

    # -- OpenAI routes -------------------------------------------------------------------------

    @api.post("/v1/chat/completions", openapi_extra=_json_body("ChatCompletionRequest"),
              responses={**_COMPLETION_OK, **ERROR_RESPONSES})
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    @api.post("/v1/completions", openapi_extra=_json_body("CompletionRequest"),
              responses={**_COMPLETION_OK, **ERROR_RESPONSES})
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    @api.get("/v1/models", responses=ERROR_RESPONSES)
    async def models(self, request: Request) -> Response:
        try:
            self._authenticate(request)
        except RequestError as err:
            return _error_response(err)
        return JSONResponse({"object": "list", "data": [{"id": self.served_model_name, "object": "model",
                                                         "created": self.created, "owned_by": "brownout"}]})

    @api.get("/healthz", responses={503: ERROR_RESPONSES[503]})
    async def healthz(self) -> Response:
        """200 only if a model replica answers and its engine is alive (vLLM's own check)."""
        try:
            stats = await asyncio.wait_for(self.model.stats.remote(), self.settings.model_probe_timeout_s * 5)
        except Exception as err:  # noqa: BLE001 - any failure means "not healthy"
            return _error_response(_unavailable(self.limits, f"model unreachable: {type(err).__name__}"))
        if not stats.get("engine_alive", True):
            self.model_health.observe(False, "the model's engine process has died")
            return _error_response(_unavailable(self.limits, "the model's engine process has died; its replica "
                                                "is being replaced", self._down_retry_after_s()))
        return JSONResponse({"status": "ok", "model": self.served_model_name, "level": int(self.view.level),
                             "engine": stats, "model_health": self.model_health.state()})

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
            return _error_response(err)
        except Exception as err:  # noqa: BLE001 - the actor is down or slow: say so
            return _error_response(_unavailable(self.limits, f"policy actor unavailable: {type(err).__name__}"))
        if isinstance(result, dict) and result.get("ok") is False:
            return _error_response(RequestError(400, result.get("error", "rejected"), None))
        return JSONResponse(result)

    @api.get("/admin/brownout", responses=ERROR_RESPONSES)
    async def admin_state(self, request: Request) -> Response:
        response = await self._admin(request, "get_state")
        if response.status_code != 200:
            return response
        state = json.loads(response.body)
        state["ingress"] = {
            "snapshot_level": int(self.view.level), "snapshot_age_s": time.time() - self.view_fetched_at,
            "config_version": self.view.config_version,
            "pipeline": self.pipeline.counters(), "policy_link_failures": self.policy.failures,
            "policy_link": self.policy.state() if hasattr(self.policy, "state") else None,
            "report_link": self.reports.state() if hasattr(self.reports, "state") else None,
            "last_policy_error": self.last_policy_error, "inflight": self.inflight, "pid": os.getpid(),
            "admission": self.gate.state(),
            "largest_refused_body_read": self.largest_refused_read,
            "model_health": self.model_health.state(),
            "replica": self.source, "level_changes": list(self.level_changes),
        }
        return JSONResponse(state)

    @api.get("/admin/brownout/history", responses=ERROR_RESPONSES)
    async def admin_history(self, request: Request, n: int = Query(default=100, ge=1, le=10_000)) -> Response:
        return await self._admin(request, "history", n)

    @api.post("/admin/brownout/override", openapi_extra=_json_body("OverrideBody"), responses=ERROR_RESPONSES)
    async def admin_override(self, request: Request) -> Response:
        try:
            self._admin_check(request)  # before the body is read
            body = parse_body(await read_body(request, 64 * 1024, self.auth.body_read_timeout_s), OverrideBody,
                              64 * 1024)
            if body.ttl_s > self.auth.max_override_ttl_s:
                raise RequestError(400, f"ttl_s: {body.ttl_s:g} exceeds the maximum of "
                                   f"{self.auth.max_override_ttl_s:g} s (auth.max_override_ttl_s)", "ttl_s")
        except RequestError as err:
            return _error_response(err)
        return await self._admin(request, "set_override", level=body.level, feature=body.feature,
                                 enabled=body.enabled, ttl_s=body.ttl_s, note=body.note)

    @api.delete("/admin/brownout/override", responses=ERROR_RESPONSES)
    async def admin_clear(self, request: Request, level: bool = False, feature: str | None = None) -> Response:
        return await self._admin(request, "clear_override", level=level, feature=feature)

    @api.get("/admin/brownout/features", responses=ERROR_RESPONSES,
             description=FEATURES_DESCRIPTION)
    async def admin_features(self, request: Request) -> Response:
        response = await self._admin(request, "get_state")
        if response.status_code != 200:
            return response
        state = json.loads(response.body)
        clock = state.get("feature_time") or {}
        costs = self.pipeline.costs()
        rows = rank(merge(costs, clock, self.pipeline.bypass_counts()))
        return JSONResponse({
            "features": rows,
            "window_s": self.pipeline.cost.window_s,
            "ranked_by": "window cost_ms, then window turned_off, then window disabled_s; ties: the "
                         "same since start",
            "level": state.get("level"),
            "replica": {"pid": os.getpid(), "costs": "this ingress replica since its start"},
        })

    @api.get("/admin/brownout/enrichments", responses=ERROR_RESPONSES)
    async def admin_enrichments(self, request: Request) -> Response:
        try:
            self._admin_check(request)
        except RequestError as err:
            return _error_response(err)
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
            await self.pipeline.close()
        for worker in getattr(self, "local", {}).values():
            await worker.close()
