"""VLLMModel: the core of the graph, a Serve deployment around `LLMEngine`.

The class is plain (no decorator): `serve_app/app.py` binds it. It takes OpenAI-shaped request
dicts that the ingress has already validated, renders chat prompts with the model's own chat
template, enforces the prompt-length limit in tokens (only the model's tokenizer can count them),
and streams completions, in increments or whole. A request whose caller goes away (client
disconnect, Serve cancellation) is aborted in vLLM at once: its batch slot and KV cache are
freed, and nothing is computed for nobody.

Every stream yields typed events (frozen dataclasses, pickled across the handle): first
`Reached` (the request reached this replica before its deadline: the ingress bounds its wait for
a replica by that deadline) or a `ModelError`, then `Started` (the prompt's token count: vLLM
computed the first token) or a `ModelError`, then `Delta` increments (``generate_stream``) or
one `Completion` (``generate_whole``, the ingress's whole answers: streamed so that it too sees
when the request reached a replica and when vLLM started it). Errors are values, not
exceptions, so the ingress can map them to HTTP statuses without unwrapping Ray's exception
types; that holds for the
engine's own failures too (`deployments.engine.EngineError`: its engine-core process died, vLLM
refused with a status), which become a 503 `ModelError` (or vLLM's status), before the first event
or in the middle of a stream. The prompt is tokenised once, here: the ids that were counted
against the limit are the ids vLLM receives.

Health means the engine's health: ``check_health`` (which Serve calls every
``health_check_period_s``) asks vLLM, so a replica whose engine-core process died fails it and
Serve replaces the replica; until then each request it gets is answered at once with a 503.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from deployments.cpu_placement import Isolation, compute_threads, isolate, release
from deployments.engine import SAMPLING_KEYS, Delta, EngineError, EngineSettings, LLMEngine
from deployments.gpu import GpuProbe
from deployments.reporting import ReportLink, replica_source, signal_reporter
from policies.admission import should_drop

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ModelError:
    """A request the model refused: the HTTP status, a message and the field at fault."""

    status: int
    message: str
    param: str | None
    kind: str = "invalid_request_error"
    engine_dead: bool = False  # the engine-core process is gone: this replica cannot serve anything


@dataclass(frozen=True)
class Reached:
    """The first event of a request in time: it reached a model replica before its deadline.
    Until it comes, the request waits for a replica (Serve's router: none is running, or every
    one is full), which the ingress bounds by the deadline (`AdmissionGate.until_reached`)."""


@dataclass(frozen=True)
class Started:
    """The first event of an accepted stream: vLLM took the request."""

    prompt_tokens: int


@dataclass(frozen=True)
class Completion:
    """A whole completion."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None


# What generate_stream yields: Reached or ModelError first, then Started or ModelError, then Delta
# increments (and, if the engine fails mid-stream, a last ModelError). generate_whole yields the
# same up to Started, then one Completion or ModelError.
StreamEvent = Reached | Started | Delta | ModelError
WholeEvent = Reached | Started | Completion | ModelError


def engine_failure(err: EngineError) -> ModelError:
    """The `ModelError` for an engine failure: its status (503 unless vLLM named another)."""
    kind = "service_unavailable" if err.status == 503 else (
        "invalid_request_error" if 400 <= err.status < 500 else "server_error")
    message = str(err) if err.status != 503 else f"{err}; retry later"
    return ModelError(err.status, message, None, kind=kind, engine_dead=err.dead)


