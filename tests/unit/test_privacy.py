"""Privacy (issue 11, deliverable 7): debug capture off by default and sampled, private files, and
no prompt text, user text or key in any log line or metric label."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import logging
import math
import os
import re
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deployments.enrichments import registry
from deployments.enrichments.audit_log import AuditLog, read_all
from deployments.enrichments.base import Enrichment, run_calls
from deployments.enrichments.feature import RequestState
from deployments.enrichments.personalization import Personalization
from deployments.enrichments.semantic_cache import SemanticCache
from deployments.enrichments.spool import DurableSpool, private_dir
from deployments.enrichments.telemetry import Telemetry, debug_sampled
from policies.features import OffMode, PolicyView, optional_names
from serve_app.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("serve_app", "deployments", "policies")

# Distinctive, secret-looking strings: none of them may ever reach a log line.
SECRET_PROMPT = "zq-SECRET-PROMPT-4f9e1c Tell me the launch codes"
SECRET_KEY = "sk-brownout-LEAK-7d2a93b1"
SECRET_USER = "user-SECRET-b81f0a"
SECRETS = (SECRET_PROMPT, "SECRET-PROMPT-4f9e1c", SECRET_KEY, "LEAK-7d2a93b1", SECRET_USER, "SECRET-b81f0a")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class BagOfWords:
    """Deterministic embedder (no model download): hashed word counts."""

    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), 64), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.split():
                out[row, int(hashlib.sha256(word.encode()).hexdigest(), 16) % 64] += 1.0
        return out


class Captured(logging.Handler):
    """Every record at DEBUG and up, formatted with its traceback, from the root and Ray's
    loggers (Ray's do not propagate to the root)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def texts(self) -> list[str]:
        return [self.format(r) + repr(r.args) for r in self.records]


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[Captured]:
    caplog.set_level(logging.DEBUG)
    handler = Captured()
    saved = []
    for name in ("", "ray", "ray.serve", "asyncio"):
        lg = logging.getLogger(name)
        saved.append((lg, lg.level))
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg, level in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)
    for text in [*handler.texts(), caplog.text]:
        for secret in SECRETS:
            assert secret not in text, f"a log line carries {secret!r}: {text[:300]!r}"


# --------------------------------------------------------------------------- the whole pipeline


def workers(tmp_path: Path, debug_sample_rate: float = 1.0) -> dict[str, Enrichment]:
    settings: dict[str, dict[str, Any]] = {
        "audit_log": {"directory": str(tmp_path / "audit"), "max_bytes": 2_000, "backups": 2},
        "personalization": {"db_path": str(tmp_path / "profiles.sqlite"), "demo_users": 5},
        "ab_test": {},
        "telemetry": {"debug_dir": str(tmp_path / "debug"), "debug_sample_rate": debug_sample_rate},
        "enhance": {},
        "light_metrics": {},
    }
    built: dict[str, Enrichment] = {kind: registry.build(kind, s) for kind, s in settings.items()}
    built["semantic_cache"] = SemanticCache(BagOfWords())
    return built


def plumbing(tmp_path: Path, built: dict[str, Enrichment]) -> Pipeline:
    feats = registry.features()
    by_feature = {f: e for e in built.values() for f in e.features}

    async def call(host: str | None, calls: list[tuple[str, dict[str, Any]]]) -> Any:
        return await run_calls(by_feature, calls)

    return Pipeline(feats, call, lambda f: DurableSpool(tmp_path / "spool", f))


def secret_request(view: PolicyView, i: int, prompt: str = SECRET_PROMPT) -> RequestState:
    msgs = [{"role": "system", "content": f"api key {SECRET_KEY}"}, {"role": "user", "content": prompt}]
    return RequestState(request_id=f"req-{i}", user=SECRET_USER, messages=msgs, prompt=None,
                        sampling={"temperature": 1.0, "max_tokens": 8}, explicit=frozenset(), view=view,
                        key_text=f"user: {prompt}")


