"""The features' implementations, resolved from the registry, and what runs where.

`policies.features.REGISTRY` has one line per optional feature; its ``impl`` names the
`Feature` object (``"module:ATTRIBUTE"``). `features()` imports them, in registry order, and
checks them: the attribute must be a `Feature` of that name, and features sharing a worker kind
must share the same `Worker`. `workers()` and `hosts()` derive the rest: which plain objects
exist, and which Serve deployment (or the ingress process) holds each.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from deployments.enrichments.base import Enrichment
from deployments.enrichments.feature import Feature, Worker
from policies.features import REGISTRY


def resolve(impl: str) -> Feature:
    """The `Feature` at ``"module:ATTRIBUTE"``."""
    module, _, attribute = impl.partition(":")
    found = getattr(importlib.import_module(module), attribute, None)
    if not isinstance(found, Feature):
        raise TypeError(f"{impl!r} is not a Feature: {found!r}")
    return found


def features(names: Iterable[str] | None = None) -> tuple[Feature, ...]:
    """The implementation of every registered optional feature (or of ``names``), in run order."""
    wanted = None if names is None else set(names)
    out = []
    for name, spec in REGISTRY.items():
        if spec.critical or (wanted is not None and name not in wanted):
            continue
        assert spec.impl is not None
        feature = resolve(spec.impl)
        if feature.name != name:
            raise ValueError(f"registry entry {name!r} points at {spec.impl!r}, the feature {feature.name!r}")
        if name not in feature.worker.cls.features:
            raise ValueError(f"feature {name!r}: its worker {feature.worker.cls.__name__} does not serve it")
        out.append(feature)
    workers(out)  # raises if two features disagree about a shared worker
    return tuple(out)


def workers(feats: Iterable[Feature]) -> dict[str, Worker]:
    """Worker kind -> `Worker`, once each."""
    out: dict[str, Worker] = {}
    for f in feats:
        seen = out.setdefault(f.worker.kind, f.worker)
        if seen != f.worker:
            raise ValueError(f"worker kind {f.worker.kind!r} is declared twice, differently ({f.name!r})")
    return out


def hosts(feats: Iterable[Feature]) -> dict[str | None, tuple[Worker, ...]]:
    """Where each worker runs: Serve deployment name (None: the ingress process) -> workers."""
    out: dict[str | None, list[Worker]] = {}
    for worker in workers(feats).values():
        out.setdefault(worker.host, []).append(worker)
    return {host: tuple(ws) for host, ws in out.items()}


def build(kind: str, settings: Mapping[str, Any]) -> Enrichment:
    """Construct the worker ``kind`` from settings; ValueError names the kind, key and value."""
    known = workers(features())
    worker = known.get(kind)
    if worker is None:
        raise ValueError(f"unknown enrichment kind {kind!r}; valid kinds: {', '.join(sorted(known))}")
    return worker.build(settings)
