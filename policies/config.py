"""Degradation policy config: one pydantic v2 schema for two spellings.

The reference design's JSON is read unchanged::

    {"degradation": {"level1": {"trigger": {"gpu_util": 0.85, "queue_length": 20},
                                "disable": ["semantic_cache", "debug_log", "light_metrics"]},
                     "level2": {...},
                     "level3": {"trigger": {...}, "disable": ["all_non_critical"]}}}

The richer YAML (``configs/degradation.yaml``) is the same schema with more keys: per level
``recover`` thresholds, ``escalate_after_s``, ``recover_dwell_s``, ``cooldown_s``; and a
``features`` section giving each feature its off level, criticality and off-mode.

Rules, all checked at load time (validators do no I/O):

- A level *triggers* when ANY of its trigger signals reaches (>=) its value.
- A level *recovers* when EVERY one of its signals is strictly below its recover value. A recover
  value left out defaults to ``trigger * recover_ratio``; the default ratio, 5/6, maps the
  reference design's example 0.9 trigger to its 0.75 recover value. Recover must be below trigger.
- A signal named at two levels must trigger strictly higher at the higher level.
- Feature names must be registered (``policies.features``) or an alias; ``all_non_critical``
  means every optional feature; a critical feature may never be disabled.
- A feature disabled at level k is disabled at every level above k.
- Request shaping (``shape`` per level) is inherited upward the same way: at level L the cap on
  ``max_tokens`` is the one of the highest level <= L that sets one, and the fields refused are
  those refused at any level <= L; a stream's increments (``stream_interval``) are those of the
  highest level <= L that sets them. A cap may not grow with the level, nor an interval shrink
  (a higher level never shapes less); level 0 never shapes. The rule and why: `policies.shaping`.

Optional sections (all validated the same way):

- ``flap_damping``: a recovery undone by a re-escalation within ``window_s`` multiplies the next
  recovery dwell by ``dwell_factor`` (up to ``max_dwell_factor``); ``reset_after_s`` without any
  escalation forgets the flaps. The rule and why the defaults: `policies.controller`.
- ``slo``: the latency objective (``e2e_p99_ms``, optionally ``ttft_p99_ms``), the class a request
  gets when nothing says otherwise, and each criticality class's share of the latency budget.
  `policies.slo.derive_policy` turns it into default levels; `policies.admission` into per-request
  admission. ``admission`` tunes the latter and needs an ``slo``.

Every error names the key, the bad value and, where there is a closed set, the valid choices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policies import features as feat
from policies.features import Level, OffMode

# The signals a policy may name, with their units in the name where they have one, and how the
# policy actor folds the replicas' reports of each into one value (`policies.signals`): "sum"
# for counts of work (every replica sees its own share), "max" for utilisation and latency
# (the worst replica is the one that breaks the SLO). One table: the names are its keys.
SIGNAL_AGGREGATION: Mapping[str, Literal["sum", "max"]] = {
    "gpu_util": "max",  # 0-1, busiest GPU
    "gpu_mem_ratio": "max",  # 0-1, fullest GPU memory
    "queue_length": "max",  # requests vLLM has accepted but not yet scheduled (engine waiting),
    #                         in the longest queue: each engine has its own, a request waits
    #                         behind the one it was routed to, and queue triggers are sized
    #                         against one engine's waiting room (a sum over several model
    #                         replicas would trigger as if one engine held them all)
    "inflight": "sum",  # requests being served end to end (ingress; open streams included)
    "kv_cache_usage": "max",  # 0-1, fullest vLLM KV cache
    "avg_latency_ms": "max",  # mean end-to-end latency at the ingress (request in, last byte out)
    "p95_latency_ms": "max",  # 95th percentile end-to-end latency at the ingress
    "engine_p95_latency_ms": "max",  # 95th percentile time inside vLLM (model replica)
    "enrichment_p95_latency_ms": "max",  # 95th percentile of one enrichment deployment call
    "ttft_p95_ms": "max",  # 95th percentile time to first token inside vLLM
    # Early signals of the SLO-derived policy (`derive_policy`); both rise before latency is lost.
    "model_queued": "sum",  # requests admitted and waiting for the model's batch wherever they
    #                         wait, per model replica: each ingress counts what it has in flight
    #                         beyond its share of the replicas' batches and divides by the
    #                         model replicas serving (`AdmissionController.set_replicas`), so
    #                         the sum is one engine's share of the waiting, as triggers expect
    "predicted_wait_ms": "max",  # the ingress admission controller's predicted queueing delay:
    #                              the service model's latency with the requests in flight
    #                              ahead less its latency alone (the count averaged over
    #                              admission.wait_smoothing_s, by default twice the
    #                              latency alone), scaled so it
    #                              reaches the SLO when a new request would miss it
    "refused_ratio": "max",  # 0-1, share of requests an ingress refused at the door for capacity
    #                          (429/503) over admission.refusal_window_s: demand beyond what
    #                          the level in force serves, which in-flight counts cannot show
    #                          (admission keeps them under the SLO by refusing)
    "model_replicas_pending": "sum",  # model replicas the autoscaler asked for that do not serve
    #                                   yet (`deployments.autoscaling`; absent without autoscaling)
}
SIGNALS: tuple[str, ...] = tuple(SIGNAL_AGGREGATION)

DEFAULT_RECOVER_RATIO = 0.75 / 0.9  # 0.8333: the reference design's 0.9 -> 0.75 example
LEVEL_KEYS = ("level1", "level2", "level3")

NonNegSeconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]

# Request fields a level may refuse (`ShapeConfig.refuse`); each costs more than one plain
# completion. `policies.shaping.REFUSED_FIELDS` says which request fields, at which values, ask
# for each of them.
REFUSABLE: tuple[str, ...] = (
    "n",  # n > 1: several completions for one request
    "best_of",  # best_of > 1: several sequences generated, one returned
    "logprobs",  # logprobs / top_logprobs: per-token log probabilities in the answer
    "prompt_logprobs",  # vLLM extension: log probabilities of every prompt token
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_signal_map(key: str, values: Mapping[str, float]) -> None:
    for name, value in values.items():
        if name not in SIGNALS:
            raise ValueError(
                f"{key}: unknown signal {name!r}; valid signals: {', '.join(SIGNALS)}"
            )
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(
            value
        ) or value < 0:
            raise ValueError(f"{key}.{name}: threshold must be a finite number >= 0, got {value!r}")


class ShapeConfig(_Strict):
    """Request shaping at one level: a cap on output tokens and the costly fields refused.

    Inherited upward (see `DegradationConfig.shape_at`); the rule and why: `policies.shaping`.
    """

    max_tokens: int | None = Field(
        default=None, ge=1, le=1_000_000, strict=True,
        description="the most output tokens a request gets at this level and above; a request "
        "asking for more is lowered to it (and told so); null: inherited from the level below",
    )
    refuse: list[str] = Field(
        default_factory=list,
        description=f"fields refused at this level and above, answered with a 400 naming the "
        f"field and the level; any of {', '.join(REFUSABLE)}",
    )
    stream_interval: int | None = Field(
        default=None, ge=1, le=4096, strict=True,
        description="a streamed answer's tokens are sent in increments of this many (the first "
        "and the last at once), saving each hop's per-increment work; null: inherited from the "
        "level below",
    )

    @field_validator("refuse")
    @classmethod
    def _refusable(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in REFUSABLE:
                raise ValueError(f"unknown field {name!r}; valid: {', '.join(REFUSABLE)}")
        return value


class LevelConfig(_Strict):
    """One level: when it triggers, when it recovers, what it turns off, how it shapes requests."""

    trigger: dict[str, float] = Field(
        default_factory=dict,
        description="signal -> value; the level triggers when ANY signal reaches its value",
    )
    recover: dict[str, float] = Field(
        default_factory=dict,
        description="signal -> value; recovery needs EVERY signal strictly below its value. "
        "Missing entries default to trigger * recover_ratio.",
    )
    disable: list[str] = Field(
        default_factory=list, description="features (or aliases) this level turns off"
    )
    escalate_after_s: NonNegSeconds = Field(
        default=0.0, description="how long the trigger must hold before escalating; 0 = at once"
    )
    recover_dwell_s: NonNegSeconds = Field(
        default=60.0,  # the reference design's; the shipped policy and the levels an slo adds: 30 s
        description="how long every signal must stay below recover, unbroken, to step down",
    )
    cooldown_s: NonNegSeconds = Field(
        default=30.0, description="minimum time after any level change before stepping down"
    )
    shape: ShapeConfig = Field(
        default_factory=ShapeConfig,
        description="request shaping from this level up: max_tokens cap, fields refused, a "
        "stream's increments",
    )

    @field_validator("trigger", "recover", mode="before")
    @classmethod
    def _signals_known(cls, value: Any, info: Any) -> Any:
        if isinstance(value, Mapping):
            _check_signal_map(info.field_name, value)
        return value

    @field_validator("disable")
    @classmethod
    def _features_known(cls, value: list[str]) -> list[str]:
        for name in value:
            try:
                feat.expand(name)
            except KeyError:
                raise ValueError(
                    f"disable: unknown feature {name!r}; valid: {', '.join(feat.known_names())}"
                ) from None
        return value


class FeatureConfig(_Strict):
    """Per-feature settings of the richer YAML."""

    off_at: Literal[1, 2, 3] | None = Field(
        default=None, description="the level that turns this feature off; null: never"
    )
    critical: bool | None = Field(
        default=None,
        description="must match the registry when given; a critical feature is never disabled",
    )
    mode: OffMode = Field(default=OffMode.SKIP, description="behaviour when off")
    default: Any = Field(default=None, description="the value returned when mode is 'default'")

    @model_validator(mode="after")
    def _default_needs_value(self) -> FeatureConfig:
        if self.mode is OffMode.DEFAULT and self.default is None:
            raise ValueError("mode 'default' needs a 'default' value (e.g. [] or \"\")")
        return self


class FlapDampingConfig(_Strict):
    """Growing recovery dwell after a recovery that did not last (see `policies.controller`).

    Defaults: a re-escalation within 120 s (four of the shipped policy's 30 s dwells) of a step
    down counts as a flap; each flap doubles the next dwell, up to 8x (30 s -> 240 s; a level
    that sets no ``recover_dwell_s`` has `LevelConfig`'s 60 s, the reference design's, and up to
    480 s); ten minutes without any escalation resets it. ``dwell_factor: 1`` turns damping off.
    """

    window_s: NonNegSeconds = Field(
        default=120.0, description="a re-escalation this soon after a step down is a flap"
    )
    dwell_factor: float = Field(
        default=2.0, ge=1.0, le=10.0, allow_inf_nan=False,
        description="each flap multiplies the recovery dwell by this; 1 = no damping",
    )
    max_dwell_factor: float = Field(
        default=8.0, ge=1.0, le=100.0, allow_inf_nan=False,
        description="the recovery dwell grows to at most this multiple of recover_dwell_s",
    )
    reset_after_s: float = Field(
        default=600.0, gt=0.0, allow_inf_nan=False,
        description="this long without any escalation forgets every flap",
    )

    @model_validator(mode="after")
    def _reset_after_window(self) -> FlapDampingConfig:
        if self.reset_after_s < self.window_s:
            raise ValueError(
                f"flap_damping.reset_after_s: {self.reset_after_s:g} must be >= "
                f"flap_damping.window_s: {self.window_s:g} (a reset inside the window would "
                "forget a flap before it is counted)"
            )
        return self

    def factor(self, flaps: int) -> float:
        """The recovery dwell multiplier after ``flaps`` flaps: ``min(dwell_factor**flaps, max)``."""
        if flaps <= 0 or self.dwell_factor == 1.0:
            return 1.0
        # flaps is capped by the controller, but guard the power against overflow anyway
        return min(self.dwell_factor ** min(flaps, 64), self.max_dwell_factor)


CRITICALITIES: tuple[str, ...] = ("critical", "standard", "sheddable")  # most important first


class ClassShares(_Strict):
    """Per criticality class: the share of the latency budget, and so of the admitted concurrency.

    The measured service model (`policies.admission`: latency = unloaded + per request x
    requests in flight) says how many requests can be in flight and all finish within the
    budget; class c is admitted while fewer than ``share_c`` of that are in flight. The defaults
    (which the shipped policy writes out) are 0.9 for standard and sheddable work: the last
    tenth is kept for critical work, so a critical burst still finds room while the others are
    already refused, and the order between the classes below comes from the room each leaves
    for the classes above and the shut-out (`policies.admission`). A lower share for sheddable
    work refused it at loads the engine serves within the SLO (bench/door_sim.py,
    bench/RESULTS.md, commit 5597027): a policy that sets only ``slo.e2e_p99_ms`` gets the
    shares that were measured best.
    """

    critical: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    standard: float = Field(default=0.9, gt=0.0, le=1.0, allow_inf_nan=False)
    sheddable: float = Field(default=0.9, gt=0.0, le=1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> ClassShares:
        for hi, lo in zip(CRITICALITIES, CRITICALITIES[1:]):
            if getattr(self, lo) > getattr(self, hi):
                raise ValueError(
                    f"class_share.{lo}: {getattr(self, lo):g} must not exceed "
                    f"class_share.{hi}: {getattr(self, hi):g} (a less critical class never gets more)"
                )
        return self


class SloConfig(_Strict):
    """The latency objective that admission and the derived levels hold."""

    e2e_p99_ms: float = Field(
        gt=0.0, allow_inf_nan=False, description="99th percentile end-to-end latency target"
    )
    ttft_p99_ms: float | None = Field(
        default=None, gt=0.0, allow_inf_nan=False,
        description="99th percentile time-to-first-token target (streamed requests); optional",
    )
    default_class: Literal["critical", "standard", "sheddable"] = Field(
        default="standard", description="the class of a request nothing else classifies"
    )
    class_share: ClassShares = Field(
        default_factory=ClassShares, description="per class: share of the latency budget"
    )

    @model_validator(mode="after")
    def _ttft_within_e2e(self) -> SloConfig:
        if self.ttft_p99_ms is not None and self.ttft_p99_ms > self.e2e_p99_ms:
            raise ValueError(
                f"ttft_p99_ms: {self.ttft_p99_ms:g} must not exceed e2e_p99_ms: {self.e2e_p99_ms:g}"
            )
        return self


class AdmissionConfig(_Strict):
    """Settings of deadline-aware admission (`policies.admission`); the rule lives there."""

    enabled: bool = Field(default=True, description="false: the ingress admits everything")
    overhead_ms: float = Field(
        default=100.0, ge=0.0, allow_inf_nan=False,
        description="time a request spends outside the model (ingress, enrichments), "
        "subtracted from the e2e budget",
    )
    prior_rate_per_s: float | None = Field(
        default=None, gt=0.0, allow_inf_nan=False,
        description="cold-start service rate (completions/s at full load; 1/rate per request) until "
        "the service model has a measurement; "
        "null: one request alone takes half of e2e_p99 and a full batch of max_num_seqs all of it",
    )
    rate_window_s: float = Field(
        default=1.0, gt=0.0, le=60.0, allow_inf_nan=False,
        description="served requests' (latency, concurrency) points are gathered over windows this long",
    )
    rate_alpha: float = Field(
        default=0.3, gt=0.0, le=1.0, allow_inf_nan=False,
        description="at each window's close the service model's earlier points fade by 1 - this "
        "and the line is refitted",
    )
    reserve_quantile: float = Field(
        default=0.99, ge=0.0, lt=1.0, allow_inf_nan=False,
        description="room kept for more critical classes: each class is held to the highest limit "
        "at which it raises the share of refused requests of the classes above it by at most "
        "1 - this (Erlang's loss model of their measured arrival rates and the service model), "
        "and while critical work arrives and all classes keep the door full the classes below it "
        "leave room for its latency's tail "
        "(0: no reservation of either kind)",
    )
    ramp_step: int | None = Field(
        default=None, ge=0, le=100_000,
        description="while critical work arrives, the classes below it are admitted to at most this "
        "many requests above the highest concurrency a served request was measured at in the last "
        "10 s (at least 4 in all): additive increase into load the latency model has not measured "
        "lately (null: a fifth of the engine's batch per ingress replica, 3 for max_num_seqs 16; "
        "0: no such limit; nor with reserve_quantile 0)",
    )
    overtake_sigmas: float | None = Field(
        default=1.0, ge=0.0, le=10.0, allow_inf_nan=False,
        description="a lower class's cap counts the more important requests that arrive while one of it "
        "waits for a batch slot and start before it (vLLM's priority scheduler), at their mean plus this "
        "many standard deviations; lower it to admit more lower-class work near capacity at the risk of "
        "some finishing late under overload (null: not counted, each class's share alone)",
    )
    critical_wait_share: float = Field(
        default=0.5, ge=0.0, le=1.0, allow_inf_nan=False,
        description="a critical request that finds the door full waits for a freed slot for up to "
        "this share of slo.e2e_p99_ms, and no longer than it could still finish in time on an idle "
        "server (lower classes are refused meanwhile; a slot goes to one still predicted to finish "
        "in time with it) before it is refused (0: refused at once; so is every critical request "
        "while critical work alone arrives faster than the server completes requests)",
    )
    reserve_window_s: float = Field(
        default=10.0, gt=0.0, le=600.0, allow_inf_nan=False,
        description="time constant of each class's measured arrival rate (requests offered, "
        "admitted or refused); a fifth of it is a second, fast estimate that room kept and shut-outs "
        "also follow",
    )
    refusal_window_s: float = Field(
        default=5.0, gt=0.0, le=300.0, allow_inf_nan=False,
        description="the refused_ratio signal is the share of requests refused at the door for "
        "capacity over the last this-many seconds",
    )
    wait_smoothing_s: float | None = Field(
        default=None, ge=0.0, le=60.0, allow_inf_nan=False,
        description="time constant over which the predicted_wait_ms signal averages the requests "
        "in flight (0: the instant count; unset: twice the measured latency of one request "
        "alone): levels follow sustained load, the door every request",
    )
    preempt_waiting: bool = Field(
        default=True,
        description="a request the door would refuse takes the place of admitted requests of less "
        "important classes that the model has not started yet (they get 429 preempted)",
    )
    min_retry_after_s: int = Field(default=1, ge=1, le=3600)
    max_retry_after_s: int = Field(default=30, ge=1, le=3600)

    @model_validator(mode="before")
    @classmethod
    def _replaced(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "ramp_growth" in data:
            raise ValueError(
                f"ramp_growth: {data['ramp_growth']!r}: the ramp's multiplicative growth was replaced by "
                "ramp_step (requests added above the concurrency measured lately; default a fifth of the batch, "
                "0: no ramp)"
            )
        return data

    @model_validator(mode="after")
    def _retry_bounds(self) -> AdmissionConfig:
        if self.min_retry_after_s > self.max_retry_after_s:
            raise ValueError(
                f"min_retry_after_s: {self.min_retry_after_s} must not exceed "
                f"max_retry_after_s: {self.max_retry_after_s}"
            )
        return self


class DegradationConfig(_Strict):
    """The whole policy. Build it with `parse_policy` or `load_policy`."""

    level1: LevelConfig | None = None
    level2: LevelConfig | None = None
    level3: LevelConfig | None = None
    features: dict[str, FeatureConfig] = Field(default_factory=dict)
    recover_ratio: float = Field(
        default=DEFAULT_RECOVER_RATIO,
        gt=0.0,
        lt=1.0,
        description="default recover value as a fraction of the trigger value",
    )
    stale_after_s: float = Field(
        default=5.0, gt=0.0, description="a replica report older than this is ignored"
    )
    forget_after_s: float | None = Field(
        default=None,
        gt=0.0,
        allow_inf_nan=False,
        description="a replica silent this long is forgotten (a stale report until then); "
        ">= stale_after_s; default 60 s, or stale_after_s where that is longer",
    )
    flap_damping: FlapDampingConfig = Field(default_factory=FlapDampingConfig)
    slo: SloConfig | None = Field(default=None, description="latency objective; optional")
    admission: AdmissionConfig | None = Field(
        default=None, description="admission settings; needs an slo (defaults apply when absent)"
    )

    @property
    def forget_s(self) -> float:
        """``forget_after_s`` in force: as set, else 60 s or ``stale_after_s`` where longer."""
        return self.forget_after_s if self.forget_after_s is not None else max(60.0, self.stale_after_s)

    @field_validator("features")
    @classmethod
    def _feature_names_known(cls, value: dict[str, FeatureConfig]) -> dict[str, FeatureConfig]:
        for name, cfg in value.items():
            if name not in feat.REGISTRY:
                raise ValueError(
                    f"features: unknown feature {name!r}; valid: {', '.join(sorted(feat.REGISTRY))}"
                )
            spec = feat.REGISTRY[name]
            if cfg.mode not in spec.off_modes:
                supported = ", ".join(repr(m.value) for m in feat.OffMode if m in spec.off_modes)
                if cfg.mode is OffMode.DEFER and spec.stage is not feat.Stage.SIDE_EFFECT:
                    deferrable = ", ".join(n for n, s in feat.REGISTRY.items() if OffMode.DEFER in s.off_modes)
                    raise ValueError(
                        f"features.{name}.mode: 'defer' is only for side effects ({deferrable}); "
                        f"{name!r} runs on the request path and supports {supported}"
                    )
                raise ValueError(
                    f"features.{name}.mode: feature {name!r} does not support off-mode "
                    f"{cfg.mode.value!r}; it supports {supported}"
                )
            if cfg.critical is not None and cfg.critical != feat.is_critical(name):
                raise ValueError(
                    f"features.{name}.critical: {cfg.critical} contradicts the registry "
                    f"({feat.is_critical(name)})"
                )
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> DegradationConfig:
        if self.forget_after_s is not None and self.forget_after_s < self.stale_after_s:
            raise ValueError(
                f"forget_after_s: {self.forget_after_s:g} must be at least "
                f"stale_after_s: {self.stale_after_s:g} (a report goes stale before it is forgotten)"
            )
        if self.admission is not None and self.slo is None:
            raise ValueError("admission: needs an 'slo' section (e.g. slo: {e2e_p99_ms: 2000})")
        if self.slo is not None and self.admission is not None:
            if self.admission.overhead_ms >= self.slo.e2e_p99_ms:
                raise ValueError(
                    f"admission.overhead_ms: {self.admission.overhead_ms:g} must be below "
                    f"slo.e2e_p99_ms: {self.slo.e2e_p99_ms:g}"
                )
        # recover below trigger, recover names only trigger signals
        for key in LEVEL_KEYS:
            lvl: LevelConfig | None = getattr(self, key)
            if lvl is None:
                continue
            for name, value in lvl.recover.items():
                if name not in lvl.trigger:
                    raise ValueError(
                        f"{key}.recover.{name}: {value} has no trigger; "
                        f"signals with a trigger here: {', '.join(lvl.trigger) or 'none'}"
                    )
                if value >= lvl.trigger[name]:
                    raise ValueError(
                        f"{key}.recover.{name}: {value} must be below "
                        f"{key}.trigger.{name}: {lvl.trigger[name]}"
                    )
        # levels ascending per signal
        for lo_i, lo_key in enumerate(LEVEL_KEYS):
            lo: LevelConfig | None = getattr(self, lo_key)
            if lo is None:
                continue
            for hi_key in LEVEL_KEYS[lo_i + 1 :]:
                hi: LevelConfig | None = getattr(self, hi_key)
                if hi is None:
                    continue
                for name, value in hi.trigger.items():
                    if name in lo.trigger and value <= lo.trigger[name]:
                        raise ValueError(
                            f"{hi_key}.trigger.{name}: {value} must be above "
                            f"{lo_key}.trigger.{name}: {lo.trigger[name]} (levels ascend)"
                        )
        # shaping never loosens with the level: a cap at a higher level is at most a lower one's,
        # a stream's increments at least
        for name, grows, verb in (("max_tokens", False, "exceed"), ("stream_interval", True, "be below")):
            for lo_i, lo_key in enumerate(LEVEL_KEYS):
                lo = getattr(self, lo_key)
                low = None if lo is None else getattr(lo.shape, name)
                if low is None:
                    continue
                for hi_key in LEVEL_KEYS[lo_i + 1 :]:
                    hi = getattr(self, hi_key)
                    high = None if hi is None else getattr(hi.shape, name)
                    if high is not None and (high < low if grows else high > low):
                        raise ValueError(
                            f"{hi_key}.shape.{name}: {high} must not {verb} {lo_key}.shape.{name}: {low} "
                            "(a higher level never shapes less)"
                        )
        # a critical feature may not be disabled, by a list or by off_at
        for name, off in self.off_levels().items():
            if off is not None and feat.is_critical(name):
                raise ValueError(
                    f"feature {name!r} is critical and cannot be disabled (level{off}); "
                    f"critical: {', '.join(n for n, s in feat.REGISTRY.items() if s.critical)}"
                )
        return self

    # -- derived views (cheap, computed on demand; the config is frozen) ----------------------

    def level(self, level: int) -> LevelConfig | None:
        return getattr(self, LEVEL_KEYS[level - 1]) if 1 <= level <= 3 else None

    def trigger_thresholds(self, level: int) -> Mapping[str, float]:
        lvl = self.level(level)
        return lvl.trigger if lvl else {}

    def recover_thresholds(self, level: int) -> dict[str, float]:
        """Recover value per trigger signal, defaults filled in."""
        lvl = self.level(level)
        if lvl is None:
            return {}
        return {
            name: lvl.recover.get(name, value * self.recover_ratio)
            for name, value in lvl.trigger.items()
        }

    def off_levels(self) -> dict[str, int | None]:
        """Feature -> the lowest level that turns it off, from `disable` lists and `off_at`.

        None: never off. The lowest level wins because a feature off at level k is off above k.
        """
        result: dict[str, int | None] = {name: None for name in feat.REGISTRY}

        def lower(name: str, level: int) -> None:
            current = result[name]
            result[name] = level if current is None else min(current, level)

        for level, key in enumerate(LEVEL_KEYS, start=1):
            lvl = getattr(self, key)
            for alias in lvl.disable if lvl else ():
                for name in feat.expand(alias):
                    lower(name, level)
        for name, cfg in self.features.items():
            if cfg.off_at is not None:
                lower(name, cfg.off_at)
        return result

    def shape_at(self, level: int) -> ShapeConfig:
        """The shaping in force at ``level``, inherited upward from the levels below.

        ``max_tokens``: the cap of the highest level <= ``level`` that sets one (caps never grow
        with the level, so it is also the smallest); ``refuse``: every field refused at any level
        <= ``level``, in `REFUSABLE` order; ``stream_interval``: that of the highest level <=
        ``level`` that sets one (never shrinking with the level, so also the largest). Level 0
        (and any level below 1) never shapes.
        """
        cap: int | None = None
        interval: int | None = None
        refused: set[str] = set()
        for lv in range(1, min(level, len(LEVEL_KEYS)) + 1):
            lvl = self.level(lv)
            if lvl is None:
                continue
            if lvl.shape.max_tokens is not None:
                cap = lvl.shape.max_tokens
            if lvl.shape.stream_interval is not None:
                interval = lvl.shape.stream_interval
            refused.update(lvl.shape.refuse)
        return ShapeConfig(max_tokens=cap, refuse=[f for f in REFUSABLE if f in refused],
                           stream_interval=interval)

    def off_mode(self, feature: str) -> OffMode:
        cfg = self.features.get(feature)
        return cfg.mode if cfg else OffMode.SKIP

    def off_default(self, feature: str) -> Any:
        cfg = self.features.get(feature)
        return cfg.default if cfg else None

    def dwell_s(self, level: int) -> float:
        lvl = self.level(level)
        return lvl.recover_dwell_s if lvl else LevelConfig().recover_dwell_s

    def cooldown_s(self, level: int) -> float:
        lvl = self.level(level)
        return lvl.cooldown_s if lvl else LevelConfig().cooldown_s

    def escalate_after_s(self, level: int) -> float:
        lvl = self.level(level)
        return lvl.escalate_after_s if lvl else 0.0


class PolicyError(ValueError):
    """A policy document failed validation. The message names key, value and valid choices."""


def _format(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown key {loc.rsplit('.', 1)[-1]!r} (value {e.get('input')!r})"
        elif "input" in e and e["type"] not in ("value_error",) and not isinstance(
            e["input"], dict
        ):
            msg = f"{msg} (got {e['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_policy(document: Mapping[str, Any]) -> DegradationConfig:
    """Validate a policy document, wrapped in ``{"degradation": ...}`` or bare."""
    if not isinstance(document, Mapping):
        raise PolicyError(f"policy must be a mapping, got {type(document).__name__}")
    body = document.get("degradation", document) if "degradation" in document else document
    if "degradation" in document and len(document) > 1:
        others = sorted(k for k in document if k != "degradation")
        raise PolicyError(f"unknown top-level key(s) beside 'degradation': {others}")
    try:
        return DegradationConfig.model_validate(body)
    except ValidationError as err:
        raise PolicyError(_format(err)) from None


def load_policy(path: str | Path) -> DegradationConfig:
    """Read a ``.json`` or ``.yaml``/``.yml`` policy file (the only I/O in this module)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise PolicyError(f"{path.name}: not valid {path.suffix.lstrip('.')}: {err}") from None
    return parse_policy(doc or {})


DEFAULT_POLICY_PATH = Path(__file__).resolve().parent.parent / "configs" / "degradation.yaml"


def default_policy() -> DegradationConfig:
    return load_policy(DEFAULT_POLICY_PATH)


__all__ = [
    "AdmissionConfig",
    "CRITICALITIES",
    "ClassShares",
    "DEFAULT_RECOVER_RATIO",
    "DegradationConfig",
    "FeatureConfig",
    "FlapDampingConfig",
    "Level",
    "LevelConfig",
    "PolicyError",
    "REFUSABLE",
    "SIGNALS",
    "ShapeConfig",
    "SloConfig",
    "default_policy",
    "load_policy",
    "parse_policy",
]
