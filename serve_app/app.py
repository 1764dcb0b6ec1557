"""build_app(args) -> Application: the only place that binds deployments into the graph.

``serve_config.yaml`` names ``serve_app.app:build_app`` and gives ``args``, validated here by
`BrownoutArgs` before anything is bound: a bad key or value fails the deploy with a message
naming it. Per-deployment Serve options (replicas, CPUs, ``max_ongoing_requests``,
``max_queued_requests``) have deliberate defaults here and may be overridden per deployment in
``serve_config.yaml``'s ``deployments:`` section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from ray import serve
from ray.serve import Application
from ray.serve.config import DEFAULT_METRICS_INTERVAL_S  # Serve's push interval unless set (10 s)

from deployments.engine import EngineSettings
from deployments.enrichments.host import EnrichmentHost
from deployments.model import VLLMModel
from policies.config import DEFAULT_POLICY_PATH, parse_policy
from policies.slo import fit_policy
from serve_app.ingress import Ingress, IngressLimits, PipelineSettings
from serve_app.security import AuthSettings

EMBEDDED_MODEL = "embedded:tiny"


class ModelAutoscaling(BaseModel):
    """``model.autoscaling``: the model deployment autoscales on its queue and on the refusals
    at the door, with Brownout's policy function (`deployments.autoscaling`; the rule and how it
    and degradation avoid fighting: `policies.autoscale`). Absent: one model replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=1, ge=1, description="never below (no scale to zero: a model "
                              "replica takes tens of seconds to minutes to start)")
    max_replicas: int = Field(ge=1, description="never above")
    target_ongoing_requests: float | None = Field(
        default=None, gt=0, description="requests running or queued per replica to aim for; "
        "default max_num_seqs (one full batch per replica)")
    upscale_delay_s: float = Field(default=5.0, ge=0, allow_inf_nan=False)
    downscale_delay_s: float = Field(default=120.0, ge=0, allow_inf_nan=False)
    metrics_interval_s: float = Field(
        default=DEFAULT_METRICS_INTERVAL_S, gt=0, allow_inf_nan=False,
        description="how often the model replicas and the handles calling them push their queue to "
        "Serve's autoscaler (Serve's autoscaling_config.metrics_interval_s, 10 s by default). Serve "
        "marks the field deprecated in favour of RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S, "
        "but Ray 2.60 defines that variable and never reads it: this field is the interval in force")
    look_back_period_s: float = Field(
        default=15.0, gt=0, allow_inf_nan=False,
        description="the window Serve averages ongoing requests over; above metrics_interval_s")

    @field_validator("look_back_period_s")
    @classmethod
    def _above_the_push_interval(cls, v: float, info: ValidationInfo) -> float:
        # Serve averages the queue the replicas push over this window; at or below the push
        # interval it holds one push or none (Serve itself only warns, and says a later release
        # will refuse it). A metrics_interval_s that failed its own check is reported on its own.
        push = info.data.get("metrics_interval_s")
        if push is not None and v <= push:
            raise ValueError(f"look_back_period_s={v:g} must be above metrics_interval_s={push:g}, the interval at "
                             "which the replicas push their queue: the window would hold one push or none")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> ModelAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas={self.max_replicas} must be >= min_replicas={self.min_replicas}")
        return self

    def serve_config(self, max_num_seqs: int) -> dict[str, Any]:
        """Serve's ``autoscaling_config`` for the model deployment."""
        from deployments.autoscaling import POLICY_FUNCTION

        target = self.target_ongoing_requests if self.target_ongoing_requests is not None else max_num_seqs
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": float(target),
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "metrics_interval_s": self.metrics_interval_s,
            "look_back_period_s": self.look_back_period_s,
            "policy": {"policy_function": POLICY_FUNCTION},
        }


class ModelArgs(EngineSettings):
    """The ``model:`` args: the engine's settings (`EngineSettings`: one home for those options
    and their defaults), plus where the model comes from (``source``) and the API's view of it."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False)

    # `EngineSettings.model`, read from the key ``source`` (before it is resolved to a folder)
    model: str = Field(
        default=EMBEDDED_MODEL,
        alias="source",
        min_length=1,
        description=f"'{EMBEDDED_MODEL}' (built locally, offline), a local model folder, or a Hugging Face id",
    )
    served_model_name: str = Field(default="brownout-tiny", min_length=1)
    max_prompt_tokens: int = Field(default=768, ge=1)
    autoscaling: ModelAutoscaling | None = Field(
        default=None, description="autoscale the model deployment (absent: one replica)")

    @model_validator(mode="after")
    def _room_to_generate(self) -> ModelArgs:
        if self.max_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"max_prompt_tokens={self.max_prompt_tokens} must be below "
                f"max_model_len={self.max_model_len}: no room would be left to generate"
            )
        return self

    @property
    def source(self) -> str:
        return self.model

    def engine(self) -> EngineSettings:
        """The engine's settings, the model source resolved to a folder (built on first use)."""
        fields = {name: getattr(self, name) for name in EngineSettings.model_fields}
        return EngineSettings(**{**fields, "model": resolve_model_source(self.model)})


