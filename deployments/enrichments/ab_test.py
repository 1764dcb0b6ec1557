"""ABTest: deterministic assignment of users to the arms of one prompt experiment.

Rule: ``bucket = int(sha256(f"{experiment}:{user}").hexdigest(), 16) % total_weight``; the arm is
the one whose cumulative-weight interval holds the bucket. A user therefore keeps their arm
across requests, replicas and restarts, and a new experiment name reshuffles everyone. A request
without a user gets ``control``. When the pipeline bypasses the stage it tags the request
``EXCLUDED`` instead, so excluded traffic never pollutes either arm's statistics.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.enrichments.base import Enrichment
from deployments.enrichments.feature import Feature, RequestState, Worker

CONTROL = "control"
EXCLUDED = "excluded"

DEFAULT_VARIANTS: tuple[dict[str, Any], ...] = (
    {"name": CONTROL, "weight": 50},
    {
        "name": "concise",
        "weight": 50,
        "system_suffix": "Answer in one short paragraph.",
        "sampling": {"temperature": 0.7},
    },
)
_VARIANT_KEYS = {"name", "weight", "system_suffix", "sampling"}


def validate_variants(variants: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check ``variants`` and return plain copies; ValueError names the offending variant."""
    if not variants:
        raise ValueError("variants must not be empty")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, v in enumerate(variants):
        if not isinstance(v, Mapping):
            raise ValueError(f"variant #{i} must be a mapping, got {v!r}")
        name = v.get("name")
        label = f"variant #{i} ({name!r})"
        if not isinstance(name, str) or not name:
            raise ValueError(f"{label}: name must be a non-empty string")
        if name == EXCLUDED:
            raise ValueError(f"{label}: {EXCLUDED!r} is reserved for bypassed requests")
        if name in seen:
            raise ValueError(f"{label}: duplicate variant name {name!r}")
        seen.add(name)
        extra = set(v) - _VARIANT_KEYS
        if extra:
            raise ValueError(f"{label}: unknown keys {sorted(extra)}; allowed: {sorted(_VARIANT_KEYS)}")
        weight = v.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or weight <= 0:
            raise ValueError(f"{label}: weight must be a positive integer, got {weight!r}")
        if "system_suffix" in v and not isinstance(v["system_suffix"], str):
            raise ValueError(f"{label}: system_suffix must be a string, got {v['system_suffix']!r}")
        if "sampling" in v and not isinstance(v["sampling"], Mapping):
            raise ValueError(f"{label}: sampling must be a mapping, got {v['sampling']!r}")
        out.append({**v, **({"sampling": dict(v["sampling"])} if "sampling" in v else {})})
    if CONTROL not in seen:
        raise ValueError(f"variants must include one named {CONTROL!r}; got {sorted(seen)}")
    return out


def bucket(experiment: str, user: str, total_weight: int) -> int:
    return int(hashlib.sha256(f"{experiment}:{user}".encode()).hexdigest(), 16) % total_weight


DEFAULT_EXPERIMENT = "prompt-style-v1"


class ABTest(Enrichment):
    features = ("ab_test",)

    def __init__(
        self, experiment: str = DEFAULT_EXPERIMENT, variants: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        super().__init__()
        if not experiment:
            raise ValueError("experiment must be a non-empty string")
        self.experiment = experiment
        self.variants = validate_variants(DEFAULT_VARIANTS if variants is None else variants)
        self._bounds = list(itertools.accumulate(v["weight"] for v in self.variants))
        self._control = next(v for v in self.variants if v["name"] == CONTROL)
        self._assigned: Counter[str] = Counter()

    def assign(self, user: str | None) -> dict[str, Any]:
        """The variant for ``user`` (control when there is no user)."""
        if not user:
            return self._control
        return self.variants[bisect.bisect_right(self._bounds, bucket(self.experiment, user, self._bounds[-1]))]

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        user = payload.get("user")
        variant = self.assign(user if isinstance(user, str) else None)
        self._assigned[variant["name"]] += 1
        out: dict[str, Any] = {"experiment": self.experiment, "variant": variant["name"]}
        if "system_suffix" in variant:
            out["system_suffix"] = variant["system_suffix"]
        if "sampling" in variant:
            out["sampling"] = dict(variant["sampling"])
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "experiment": self.experiment,
            "assignments": {v["name"]: self._assigned.get(v["name"], 0) for v in self.variants},
        }


class ABTestSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    experiment: str = Field(default=DEFAULT_EXPERIMENT, min_length=1, description="the experiment's name")
    variants: list[dict[str, Any]] | None = Field(default=None, description="arms; None: DEFAULT_VARIANTS")


def _tag(request: RequestState, experiment: str | None, variant: str) -> None:
    request.tags["experiment"], request.tags["variant"] = experiment, variant
    if experiment:
        request.headers_out["X-Brownout-Experiment"] = f"{experiment}={variant}"


def _apply(request: RequestState, result: Mapping[str, Any]) -> None:
    variant = result.get("variant", CONTROL)
    _tag(request, result.get("experiment"), variant)
    request.add_system(result.get("system_suffix", ""), prepend=False)
    request.fill_sampling(result.get("sampling"))
    if variant != CONTROL:
        request.personal = True  # a treatment arm's answer is not the text's own answer


def _bypassed(request: RequestState, settings: Mapping[str, Any]) -> None:
    # The control arm's behaviour, and out of the experiment's analysis.
    _tag(request, settings.get("experiment", DEFAULT_EXPERIMENT), EXCLUDED)


# A hash of the user id: pure and cheap, so it runs inside the ingress process (no RPC).
WORKER = Worker("ab_test", ABTest, host=None, settings=ABTestSettings)
AB_TEST = Feature("ab_test", WORKER, payload=lambda r: {"user": r.user, "request_id": r.request_id},
                  apply=_apply, on_bypass=_bypassed)
