"""A recording stand-in for where features run (the ingress's own workers and the enrichment
deployments), for pipeline unit tests only."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from deployments.enrichments.base import Outcome


class FakeStages:
    """A `BatchCall`: answers like the real enrichments' contract; can be made slow or failing.

    ``calls`` counts stage calls per feature, ``batches`` calls per host (None: in-process), so
    a test sees both what ran and how many handle calls it took.
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.batches: Counter[str | None] = Counter()
        self.payloads: dict[str, list[dict[str, Any]]] = {}
        self.fail: set[str] = set()
        self.slow_s: dict[str, float] = {}
        self.cache: dict[str, str] = {}
        self.answers: dict[str, dict[str, Any]] = {}  # feature -> fixed result (toy features)

    async def __call__(self, host: str | None, calls: list[tuple[str, dict[str, Any]]]) -> list[Outcome]:
        self.batches[host] += 1
        return list(await asyncio.gather(*(self._one(f, p) for f, p in calls)))

    async def _one(self, feature: str, payload: dict[str, Any]) -> Outcome:
        self.calls[feature] += 1
        self.payloads.setdefault(feature, []).append(payload)
        if feature in self.slow_s:
            await asyncio.sleep(self.slow_s[feature])
        if feature in self.fail:
            return Outcome(error=f"RuntimeError('{feature} is down')")
        return Outcome(result=self._answer(feature, payload))

    def _answer(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        if feature in self.answers:
            return self.answers[feature]
        if feature == "personalization":
            return {"system_prefix": "Be friendly.", "sampling": {"temperature": 0.3}} if payload.get("user") else {}
        if feature == "ab_test":
            if not payload.get("user"):
                return {"experiment": "exp", "variant": "control"}
            return {"experiment": "exp", "variant": "concise", "system_suffix": "Be brief.",
                    "sampling": {"temperature": 0.7, "top_p": 0.9}}
        if feature == "prompt_rewrite":
            return {"messages": [{"role": m["role"], "content": m["content"].strip()} for m in payload["messages"]]}
        if feature == "semantic_cache_lookup":
            answer = self.cache.get(payload["key_text"])
            return {"hit": answer is not None, "answer": answer}
        if feature == "response_polish":
            return {"text": payload["text"].capitalize()}
        if feature == "semantic_cache_write":
            for record in payload["records"]:
                self.cache[record["key_text"]] = record["response"]["text"]
        return {"ok": True}
