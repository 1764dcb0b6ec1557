"""Telemetry: the nice-to-have observability that Brownout sheds first.

- ``feature_stats``: per-user and per-variant aggregates of finished requests: count, prompt and
  completion token sums, response length in characters, and latency p50/p95 from a bounded
  reservoir sample (Algorithm R, ``reservoir_size`` per key, seeded so tests are repeatable).
- ``light_metrics`` (`LightMetrics`, a separate object because it runs inside the ingress
  process: a few dict updates need no RPC): per-user request and token counters.
- ``debug_capture``: the rendered prompt, sampling and request id of a sample of requests as one
  JSON file each in ``debug_dir``, written in a worker thread; past ``max_debug_files`` the
  oldest go. Off unless configured: ``debug_sample_rate`` (0 to 1, default 0) is the fraction of
  requests captured, chosen by a hash of the request id (`debug_sampled`), so the same request
  is always in or out. A request sampled out is still a call the feature received (its counter
  counts it; it is not bypassed), counted in ``debug_sampled_out``. The folder is 0700 and each
  file 0600 from its creation on: they hold prompts and user ids.

Memory is bounded: at most ``max_keys`` users are tracked; later users are folded into the key
``OTHER``. `stats` shows the ``top_n`` users by request count. Each feature takes
``{"records": [record, ...]}``.
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

from pydantic import BaseModel, ConfigDict, Field

from deployments.enrichments.base import Enrichment, offload
from deployments.enrichments.feature import Feature, Worker
from deployments.enrichments.spool import PRIVATE_FILE_MODE, open_private, private_dir

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


def _user_key(table: dict[str, Any], user: Any, max_keys: int) -> str:
    key = str(user) if user else "anonymous"
    return key if key in table or len(table) < max_keys else OTHER


def debug_sampled(request_id: str, rate: float) -> bool:
    """Whether ``debug_capture`` takes the request ``request_id`` at ``rate`` (0: none, 1: all).

    A hash of the id, uniform in [0, 1), below ``rate``: deterministic across calls, replicas
    and restarts, and about ``rate`` of any set of distinct ids.
    """
    if rate <= 0.0:
        return False
    digest = hashlib.sha256(b"debug_capture:" + request_id.encode("utf-8", "backslashreplace")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < rate


def _top(table: dict[str, Any], count: Callable[[Any], int], n: int) -> list[str]:
    return sorted(table, key=lambda k: (-count(table[k]), k))[:n]


class LightMetrics(Enrichment):
    """Per-user request and token counters (``light_metrics``)."""

    features = ("light_metrics",)

    def __init__(self, *, max_keys: int = 10_000, top_n: int = 20) -> None:
        super().__init__()
        if max_keys < 1 or top_n < 1:
            raise ValueError(f"max_keys and top_n must be >= 1, got {max_keys!r}, {top_n!r}")
        self.max_keys = max_keys
        self.top_n = top_n
        self._light: dict[str, dict[str, int]] = {}

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        for record in payload.get("records") or []:
            usage = record.get("usage") or {}
            tokens = usage.get("total_tokens")
            if tokens is None:
                tokens = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
            key = _user_key(self._light, record.get("user"), self.max_keys)
            counters = self._light.setdefault(key, {"requests": 0, "tokens": 0})
            counters["requests"] += 1
            counters["tokens"] += int(tokens)
        return {"ok": True}

    def stats(self) -> dict[str, Any]:
        top = _top(self._light, lambda c: c["requests"], self.top_n)
        return {"light_metrics": {u: dict(self._light[u]) for u in top}}


class Telemetry(Enrichment):
    features = ("feature_stats", "debug_capture")

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
        debug_sample_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= debug_sample_rate <= 1.0:  # NaN fails too
            raise ValueError(f"debug_sample_rate must be in [0, 1], got {debug_sample_rate!r}")
        if max_debug_files < 1 or reservoir_size < 1 or max_keys < 1 or top_n < 1:
            raise ValueError(
                "max_debug_files, reservoir_size, max_keys and top_n must be >= 1, got "
                f"{max_debug_files!r}, {reservoir_size!r}, {max_keys!r}, {top_n!r}"
            )
        self.debug_dir = private_dir(debug_dir)
        self.debug_sample_rate = float(debug_sample_rate)
        self.clock = clock
        self.max_debug_files = max_debug_files
        self.reservoir_size = reservoir_size
        self.max_keys = max_keys
        self.top_n = top_n
        self._rng = random.Random(seed)
        self._by_user: dict[str, _Aggregate] = {}
        self._by_variant: dict[str, _Aggregate] = {}
        # Debug files are named "<ms>-<seq>-<id>.json", so name order is write order, also
        # across restarts; the deque holds them oldest first.
        self._files_lock = threading.Lock()
        self._files: deque[Path] = deque(sorted(self.debug_dir.glob("*.json")))
        for old in self._files:
            if not old.is_symlink():
                os.chmod(old, PRIVATE_FILE_MODE)  # written before files were private
        self._seq = itertools.count()
        self._captured = 0
        self._deleted = 0
        self._sampled_out = 0

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        for record in payload.get("records") or []:
            if feature == "feature_stats":
                self._feature_stats(record)
            else:
                await self._debug_capture(record)
        return {"ok": True}

    def _key(self, table: dict[str, Any], user: Any) -> str:
        return _user_key(table, user, self.max_keys)

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

    async def _debug_capture(self, record: dict[str, Any]) -> None:
        request_id = str(record.get("request_id") or "")
        if not debug_sampled(request_id, self.debug_sample_rate):
            self._sampled_out += 1
            return
        doc = {
            "request_id": request_id,
            "at": record.get("at"),
            "captured_at": self.clock(),
            "user": record.get("user"),
            "prompt": record.get("prompt"),
            "sampling": record.get("sampling"),
        }
        # backslashreplace: a lone surrogate is written as its JSON escape, not raised (with the text)
        body = json.dumps(doc, ensure_ascii=False, indent=1).encode("utf-8", "backslashreplace")
        safe_id = (request_id if _SAFE_ID.match(request_id)
                   else hashlib.sha256(request_id.encode("utf-8", "backslashreplace")).hexdigest()[:16])
        name = f"{int(doc['captured_at'] * 1000):013d}-{next(self._seq):08d}-{safe_id}.json"
        await offload(self._write_debug, self.debug_dir / name, body)

    def _write_debug(self, path: Path, body: bytes) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f:
            f.write(body)
        os.replace(tmp, path)
        with self._files_lock:
            self._files.append(path)
            self._captured += 1
            doomed = [self._files.popleft() for _ in range(len(self._files) - self.max_debug_files)]
            self._deleted += len(doomed)
        for old in doomed:
            old.unlink(missing_ok=True)

    def stats(self) -> dict[str, Any]:
        users = _top(self._by_user, lambda a: a.count, self.top_n)
        with self._files_lock:
            debug_files = len(self._files)
        return {
            "tracked_users": len(self._by_user),
            "users": {u: self._by_user[u].summary() for u in users},
            "variants": {v: a.summary() for v, a in sorted(self._by_variant.items())},
            "debug_files": debug_files,
            "debug_captured": self._captured,
            "debug_deleted": self._deleted,
            "debug_sample_rate": self.debug_sample_rate,
            "debug_sampled_out": self._sampled_out,
        }


class TelemetrySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    debug_dir: Path = Field(description="where debug_capture writes its files")
    max_debug_files: int = Field(default=2000, ge=1)
    reservoir_size: int = Field(default=256, ge=1)
    max_keys: int = Field(default=10_000, ge=1)
    top_n: int = Field(default=20, ge=1)
    seed: int = 0
    debug_sample_rate: float = Field(
        default=0.0, ge=0.0, le=1.0, allow_inf_nan=False,
        description="debug_capture: the fraction of requests captured (by request id); 0: none")


class LightMetricsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_keys: int = Field(default=10_000, ge=1)
    top_n: int = Field(default=20, ge=1)


# Aggregates shared by every ingress replica and files on disk: their own deployment.
WORKER = Worker("telemetry", Telemetry, host="Telemetry", settings=TelemetrySettings,
                state_paths={"debug_dir": "debug"})
FEATURE_STATS = Feature("feature_stats", WORKER)
DEBUG_CAPTURE = Feature("debug_capture", WORKER)
# A few counters per request: inside the ingress process (per replica), no RPC.
LIGHT_WORKER = Worker("light_metrics", LightMetrics, host=None, settings=LightMetricsSettings)
LIGHT_METRICS = Feature("light_metrics", LIGHT_WORKER)