def whole_request(p: Pipeline, c: RequestState) -> None:
    async def go() -> None:
        await p.pre(c)
        c.text = f"the answer to {SECRET_PROMPT}"
        await p.post(c)
        p.decide_side_effects(c)
        await p.settle(c, c.record("stop", {"prompt_tokens": 3, "completion_tokens": 2}))
        await p.wait_idle()

    run(go())


def test_no_prompt_user_or_key_in_any_log_line_of_the_enrichments(tmp_path: Path, logs: Captured) -> None:
    built = workers(tmp_path)
    p = plumbing(tmp_path, built)
    everything = PolicyView(level=0, enabled=frozenset(optional_names()))
    minimal = PolicyView(level=3, enabled=frozenset(),
                         modes={"audit_log": OffMode.DEFER, "feature_stats": OffMode.DEFER})
    whole_request(p, secret_request(everything, 0))
    # Level 3: spooled, then delivered once the level allows; a lone surrogate travels too.
    whole_request(p, secret_request(minimal, 1))
    whole_request(p, secret_request(minimal, 2, prompt=SECRET_PROMPT + " \ud800"))
    whole_request(p, secret_request(everything, 3))
    assert p.counters()["spool_pending"] == {"audit_log": 0, "feature_stats": 0}
    assert [r["request_id"] for r in read_all(tmp_path / "audit")] == ["req-0", "req-1", "req-2", "req-3"]
    # Failures are logged by the pipeline (stage bypassed: its error): none may carry the text.
    run(built["personalization"].close())
    whole_request(p, secret_request(everything, 4))
    assert p.counters()["failures"] == {"personalization": 1}
    # The spool's own warnings: a torn line and a corrupt record, both holding the prompt.
    spool_file = tmp_path / "spool" / "audit_log.spool"
    spool_file.write_bytes(b"{\"prompt\": \"" + SECRET_PROMPT.encode() + b"\"} oops\n{\"prompt\": \"" +
                           SECRET_PROMPT.encode())
    spool = DurableSpool(tmp_path / "spool", "audit_log")
    delivered: list[dict[str, Any]] = []

    async def sink(records: list[dict[str, Any]]) -> None:
        delivered.extend(records)

    run(spool.drain(10, sink))
    assert delivered == [] and spool.stats()["corrupt_skipped"] == 1
    names = {r.name for r in logs.records}
    assert {"ray.serve", "deployments.enrichments.spool"} <= names  # the check above is not vacuous


def test_a_failing_worker_reports_no_text(tmp_path: Path) -> None:
    """What `run_calls` turns into the error the pipeline logs: the type and a content-free text."""
    built = workers(tmp_path)
    by_feature = {f: e for e in built.values() for f in e.features}
    surrogate_user = SECRET_USER + "\udc80"
    calls = [
        ("audit_log", {"records": [{"prompt": SECRET_PROMPT, "bad": {SECRET_KEY}}]}),  # a set: not JSON
        ("personalization", {"user": surrogate_user, "request_id": "r"}),
        ("debug_capture", {"records": [{"request_id": "r", "prompt": SECRET_PROMPT + "\ud800",
                                        "user": surrogate_user}]}),
        ("feature_stats", {"records": [{"user": surrogate_user, "usage": {}, "response": {}}]}),
        ("audit_log", {"records": [{"prompt": SECRET_PROMPT + "\ud800", "user": surrogate_user}]}),
    ]
    outcomes = run(run_calls(by_feature, calls))
    assert outcomes[0].error is not None and outcomes[0].error.startswith("TypeError")
    assert [o.error for o in outcomes[1:]] == [None] * 4  # text UTF-8 cannot hold is no error
    for o in outcomes:
        for secret in SECRETS:
            assert secret not in str(o)
    assert read_all(tmp_path / "audit")[0]["prompt"] == SECRET_PROMPT + "\ud800"  # escaped, read back


# --------------------------------------------------------------------------- static checks

LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
METRIC_CLASSES = {"Counter", "Gauge", "Histogram", "ServeCounter", "ServeGauge", "ServeHistogram"}
# Name parts that would mean user text, a prompt or a secret.
SENSITIVE = re.compile(r"^(prompts?|messages?|content|contents|body|text|texts|key_text|authorization|auth|"
                       r"api_?keys?|keys?|tokens?|secrets?|password|headers?|payloads?|records?|user_text|"
                       r"completion|response|answer)$")
SENSITIVE_LABEL = re.compile(r"prompt|message|content|text|key|auth|token|secret|password|header|body|"
                             r"user|response|answer", re.I)


def product_sources() -> Iterator[tuple[Path, ast.Module]]:
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def literal_strings(node: ast.AST) -> list[str] | None:
    """The strings of a literal tuple/list/set of strings; None when it is not such a literal."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


def test_no_metric_label_can_carry_text_or_a_key() -> None:
    declared: list[str] = []
    for path, tree in product_sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            for kw in node.keywords:
                if kw.arg == "tag_keys":
                    keys = literal_strings(kw.value)
                    assert keys is not None, f"{where}: tag_keys must be a literal so this test can read it"
                    declared.append(where)
                    bad = [k for k in keys if SENSITIVE_LABEL.search(k)]
                    assert not bad, f"{where}: metric label(s) {bad} could carry user text or a key"
                elif kw.arg == "tags" and isinstance(kw.value, ast.Dict):
                    for k in kw.value.keys:
                        assert isinstance(k, ast.Constant), f"{where}: tag names must be literal"
                        assert not SENSITIVE_LABEL.search(str(k.value)), f"{where}: tag {k.value!r}"
            if call_name(node) == "set_default_tags" and node.args and isinstance(node.args[0], ast.Dict):
                for k in node.args[0].keys:
                    assert isinstance(k, ast.Constant) and not SENSITIVE_LABEL.search(str(k.value)), where
    assert len(declared) >= 3, f"found only {declared}: the search no longer sees the metrics"


def _names_in(node: ast.AST) -> Iterator[str]:
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            yield n.slice.value  # record["prompt"]


def test_no_log_call_is_handed_user_text_or_a_key() -> None:
    """Every ``log*.<level>(...)`` call in product code: no argument names a prompt, a message,
    a body, a header, a record or a key (an f-string's values count as arguments)."""
    seen = 0
    for path, tree in product_sources():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LOG_METHODS):
                continue
            owner = node.func.value
            owner_name = (owner.id if isinstance(owner, ast.Name)
                          else owner.attr if isinstance(owner, ast.Attribute) else "")
            if "log" not in owner_name.lower():
                continue
            seen += 1
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            for arg in [*node.args, *(kw.value for kw in node.keywords if kw.arg != "exc_info")]:
                bad = [n for n in _names_in(arg) if SENSITIVE.match(n.lower())]
                assert not bad, f"{where}: a log call is handed {bad}"
    assert seen >= 10, f"only {seen} log calls found: the search no longer sees them"


# --------------------------------------------------------------------------- file modes


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: the modes must not depend on it."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_audit_log_files_are_0600_in_a_0700_folder(tmp_path: Path, open_umask: None) -> None:
    folder = tmp_path / "state" / "audit"
    log = AuditLog(folder, max_bytes=300, backups=2)
    for i in range(10):
        run(log.call("audit_log", {"records": [{"request_id": f"r{i}", "prompt": "x" * 100}]}))
    run(log.close())
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["audit.log", "audit.log.1", "audit.log.2"]  # rotated files too
    assert all(mode(p) == 0o600 for p in folder.iterdir())
    assert mode(folder) == 0o700 and mode(folder.parent) == 0o700  # a missing parent made too


