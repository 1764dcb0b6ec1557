"""The feature registry: which work Brownout may switch off, and when it is on.

A *feature* is a named piece of request-path work. Critical features (auth, rate limiting, the
model's forward pass, basic pre/post-processing) are registered so that config can name them and
be rejected for trying to disable them; optional features are what the levels switch off.

Each optional feature is registered here by ONE line, a `FeatureSpec`: the facts the pure policy
core needs to validate a config in any process (the policy actor and the trace simulator load
no feature code): its name, stage, which off-modes it supports, and ``impl``, the
``module:attribute`` of its implementation (a `deployments.enrichments.feature.Feature`, which
owns where it runs, its settings, its payload and how its result is applied). Nothing here
imports that module: the application resolves ``impl`` when it builds the pipeline.

`enabled(feature, level, plan, overrides)` is the single rule every reader uses:

1. a feature override (forced on or off by an operator) wins;
2. a critical feature is always on;
3. otherwise the feature is on while ``level < off_level`` (``off_level`` None: never off).

Because the rule is ``level < off_level``, a feature disabled at level k stays disabled at every
higher level: monotonicity holds by construction, not by convention.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass


class Level(enum.IntEnum):
    """Degradation level. Higher sheds more optional work."""

    NORMAL = 0
    LIGHT = 1  # least harmful cuts: debug capture, cache writes, light metrics
    AUXILIARY = 2  # auxiliary computation: personalization, A/B routing, feature stats
    MINIMAL = 3  # minimal path: only the model and the most basic response


class OffMode(str, enum.Enum):
    """What a disabled feature does instead of its work."""

    SKIP = "skip"  # do nothing; the stage's output is absent
    DEFAULT = "default"  # a configured result stands in for the stage's (pre stages)
    DEFER = "defer"  # spool the work durably; run it, in order, once the level allows (side effects)


class Stage(str, enum.Enum):
    """Where in the request a feature runs."""

    CORE = "core"  # the critical path itself
    PRE = "pre"  # before the model call; may change the request
    POST = "post"  # after the model call; may change the response
    SIDE_EFFECT = "side_effect"  # after the response; never on the client's critical path


SKIP_ONLY = frozenset({OffMode.SKIP})


@dataclass(frozen=True)
class FeatureSpec:
    """One registered feature: what the policy core knows of it.

    ``off_modes``: the off-modes it supports (a config asking for another is rejected at load).
    ``impl``: ``"package.module:ATTRIBUTE"`` of its implementation; None for critical features.
    """

    name: str
    stage: Stage
    critical: bool
    description: str
    off_modes: frozenset[OffMode] = SKIP_ONLY
    impl: str | None = None

    def __post_init__(self) -> None:
        if OffMode.SKIP not in self.off_modes:
            raise ValueError(f"feature {self.name!r}: every feature must support 'skip'")
        if OffMode.DEFER in self.off_modes and self.stage is not Stage.SIDE_EFFECT:
            raise ValueError(f"feature {self.name!r}: only side effects can be deferred")
        if OffMode.DEFAULT in self.off_modes and self.stage is not Stage.PRE:
            raise ValueError(f"feature {self.name!r}: only pre stages have a result a default can stand in for")
        if self.critical == (self.impl is not None):
            raise ValueError(f"feature {self.name!r}: an optional feature needs an impl, a critical one has none")


def _core(name: str, description: str) -> FeatureSpec:
    return FeatureSpec(name, Stage.CORE, True, description)


def _optional(name: str, stage: Stage, description: str, impl: str,
              off_modes: frozenset[OffMode] = SKIP_ONLY) -> FeatureSpec:
    return FeatureSpec(name, stage, False, description, frozenset(off_modes), impl)


_E = "deployments.enrichments."
_SPECS: tuple[FeatureSpec, ...] = (
    # Core: registered so that config naming them is recognised, and rejected if disabled.
    _core("auth", "API-key authentication"),
    _core("rate_limit", "per-key request rate limiting"),
    _core("preprocess", "input validation and chat-template rendering"),
    _core("model", "the model's forward pass (vLLM)"),
    _core("postprocess", "basic response shaping (OpenAI JSON)"),
    # Optional, in the order the ingress runs them: one line per feature.
    _optional("prompt_rewrite", Stage.PRE, "optional prompt enhancement", _E + "enhance:PROMPT_REWRITE"),
    _optional("personalization", Stage.PRE, "profile-driven system prompt and sampling",
              _E + "personalization:PERSONALIZATION", frozenset({OffMode.SKIP, OffMode.DEFAULT})),
    _optional("ab_test", Stage.PRE, "A/B experiment routing by user hash", _E + "ab_test:AB_TEST"),
    _optional("semantic_cache_lookup", Stage.PRE, "answer from the semantic cache", _E + "semantic_cache:LOOKUP"),
    _optional("response_polish", Stage.POST, "optional response post-processing", _E + "enhance:RESPONSE_POLISH"),
    _optional("semantic_cache_write", Stage.SIDE_EFFECT, "store answers in the cache", _E + "semantic_cache:WRITE"),
    _optional("audit_log", Stage.SIDE_EFFECT, "fsync'd request/response audit log", _E + "audit_log:AUDIT_LOG",
              frozenset({OffMode.SKIP, OffMode.DEFER})),
    _optional("feature_stats", Stage.SIDE_EFFECT, "per-user/per-variant statistics", _E + "telemetry:FEATURE_STATS",
              frozenset({OffMode.SKIP, OffMode.DEFER})),
    _optional("debug_capture", Stage.SIDE_EFFECT, "rendered prompt + params to disk", _E + "telemetry:DEBUG_CAPTURE"),
    _optional("light_metrics", Stage.SIDE_EFFECT, "non-essential per-user counters", _E + "telemetry:LIGHT_METRICS"),
)

# The live registry, in run order. Only `register` (tests, plugins) adds to it.
REGISTRY: dict[str, FeatureSpec] = {spec.name: spec for spec in _SPECS}

# Group names accepted wherever config lists features to disable. "semantic_cache" is the whole
# cache (the reference design's level-1 "semantic_cache"); "debug_log" is the reference design's
# name for debug capture. "all_non_critical" expands at validation time to every optional feature.
ALL_NON_CRITICAL = "all_non_critical"
# What each level turns off in a policy that does not say (the reference design's grouping:
# the least harmful cuts, then auxiliary computation, then everything optional).
DEFAULT_DISABLE: tuple[tuple[str, ...], ...] = (
    ("semantic_cache_write", "debug_capture", "light_metrics"),
    ("personalization", "ab_test", "feature_stats"),
    (ALL_NON_CRITICAL,),
)
ALIASES: Mapping[str, tuple[str, ...]] = {
    "semantic_cache": ("semantic_cache_lookup", "semantic_cache_write"),
    "debug_log": ("debug_capture",),
    ALL_NON_CRITICAL: tuple(s.name for s in _SPECS if not s.critical),  # the built-in ones; see expand
}


def optional_names() -> tuple[str, ...]:
    """Every optional feature, in registry (run) order."""
    return tuple(n for n, s in REGISTRY.items() if not s.critical)


@contextmanager
def registered(spec: FeatureSpec) -> Iterator[FeatureSpec]:
    """Register ``spec`` for the duration of the block (a plugin or a test's toy feature)."""
    if spec.name in REGISTRY or spec.name in ALIASES or spec.name == ALL_NON_CRITICAL:
        raise ValueError(f"feature {spec.name!r} is already registered")
    REGISTRY[spec.name] = spec
    try:
        yield spec
    finally:
        REGISTRY.pop(spec.name, None)


def known_names() -> list[str]:
    """Every name config may use: registered features and group aliases, sorted."""
    return sorted({*REGISTRY, *ALIASES})


def expand(name: str) -> tuple[str, ...]:
    """Resolve a feature or alias name to registered feature names; KeyError if unknown."""
    if name == ALL_NON_CRITICAL:  # every optional feature registered now, plugins included
        return optional_names()
    if name in ALIASES:
        return ALIASES[name]
    if name in REGISTRY:
        return (name,)
    raise KeyError(name)


def is_critical(name: str) -> bool:
    return REGISTRY[name].critical


@dataclass(frozen=True)
class FeatureOverride:
    """An operator's forced state for one feature, until ``expires_at`` (None: until cleared)."""

    feature: str
    enabled: bool
    expires_at: float | None = None

    def active(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


def enabled(
    feature: str,
    level: int,
    off_levels: Mapping[str, int | None],
    overrides: Mapping[str, FeatureOverride] | None = None,
) -> bool:
    """Whether ``feature`` runs at ``level``. See the module docstring for the rule.

    ``off_levels`` maps feature name to the level that turns it off (absent or None: never).
    ``overrides`` must already be purged of expired entries (the controller does that).
    """
    spec = REGISTRY.get(feature)
    if spec is None:
        raise KeyError(f"unknown feature {feature!r}; known: {', '.join(sorted(REGISTRY))}")
    if overrides and feature in overrides:
        return overrides[feature].enabled
    if spec.critical:
        return True
    off = off_levels.get(feature)
    return off is None or level < off


def enabled_set(
    level: int,
    off_levels: Mapping[str, int | None],
    overrides: Mapping[str, FeatureOverride] | None = None,
) -> frozenset[str]:
    """Every registered feature that runs at ``level``."""
    return frozenset(f for f in REGISTRY if enabled(f, level, off_levels, overrides))


@dataclass(frozen=True)
class PolicyView:
    """What a request path needs of the policy, small and typed: it crosses from the policy
    actor to every ingress replica (pickled by Ray) every refresh.

    ``enabled``: every feature that runs now. ``modes``: the off-mode of each feature whose mode
    is not ``skip``. ``defaults``: the configured result of each ``default``-mode feature.
    ``at``: the actor's clock when the view was taken.
    """

    level: Level = Level.NORMAL
    enabled: frozenset[str] = frozenset()
    modes: Mapping[str, OffMode] = None  # type: ignore[assignment]
    defaults: Mapping[str, Mapping[str, object]] = None  # type: ignore[assignment]
    config_version: int = 0
    at: float = 0.0
    # replicas reporting fresh signals, per deployment (`policies.signals.Signals.replicas`): the
    # ingress sizes its share of the model's batch with it
    replicas: Mapping[str, int] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", Level(self.level))
        object.__setattr__(self, "enabled", frozenset(self.enabled))
        object.__setattr__(self, "modes", {f: OffMode(m) for f, m in (self.modes or {}).items()})
        object.__setattr__(self, "defaults", dict(self.defaults or {}))
        object.__setattr__(self, "replicas", dict(self.replicas or {}))

    @classmethod
    def all_on(cls) -> PolicyView:
        """Every registered feature on at level 0: an ingress's view before its first refresh."""
        return cls(enabled=frozenset(REGISTRY))

    def mode(self, feature: str) -> OffMode:
        return self.modes.get(feature, OffMode.SKIP)

    def to_dict(self) -> dict[str, object]:
        return {"level": int(self.level), "enabled": sorted(self.enabled),
                "modes": {f: m.value for f, m in sorted(self.modes.items())},
                "defaults": dict(self.defaults), "config_version": self.config_version, "at": self.at,
                "replicas": dict(self.replicas)}
