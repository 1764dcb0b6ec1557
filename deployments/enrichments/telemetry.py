"""Telemetry: the nice-to-have observability that Brownout sheds first.

- ``feature_stats``: per-user and per-variant aggregates of finished requests: count, prompt and
  completion token sums, response length in characters, and latency p50/p95 from a bounded
  reservoir sample (Algorithm R, ``reservoir_size`` per key, seeded so tests are repeatable).
- ``light_metrics``: per-user request and token counters.
- ``debug_capture``: the rendered prompt, sampling and request id of each request as one JSON
  file in ``debug_dir``, written in a worker thread; past ``max_debug_files`` the oldest go.

Memory is bounded: at most ``max_keys`` users are tracked; later users are folded into the key
``OTHER``. `stats` shows the ``top_n`` users by request count.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployments.enrichments.base import Enrichment

OTHER = "_other"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class _Aggregate:
    count: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    response_chars: int = 0
    latency_seen: int = 0
    latency_ms: list[float] = field(default_factory=list)  # reservoir sample of latency_seen

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latency_ms)
        return {
            "count": self.count,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "response_chars": self.response_chars,
            "latency_p50_ms": _nearest_rank(lat, 50),
            "latency_p95_ms": _nearest_rank(lat, 95),
        }


def _nearest_rank(sorted_values: list[float], pct: float) -> float | None:
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * pct // 100))  # ceil(n * pct / 100)
    return sorted_values[int(rank) - 1]


class Telemetry(Enrichment):
    features = ("feature_stats", "debug_capture", "light_metrics")

    def __init__(
        self,
        debug_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
        max_debug_files: int = 2000,
        reservoir_size: int = 256,
        max_keys: int = 10_000,
        top_n: int = 20,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if max_debug_files < 1 or reservoir_size < 1 or max_keys < 1 or top_n < 1:
            raise ValueError(
                "max_debug_files, reservoir_size, max_keys and top_n must be >= 1, got "
                f"{max_debug_files!r}, {reservoir_size!r}, {max_keys!r}, {top_n!r}"
            )
        self.debug_dir = Path(debug_dir)
        self.debug_dir.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.max_debug_files = max_debug_files
        self.reservoir_size = reservoir_size
        self.max_keys = max_keys
        self.top_n = top_n
        self._rng = random.Random(seed)
        self._by_user: dict[str, _Aggregate] = {}
        self._by_variant: dict[str, _Aggregate] = {}
        self._light: dict[str, dict[str, int]] = {}
        # Debug files are named "<ms>-<seq>-<id>.json", so name order is write order, also
        # across restarts; the deque holds them oldest first.
        self._files_lock = threading.Lock()
        self._files: deque[Path] = deque(sorted(self.debug_dir.glob("*.json")))
        self._seq = itertools.count()
        self._captured = 0
        self._deleted = 0

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        if feature == "feature_stats":
            self._feature_stats(payload)
        elif feature == "light_metrics":
            self._light_metrics(payload)
        else:
            await self._debug_capture(payload)
        return {"ok": True}

    def _key(self, table: dict[str, Any], user: Any) -> str:
        key = str(user) if user else "anonymous"
        return key if key in table or len(table) < self.max_keys else OTHER

    def _feature_stats(self, record: dict[str, Any]) -> None:
        usage = record.get("usage") or {}
        text = (record.get("response") or {}).get("text") or ""
        latency = record.get("latency_ms")
        for table, key in (
            (self._by_user, self._key(self._by_user, record.get("user"))),
            (self._by_variant, str(record.get("variant") or "none")),
        ):
            agg = table.setdefault(key, _Aggregate())
            agg.count += 1
            agg.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            agg.completion_tokens += int(usage.get("completion_tokens") or 0)
            agg.response_chars += len(text)
            if isinstance(latency, (int, float)):
                self._sample(agg, float(latency))

    def _sample(self, agg: _Aggregate, value: float) -> None:
        agg.latency_seen += 1
        if len(agg.latency_ms) < self.reservoir_size:
            agg.latency_ms.append(value)
        else:
            j = self._rng.randrange(agg.latency_seen)
            if j < self.reservoir_size:
                agg.latency_ms[j] = value

    def _light_metrics(self, record: dict[str, Any]) -> None:
        usage = record.get("usage") or {}
        tokens = usage.get("total_tokens")
        if tokens is None:
            tokens = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
        counters = self._light.setdefault(self._key(self._light, record.get("user")), {"requests": 0, "tokens": 0})
        counters["requests"] += 1
        counters["tokens"] += int(tokens)

    async def _debug_capture(self, record: dict[str, Any]) -> None:
        request_id = str(record.get("request_id") or "")
        doc = {
            "request_id": request_id,
            "at": record.get("at"),
            "captured_at": self.clock(),
            "user": record.get("user"),
            "prompt": record.get("prompt"),
            "sampling": record.get("sampling"),
        }
        body = json.dumps(doc, ensure_ascii=False, indent=1).encode()
        safe_id = request_id if _SAFE_ID.match(request_id) else hashlib.sha256(request_id.encode()).hexdigest()[:16]
        name = f"{int(doc['captured_at'] * 1000):013d}-{next(self._seq):08d}-{safe_id}.json"
        await asyncio.to_thread(self._write_debug, self.debug_dir / name, body)

    def _write_debug(self, path: Path, body: bytes) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(body)
        os.replace(tmp, path)
        with self._files_lock:
            self._files.append(path)
            self._captured += 1
            doomed = [self._files.popleft() for _ in range(len(self._files) - self.max_debug_files)]
            self._deleted += len(doomed)
        for old in doomed:
            old.unlink(missing_ok=True)

    def stats(self) -> dict[str, Any]:
        def top(table: dict[str, Any], count: Callable[[Any], int]) -> list[str]:
            return sorted(table, key=lambda k: (-count(table[k]), k))[: self.top_n]

        users = top(self._by_user, lambda a: a.count)
        light = top(self._light, lambda c: c["requests"])
        with self._files_lock:
            debug_files = len(self._files)
        return {
            "tracked_users": len(self._by_user),
            "users": {u: self._by_user[u].summary() for u in users},
            "variants": {v: a.summary() for v, a in sorted(self._by_variant.items())},
            "light_metrics": {u: dict(self._light[u]) for u in light},
            "debug_files": debug_files,
            "debug_captured": self._captured,
            "debug_deleted": self._deleted,
        }