def test_existing_folders_and_files_are_made_private(tmp_path: Path, open_umask: None) -> None:
    folder = tmp_path / "audit"
    folder.mkdir(mode=0o755)
    for name in ("audit.log", "audit.log.1"):
        (folder / name).write_bytes(b'{"request_id":"old"}\n')
        os.chmod(folder / name, 0o644)
    AuditLog(folder)
    assert mode(folder) == 0o700 and {mode(p) for p in folder.iterdir()} == {0o600}
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o777)
    (spool_dir / "a.spool").write_bytes(b'{"x":1}\n')
    (spool_dir / "a.offset").write_text("0")
    os.chmod(spool_dir / "a.spool", 0o666)
    DurableSpool(spool_dir, "a")
    assert mode(spool_dir) == 0o700 and mode(spool_dir / "a.spool") == mode(spool_dir / "a.offset") == 0o600
    debug = tmp_path / "debug"
    debug.mkdir(mode=0o755)
    (debug / "0000000000001-00000000-r.json").write_text("{}")
    Telemetry(debug)
    assert mode(debug) == 0o700 and mode(debug / "0000000000001-00000000-r.json") == 0o600


def test_spool_files_are_0600_in_a_0700_folder(tmp_path: Path, open_umask: None) -> None:
    spool = DurableSpool(tmp_path / "spool", "audit_log")
    for i in range(3):
        spool.append({"request_id": f"r{i}", "prompt": SECRET_PROMPT})
    got: list[dict[str, Any]] = []

    async def sink(records: list[dict[str, Any]]) -> None:
        got.extend(records)

    run(spool.drain(2, sink))  # commits offsets (a temporary file renamed), then resets the file
    assert len(got) == 3
    folder = tmp_path / "spool"
    assert sorted(p.name for p in folder.iterdir()) == ["audit_log.offset", "audit_log.spool"]
    assert mode(folder) == 0o700 and {mode(p) for p in folder.iterdir()} == {0o600}
    spool.append({"request_id": "r3"})
    assert mode(folder / "audit_log.spool") == 0o600


def test_personalization_database_and_its_sqlite_files_are_0600(tmp_path: Path, open_umask: None) -> None:
    db = tmp_path / "state" / "profiles.sqlite"
    p = Personalization(db, demo_users=3)
    assert mode(db) == 0o600 and mode(db.parent) == 0o700
    # In WAL mode SQLite adds -wal and -shm next to it; they must be as private.
    with p._lock:
        p._db.execute("PRAGMA journal_mode=WAL")
        with p._db:
            p._db.execute("INSERT INTO profiles VALUES ('u', 'U', 'terse', 'English', 0.5, 'hi')")
    sides = [db.with_name(db.name + s) for s in ("-wal", "-shm")]
    assert all(s.exists() for s in sides)
    assert {mode(s) for s in sides} == {0o600}
    assert run(p.call("personalization", {"user": "user-0001", "request_id": "r"}))["system_prefix"]
    run(p.close())
    # A database left with wider modes by an older run is made private at start.
    os.chmod(db, 0o644)
    for s in sides:
        if s.exists():
            os.chmod(s, 0o644)
    Personalization(db, seed_demo=False)
    assert mode(db) == 0o600 and all(mode(s) == 0o600 for s in sides if s.exists())
    assert sqlite3.connect(db).execute("SELECT count(*) FROM profiles").fetchone()[0] == 4


def test_debug_capture_files_are_0600_in_a_0700_folder(tmp_path: Path, open_umask: None) -> None:
    folder = tmp_path / "state" / "debug"
    t = Telemetry(folder, debug_sample_rate=1.0)
    run(t.call("debug_capture", {"records": [{"request_id": f"r{i}", "prompt": "p"} for i in range(3)]}))
    files = list(folder.iterdir())
    assert len(files) == 3 and {mode(f) for f in files} == {0o600}
    assert mode(folder) == mode(folder.parent) == 0o700


def test_private_dir_keeps_going_on_a_folder_it_does_not_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)

    def refuse(path: Any, m: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "chmod", refuse)
    assert private_dir(shared) == shared  # the files in it are still 0600
    assert "cannot make" in caplog.text


# --------------------------------------------------------------------------- debug sampling


