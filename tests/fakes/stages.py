"""A recording stand-in for the enrichment deployments, for pipeline unit tests only."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any


class FakeStages:
    """Answers stage calls like the real enrichments' contract; can be made slow or failing."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.payloads: dict[str, list[dict[str, Any]]] = {}
        self.fail: set[str] = set()
        self.slow_s: dict[str, float] = {}
        self.cache: dict[str, str] = {}

    async def __call__(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.calls[feature] += 1
        self.payloads.setdefault(feature, []).append(payload)
        if feature in self.slow_s:
            await asyncio.sleep(self.slow_s[feature])
        if feature in self.fail:
            raise RuntimeError(f"{feature} is down")
        if feature == "personalization":
            return {"system_prefix": "Be friendly.", "sampling": {"temperature": 0.3}} if payload.get("user") else {}
        if feature == "ab_test":
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
            self.cache[payload["key_text"]] = payload["response"]["text"]
        if feature == "audit_log":
            return {"ok": True, "written": len(payload["records"])}
        return {"ok": True}
