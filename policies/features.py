"""The feature registry: which work Brownout may switch off, and when it is on.

A *feature* is a named piece of request-path work. Critical features (auth, rate limiting, the
model's forward pass, basic pre/post-processing) are registered so that config can name them and
be rejected for trying to disable them; optional features are what the levels switch off.

`enabled(feature, level, plan, overrides)` is the single rule every reader uses:

1. a feature override (forced on or off by an operator) wins;
2. a critical feature is always on;
3. otherwise the feature is on while ``level < off_level`` (``off_level`` None: never off).

Because the rule is ``level < off_level``, a feature disabled at level k stays disabled at every
higher level: monotonicity holds by construction, not by convention.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


class Level(enum.IntEnum):
    """Degradation level. Higher sheds more optional work."""

    NORMAL = 0
    LIGHT = 1  # least harmful cuts: debug capture, cache writes, light metrics
    AUXILIARY = 2  # auxiliary computation: personalization, A/B routing, feature stats
    MINIMAL = 3  # minimal path: only the model and the most basic response


MAX_LEVEL = Level.MINIMAL


class OffMode(str, enum.Enum):
    """What a disabled feature does instead of its work."""

    SKIP = "skip"  # do nothing; the stage's output is absent
    DEFAULT = "default"  # return a configured value instead (e.g. an empty list)
    DEFER = "defer"  # spool the work durably; run it, in order, once the level allows


class Stage(str, enum.Enum):
    """Where in the request a feature runs."""

    CORE = "core"  # the critical path itself
    PRE = "pre"  # before the model call; may change the request
    POST = "post"  # after the model call; may change the response
    SIDE_EFFECT = "side_effect"  # after the response; never on the client's critical path


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    stage: Stage
    critical: bool
    description: str


_SPECS: tuple[FeatureSpec, ...] = (
    # Core: registered so that config naming them is recognised, and rejected if disabled.
    FeatureSpec("auth", Stage.CORE, True, "API-key authentication"),
    FeatureSpec("rate_limit", Stage.CORE, True, "per-key request rate limiting"),
    FeatureSpec("preprocess", Stage.CORE, True, "input validation and chat-template rendering"),
    FeatureSpec("model", Stage.CORE, True, "the model's forward pass (vLLM)"),
    FeatureSpec("postprocess", Stage.CORE, True, "basic response shaping (OpenAI JSON)"),
    # Optional, in the order the ingress runs them.
    FeatureSpec("prompt_rewrite", Stage.PRE, False, "optional prompt enhancement"),
    FeatureSpec("personalization", Stage.PRE, False, "profile-driven system prompt and sampling"),
    FeatureSpec("ab_test", Stage.PRE, False, "A/B experiment routing by user hash"),
    FeatureSpec("semantic_cache_lookup", Stage.PRE, False, "answer from the semantic cache"),
    FeatureSpec("response_polish", Stage.POST, False, "optional response post-processing"),
    FeatureSpec("semantic_cache_write", Stage.SIDE_EFFECT, False, "store answers in the cache"),
    FeatureSpec("audit_log", Stage.SIDE_EFFECT, False, "fsync'd request/response audit log"),
    FeatureSpec("feature_stats", Stage.SIDE_EFFECT, False, "per-user/per-variant statistics"),
    FeatureSpec("debug_capture", Stage.SIDE_EFFECT, False, "rendered prompt + params to disk"),
    FeatureSpec("light_metrics", Stage.SIDE_EFFECT, False, "non-essential per-user counters"),
)

REGISTRY: Mapping[str, FeatureSpec] = {spec.name: spec for spec in _SPECS}

# Group names accepted wherever config lists features to disable. "semantic_cache" is the whole
# cache (the reference design's level-1 "semantic_cache"); "debug_log" is the reference design's
# name for debug capture. "all_non_critical" expands at validation time to every optional feature.
ALL_NON_CRITICAL = "all_non_critical"
ALIASES: Mapping[str, tuple[str, ...]] = {
    "semantic_cache": ("semantic_cache_lookup", "semantic_cache_write"),
    "debug_log": ("debug_capture",),
    ALL_NON_CRITICAL: tuple(s.name for s in _SPECS if not s.critical),
}


def known_names() -> list[str]:
    """Every name config may use: registered features and group aliases, sorted."""
    return sorted({*REGISTRY, *ALIASES})


def expand(name: str) -> tuple[str, ...]:
    """Resolve a feature or alias name to registered feature names; KeyError if unknown."""
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
