"""A toy optional feature, registered only by tests: proof that a feature is one module plus one
registry line. It stamps the request with a header and a record tag, inside the ingress process."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deployments.enrichments.base import Enrichment
from deployments.enrichments.feature import Feature, RequestState, Worker
from policies.features import FeatureSpec, OffMode, Stage


class Stamp(Enrichment):
    features = ("toy_stamp",)

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        return {"stamp": f"stamped:{payload['request_id']}"}


def _apply(request: RequestState, result: Mapping[str, Any]) -> None:
    request.headers_out["X-Toy-Stamp"] = result["stamp"]
    request.tags["stamp"] = result["stamp"]


TOY = Feature("toy_stamp", Worker("toy_stamp", Stamp, host=None),
              payload=lambda r: {"request_id": r.request_id}, apply=_apply)

# The one registry line (a test registers it with `policies.features.registered`).
SPEC = FeatureSpec("toy_stamp", Stage.PRE, False, "a toy pre stage", frozenset({OffMode.SKIP}),
                   impl="tests.fakes.toy_feature:TOY")