class EnrichmentArgs(BaseModel):
    """The optional-work graph. State paths default to folders under ``data_dir``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="run the optional features (and their deployments) at all")
    data_dir: str = Field(default="~/.cache/brownout/state", description="audit log, spool, SQLite, debug")
    settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per worker kind, its typed settings (each Worker.settings)"
    )


def default_policy_document() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(DEFAULT_POLICY_PATH.read_text())


class BrownoutArgs(BaseModel):
    """Builder args, as written under ``args:`` in serve_config.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelArgs = Field(default_factory=ModelArgs)
    limits: IngressLimits = Field(default_factory=IngressLimits)
    enrichments: EnrichmentArgs = Field(default_factory=EnrichmentArgs)
    pipeline: PipelineSettings = Field(default_factory=PipelineSettings)
    auth: AuthSettings = Field(
        default_factory=AuthSettings,
        description="API keys (required unless set to 'disabled'), per-key rate limits, the admin token",
    )
    policy: dict[str, Any] | None = Field(
        default=None,
        description="initial policy (the Ingress user_config); default configs/degradation.yaml. "
        "serve_config.yaml sets it as the Ingress deployment's user_config for hot reload.",
    )


def resolve_model_source(source: str) -> str:
    if source == EMBEDDED_MODEL:
        from deployments.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    return source


def build_app(args: BrownoutArgs) -> Application:
    """The Brownout graph: Ingress -> (enrichment deployments) -> VLLMModel."""
    args = BrownoutArgs.model_validate(args or {}) if not isinstance(args, BrownoutArgs) else args
    m = args.model
    model = serve.deployment(
        VLLMModel,
        name="VLLMModel",
        # vLLM batches up to max_num_seqs; twice that in flight keeps the batch full while
        # the next requests wait inside vLLM, where a disconnect can still abort them.
        max_ongoing_requests=2 * m.max_num_seqs,
        # Per caller (each ingress replica). Beyond this the handle raises BackPressureError
        # and the client gets an immediate 503 + Retry-After instead of an unbounded wait.
        max_queued_requests=2 * m.max_num_seqs,
        ray_actor_options={"num_cpus": 1},
        health_check_period_s=10,
        health_check_timeout_s=30,
        **({} if m.autoscaling is None else {"autoscaling_config": m.autoscaling.serve_config(m.max_num_seqs)}),
    ).bind(
        engine_settings=m.engine(),
        served_model_name=m.served_model_name,
        max_prompt_tokens=m.max_prompt_tokens,
    )
    from deployments.enrichments.registry import features, hosts, workers

    policy = args.policy if args.policy is not None else default_policy_document()
    # fail the deploy now, naming key and value, if the policy is invalid or cannot fire here
    fit_policy(parse_policy(policy), m.max_num_seqs)
    handles: dict[str, Any] = {}
    local: dict[str, dict[str, Any]] = {}
    if args.enrichments.enabled:
        feats = features()
        known = workers(feats)
        unknown = sorted(set(args.enrichments.settings) - set(known))
        if unknown:
            raise ValueError(f"enrichments.settings: unknown kind(s) {unknown}; valid: {sorted(known)}")
        data_dir = Path(args.enrichments.data_dir)

        def settings(kind: str) -> dict[str, Any]:
            return known[kind].resolve(args.enrichments.settings.get(kind, {}), data_dir)

        # Where each feature runs is its Worker's choice: its own deployment, or (host None) the
        # ingress process. One EnrichmentHost deployment per host named.
        for host, ws in hosts(feats).items():
            if host is None:
                local = {w.kind: settings(w.kind) for w in ws}
                continue
            handles[host] = serve.deployment(
                EnrichmentHost,
                name=host,
                # optional work: bounded like everything else; its own timeout bypasses it
                max_ongoing_requests=64,
                max_queued_requests=128,
                ray_actor_options={"num_cpus": 0},
            ).bind(kinds={w.kind: settings(w.kind) for w in ws})
    ingress = serve.deployment(
        Ingress,
        name="Ingress",
        # The ingress only parses and forwards: it must never be the bottleneck, and it takes
        # no CPU reservation so the graph schedules on 2 cores.
        max_ongoing_requests=256,
        max_queued_requests=256,
        ray_actor_options={"num_cpus": 0},
        user_config={"policy": policy},
    ).bind(
        model,
        served_model_name=m.served_model_name,
        limits=args.limits,
        enrichments=handles,
        local_workers=local,
        pipeline=args.pipeline,
        spool_dir=str(Path(args.enrichments.data_dir).expanduser() / "spool"),
        auth=args.auth,
        model_slots=m.max_num_seqs,
        stream_interval=m.stream_interval,
    )
    return ingress
