"""The explicit registry of enrichment kinds, and `build`, which makes one from config settings.

``ENRICHMENTS`` maps a kind name to its class; ``SETTINGS`` lists, per kind, the keys a config
may set (plain JSON values; paths as strings). Objects that are not config (an embedder, a
clock) are left at their defaults by `build` and passed directly by tests. ``FEATURE_TO_KIND``
maps every optional feature in `policies.features.REGISTRY` to the one kind that serves it; the
import fails if a feature is served by none or by two.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deployments.enrichments.ab_test import ABTest
from deployments.enrichments.audit_log import AuditLog
from deployments.enrichments.base import Enrichment
from deployments.enrichments.enhance import Enhance
from deployments.enrichments.personalization import Personalization
from deployments.enrichments.semantic_cache import SemanticCache
from deployments.enrichments.telemetry import Telemetry
from policies.features import REGISTRY

ENRICHMENTS: dict[str, type[Enrichment]] = {
    "semantic_cache": SemanticCache,
    "audit_log": AuditLog,
    "personalization": Personalization,
    "ab_test": ABTest,
    "telemetry": Telemetry,
    "enhance": Enhance,
}

SETTINGS: dict[str, frozenset[str]] = {
    "semantic_cache": frozenset({"similarity_threshold", "ttl_s", "max_entries"}),
    "audit_log": frozenset({"directory", "max_bytes", "backups", "filename"}),
    "personalization": frozenset({"db_path", "seed_demo", "demo_users"}),
    "ab_test": frozenset({"experiment", "variants"}),
    "telemetry": frozenset({"debug_dir", "max_debug_files", "reservoir_size", "max_keys", "top_n", "seed"}),
    "enhance": frozenset({"system_prompt"}),
}
PATH_SETTINGS = frozenset({"directory", "db_path", "debug_dir"})


def _feature_to_kind() -> dict[str, str]:
    served: dict[str, list[str]] = {}
    for kind, cls in ENRICHMENTS.items():
        for feature in cls.features:
            served.setdefault(feature, []).append(kind)
    optional = {name for name, spec in REGISTRY.items() if not spec.critical}
    problems = [f"{f!r} is served by no kind" for f in sorted(optional - set(served))]
    problems += [f"{f!r} is not an optional feature" for f in sorted(set(served) - optional)]
    problems += [f"{f!r} is served by {kinds}" for f, kinds in sorted(served.items()) if len(kinds) > 1]
    if problems:
        raise RuntimeError("enrichment registry out of step with policies.features: " + "; ".join(problems))
    return {f: kinds[0] for f, kinds in served.items()}


FEATURE_TO_KIND: dict[str, str] = _feature_to_kind()


def build(kind: str, settings: Mapping[str, Any]) -> Enrichment:
    """Construct the enrichment ``kind`` from config ``settings``.

    ValueError for an unknown kind, an unknown settings key, or a missing required one.
    """
    cls = ENRICHMENTS.get(kind)
    if cls is None:
        raise ValueError(f"unknown enrichment kind {kind!r}; valid kinds: {', '.join(sorted(ENRICHMENTS))}")
    allowed = SETTINGS[kind]
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(map(repr, unknown))} for enrichment kind {kind!r}; "
            f"allowed: {', '.join(sorted(allowed)) or '(none)'}"
        )
    params = inspect.signature(cls).parameters
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in settings]
    if missing:
        raise ValueError(f"enrichment kind {kind!r} needs setting(s) {', '.join(map(repr, missing))}")
    kwargs = {k: Path(v) if k in PATH_SETTINGS else v for k, v in settings.items()}
    return cls(**kwargs)