class VLLMModel:
    """Serve deployment: vLLM generation plus live load statistics.

    ``engine`` may be passed in (tests, or a caller that builds its own); otherwise one is built
    from ``engine_settings`` in the async constructor.
    """

    async def __init__(
        self,
        engine_settings: EngineSettings | Mapping[str, Any],
        served_model_name: str,
        max_prompt_tokens: int,
        engine: LLMEngine | None = None,
        gpu_probe: GpuProbe | None = None,
        report_interval_s: float = 0.25,
        reports: ReportLink | None = None,
    ) -> None:
        began = time.monotonic()
        # validated once by the builder (an `EngineSettings` is kept as it is); a dict here
        self.settings = (engine_settings if isinstance(engine_settings, EngineSettings)
                         else EngineSettings.model_validate(dict(engine_settings)))
        self.served_model_name = served_model_name
        self.max_prompt_tokens = max_prompt_tokens
        self.engine = engine or LLMEngine(self.settings)
        self.gpu = gpu_probe or GpuProbe()
        self.dropped_late = 0  # requests past their deadline when they reached the model
        self.engine_failures = 0  # requests the engine failed (dead, or refused with a status)
        await self.engine.start()
        # A CPU engine's cores to itself (deployments/cpu_placement.py): only for an engine this
        # replica built, whose engine-core process is its child.
        self.cpu_isolation = (
            isolate(self.settings.cpu_isolation, compute_threads(), self.engine.on_cpu(),
                    engine_pids=self.engine.engine_core_pids())
            if engine is None else Isolation(None, "engine supplied by the caller"))
        if reports is None:  # through this node's reporter, batched with its neighbours'
            from deployments.node_reporter import report_link

            reports = report_link()
        self.reporter = signal_reporter(reports, replica_source("VLLMModel"), self.signals, report_interval_s)
        self.reporter.start()
        # how long this replica took to start (vLLM's import, the engine, the weights): the
        # ingress predicts a replacement's wait from it until it has seen an outage end (`health`)
        self.start_s = time.monotonic() - began
        logger.info("VLLMModel ready in %.1f s: %s (%s)", self.start_s, served_model_name, self.settings.model)

    # -- requests ------------------------------------------------------------------------------

    def _prompt(self, request: Mapping[str, Any]) -> tuple[str, list[int]] | ModelError:
        """The prompt text and its token ids (encoded once), or an error naming the field."""
        if "messages" in request:
            try:
                prompt = self.engine.render_chat(request["messages"])
            except Exception as err:  # noqa: BLE001 - a template error is the caller's input
                return ModelError(400, f"messages could not be rendered: {err}", "messages")
            field = "messages"
        else:
            prompt, field = request["prompt"], "prompt"
        ids = self.engine.encode(prompt)
        n = len(ids)
        if n > self.max_prompt_tokens:
            return ModelError(
                400,
                f"{field} is {n} tokens; the limit is {self.max_prompt_tokens} (max_prompt_tokens)",
                field,
            )
        room = self.settings.max_model_len - n
        if request.get("max_tokens", 0) > room:
            return ModelError(
                400,
                f"max_tokens={request['max_tokens']} plus the {n}-token prompt exceeds the model's "
                f"context of {self.settings.max_model_len} tokens",
                "max_tokens",
            )
        return prompt, ids

    async def generate_stream(self, request: Mapping[str, Any]) -> AsyncIterator[StreamEvent]:
        """Stream one completion: `Reached`, `Started` (or a `ModelError` in place of either),
        then `Delta` increments.

        Cancelling the consumer (Serve propagates a client disconnect) aborts the vLLM request.
        """
        if should_drop(request.get("deadline_at"), time.time()):
            # It waited past its deadline before reaching the engine: its answer would miss the
            # SLO anyway, and computing it would delay the requests behind it that still can make it.
            self.dropped_late += 1
            yield ModelError(503, "the request waited past its deadline before the model could start it; "
                             "retry later", None, kind="service_unavailable")
            return
        yield Reached()
        prompt = self._prompt(request)
        if isinstance(prompt, ModelError):
            yield prompt
            return
        text, ids = prompt
        sampling = {k: request[k] for k in SAMPLING_KEYS if request.get(k) is not None}
        request_id = request.get("request_id") or uuid.uuid4().hex
        interval = request.get("stream_interval")  # set by the level's shaping (`policies.shaping`)
        stream = self.engine.generate(text, sampling, request_id, prompt_ids=ids,
                                      priority=int(request.get("priority", 0)),
                                      stream_interval=None if interval is None else int(interval))
        try:
            first = await anext(stream)  # vLLM validates sampling before queueing anything
        except ValueError as err:
            yield ModelError(400, str(err), None)
            return
        except EngineError as err:
            self._engine_failed(err)
            yield engine_failure(err)
            return
        except StopAsyncIteration:
            return
        yield Started(prompt_tokens=len(ids))
        yield first
        try:
            async for delta in stream:
                yield delta
        except EngineError as err:  # the engine died (or refused) mid-stream: the last event says so
            self._engine_failed(err)
            yield engine_failure(err)

    def _engine_failed(self, err: EngineError) -> None:
        self.engine_failures += 1
        if err.dead:
            logger.error("VLLMModel: the engine is dead (%s); failing health checks so Serve replaces "
                         "this replica", err)

    async def generate_whole(self, request: Mapping[str, Any]) -> AsyncIterator[WholeEvent]:
        """One whole completion, streamed as `generate_stream` up to `Started`, then one
        `Completion` (or the `ModelError` of a failure on the way)."""
        parts: list[str] = []
        last: Delta | None = None
        async for event in self.generate_stream(request):
            if isinstance(event, Delta):
                parts.append(event.text)
                last = event
                continue
            yield event
            if isinstance(event, ModelError):
                return
        assert last is not None, "vLLM finished without output"
        yield Completion(text="".join(parts), prompt_tokens=last.prompt_tokens,
                         completion_tokens=last.completion_tokens, finish_reason=last.finish_reason)

    # -- observability -------------------------------------------------------------------------

    def signals(self) -> dict[str, float | None]:
        """What this replica reports to the policy actor (names from policies.config.SIGNALS).

        ``queue_length`` is vLLM's waiting queue: requests admitted to the replica that the batch
        cannot take yet. ``engine_p95_latency_ms`` and ``ttft_p95_ms`` are times inside vLLM
        (end-to-end latency is the ingress's ``p95_latency_ms``); they are left out while the
        window is empty. GPU figures only where a GPU exists; a failed read sends them as None
        (stale, counted by the actor and in ``stats()["gpu"]["read_errors"]``).
        """
        st = self.engine.stats()
        out: dict[str, float | None] = {"queue_length": st.num_waiting_reqs,
                                        "kv_cache_usage": st.kv_cache_usage_ratio}
        for name, value in (("ttft_p95_ms", st.ttft_p95_ms), ("engine_p95_latency_ms", st.latency_p95_ms)):
            if value is not None:
                out[name] = value
        gpu = self.gpu.read()
        if gpu.available:
            out["gpu_util"] = gpu.util_ratio
            out["gpu_mem_ratio"] = gpu.mem_ratio
        elif gpu.failed:
            out["gpu_util"] = out["gpu_mem_ratio"] = None
        return out

    async def stats(self) -> dict[str, Any]:
        """Engine statistics and the GPU reading, as one plain dict. Async on purpose: Serve runs a
        sync method in a thread pool, where it would read windows the event loop is writing; an
        async one runs on the replica's event loop, between the writes."""
        gpu = self.gpu.read()
        return {
            "pid": os.getpid(),
            **asdict(self.engine.stats()),
            "dropped_late": self.dropped_late,
            "engine_alive": not self.engine.errored,
            "engine_core_pids": self.engine.engine_core_pids(),
            # the engine's steps read against steps like them (`policies.engine_speed`): slowdown, steps
            "engine_speed": self.engine.speed_state(),
            "engine_speed_window": self.engine.speed_window(),  # which kinds of step that reading rests on
            "engine_failures": self.engine_failures,
            "cpu_isolation": self.cpu_isolation.describe(),
            "gpu": {"available": gpu.available, "reason": gpu.reason, "read_errors": self.gpu.read_errors,
                    "util_ratio": gpu.util_ratio, "mem_ratio": gpu.mem_ratio},
        }

    async def waiting_changes(self) -> list[tuple[float, int]]:
        """``(wall time, vLLM's waiting count)`` at each of the last engine steps that changed it
        (`bench/control_latency.py`: when the queue crossed a trigger). Kept out of `stats`, which
        ``/healthz`` returns on every probe."""
        return list(self.engine.waiting_changes)

    async def health(self) -> dict[str, Any]:
        """What ``check_health`` finds, as a value (the ingress probes it): ``{"ok": bool, "reason",
        "pid", "slowdown", "start_s"}``; ``slowdown``: how many times slower the engine steps now
        than it did lately at the same batch (`policies.engine_speed`), which the ingress's
        admission predicts with; ``start_s``: how long this replica's constructor took, from its
        start to serving (vLLM's import, the engine's start, the weights' load), which the
        ingress's ``Retry-After`` for a model that is down rests on before it has seen an outage
        end (`serve_app.health.ModelHealth.retry_after_s`)."""
        slowdown = self.engine.slowdown()
        out = {"ok": True, "reason": None, "pid": os.getpid(), "slowdown": slowdown, "start_s": self.start_s}
        try:
            await self.engine.check_health()
        except EngineError as err:
            out.update(ok=False, reason=str(err))
        return out

    async def check_health(self) -> None:
        """Serve's health check: vLLM's own. A dead engine fails it, and Serve replaces the replica."""
        await self.engine.check_health()

    async def __del__(self) -> None:
        try:
            await self.reporter.stop()
            await self.engine.shutdown()
        finally:
            release(self.cpu_isolation)