def records(n: int, prefix: str = "req") -> dict[str, Any]:
    return {"records": [{"request_id": f"{prefix}-{i}", "user": "u", "prompt": "p", "sampling": {}}
                        for i in range(n)]}


def test_debug_capture_is_off_by_default_and_a_sampled_out_call_is_still_a_call(tmp_path: Path) -> None:
    built = registry.build("telemetry", {"debug_dir": str(tmp_path / "debug")})
    kinds = registry.workers(registry.features())
    assert kinds["telemetry"].resolve({}, tmp_path).get("debug_sample_rate", 0.0) == 0.0
    assert isinstance(built, Telemetry) and built.debug_sample_rate == 0.0
    for _ in range(3):
        run(built.call("debug_capture", records(10)))
    assert list((tmp_path / "debug").iterdir()) == []
    stats = built.stats()
    assert stats["debug_captured"] == 0 and stats["debug_sampled_out"] == 30
    assert built.counters()["debug_capture"] == 3  # the feature ran (it was not bypassed)


def test_a_sampled_out_request_is_not_bypassed_by_the_level(tmp_path: Path) -> None:
    built = workers(tmp_path, debug_sample_rate=0.0)
    p = plumbing(tmp_path, built)
    c = secret_request(PolicyView(level=0, enabled=frozenset(optional_names())), 0)
    whole_request(p, c)
    assert "debug_capture" not in c.bypassed and "debug_capture" not in c.headers()["X-Brownout-Bypassed"]
    assert p.counters()["bypassed"] == {} and p.counters()["calls"]["debug_capture"] == 1
    telemetry = built["telemetry"]
    assert telemetry.counters()["debug_capture"] == 1 and telemetry.stats()["debug_sampled_out"] == 1
    # Turned off by the level it is bypassed as before, and the worker gets no call.
    c = secret_request(PolicyView(level=1, enabled=frozenset(optional_names()) - {"debug_capture"}), 1)
    whole_request(p, c)
    assert "debug_capture" in c.bypassed and telemetry.counters()["debug_capture"] == 1


def test_debug_capture_takes_a_deterministic_fraction_by_request_id(tmp_path: Path) -> None:
    n = 4000
    a = Telemetry(tmp_path / "a", debug_sample_rate=0.25)
    b = Telemetry(tmp_path / "b", debug_sample_rate=0.25)
    run(a.call("debug_capture", records(n)))
    run(b.call("debug_capture", records(n)))
    ids_a = sorted(json.loads(f.read_text())["request_id"] for f in (tmp_path / "a").iterdir())
    ids_b = sorted(json.loads(f.read_text())["request_id"] for f in (tmp_path / "b").iterdir())
    assert ids_a == ids_b  # the same requests on every replica
    assert ids_a == sorted(f"req-{i}" for i in range(n) if debug_sampled(f"req-{i}", 0.25))
    assert abs(len(ids_a) - n * 0.25) < 4 * math.sqrt(n * 0.25 * 0.75)
    assert a.stats()["debug_captured"] + a.stats()["debug_sampled_out"] == n
    # Nested: a request captured at a rate is captured at every higher rate.
    low = {i for i in range(n) if debug_sampled(f"req-{i}", 0.1)}
    assert low <= {i for i in range(n) if debug_sampled(f"req-{i}", 0.25)}
    assert not any(debug_sampled(f"req-{i}", 0.0) for i in range(n))
    assert all(debug_sampled(f"req-{i}", 1.0) for i in range(n))


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan"), float("inf"), "often"])
def test_debug_sample_rate_is_validated(tmp_path: Path, rate: Any) -> None:
    with pytest.raises(ValueError, match=r"enrichments\.settings\.telemetry: debug_sample_rate"):
        registry.build("telemetry", {"debug_dir": str(tmp_path), "debug_sample_rate": rate})
    if not isinstance(rate, str):
        with pytest.raises(ValueError, match="debug_sample_rate must be in"):
            Telemetry(tmp_path, debug_sample_rate=rate)
