"""The core path's guards: API keys with tiers, per-key rate limits, the admin token, bounded bodies.

Threat model and the attacks each guard answers: ``SECURITY.md``. Everything here runs in the
ingress, before any enrichment or model work, at every degradation level: a level turns optional
work off, never these.

**API keys.** A keys file (YAML) holds one entry per key: an id, the SHA-256 of the key (never
the key itself: keys are 32 random bytes, so a plain hash is as strong as a slow one), a tenant
(what shared state such as the semantic cache is scoped by) and a tier (``critical``,
``standard``, ``sheddable``: the request's admission class, which the ``X-Brownout-Criticality``
header may lower, never raise), with its rate limits. ``python -m serve_app.security add-key``
creates a key, stores its hash and prints the key once. The ingress re-reads the file when it
changes (checked at most once a second), so adding or revoking a key needs no redeploy. Clients
send the key as OpenAI's SDKs do: ``Authorization: Bearer <key>``.

**Rate limits.** Per key, requests and tokens (the completion tokens a request may generate: its
``max_tokens`` after shaping) over moving windows, with the `limits` library (the store behind
Flask-Limiter and SlowAPI), in memory per ingress replica. A request over either is refused
with 429, ``Retry-After`` (seconds until the window has room) and the remaining budget in
``x-ratelimit-*`` headers, as OpenAI's API names them.

**Admin token.** Read from a file (``make serve`` writes one); with none configured the admin
routes answer 403, never open. Compared in constant time, checked before any body is read.

**Bodies.** Read with the size limit enforced while reading (the read stops at the limit: a
chunked body of any size costs at most the limit) and a read timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import math
import os
import secrets
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from limits import RateLimitItem, parse
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from policies.admission import Criticality
from serve_app.openai_api import RequestError, body_too_large

__all__ = ["AdminGuard", "AuthSettings", "KeyRecord", "KeyStore", "RateLimits", "hash_key", "new_key",
           "read_body"]

KEY_PREFIX = "bo-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _rate(value: str, key: str) -> str:
    try:
        parse(value)
    except ValueError:
        raise ValueError(f"{key}: {value!r} is not a rate such as '10/second' or '6000/minute'") from None
    return value


class RateSettings(BaseModel):
    """Per-key limits, in the `limits` notation ("10/second", "600/minute", "5 per 2 seconds")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: str = Field(default="10/second", description="requests per window")
    tokens: str = Field(default="2000/second", description="completion tokens (max_tokens) per window")

    @field_validator("requests", "tokens")
    @classmethod
    def _parses(cls, value: str, info: Any) -> str:
        return _rate(value, info.field_name)


class KeyRecord(BaseModel):
    """One API key, as the keys file holds it: never the key, only its SHA-256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@-]+$")
    tier: Criticality = Criticality.STANDARD
    rate: RateSettings | None = None  # None: the configured default


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyRecord] = Field(default_factory=list)


class AuthSettings(BaseModel):
    """The builder's ``auth:`` args."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_keys: Literal["required", "disabled"] = Field(
        default="required",
        description="'disabled' lets anyone in as tenant 'anonymous' (local demo only; make serve warns)",
    )
    keys_file: str = Field(default="~/.config/brownout/keys.yaml", description="the API keys (hashes)")
    admin_token_file: str | None = Field(
        default="~/.config/brownout/admin_token",
        description="the admin API's token; missing file or None: the admin API answers 403",
    )
    default_rate: RateSettings = Field(default_factory=RateSettings)
    max_override_ttl_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False,
                                      description="longest level pin or feature override the admin API sets")
    body_read_timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False,
                                       description="a request body not fully read by then is a 408")


def _private_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as 0600 in a 0700 folder, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_keys(path: Path) -> list[KeyRecord]:
    """The keys in ``path`` (an absent file: none). A malformed file raises naming the entry."""
    if not path.exists():
        return []
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    try:
        return KeysFile.model_validate(doc).keys
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{path.name}: {where}: {first['msg']} (got {first.get('input')!r})") from None


class _WatchedFile:
    """Says whether a file changed (mtime and size) since last asked, looking at most once
    every ``recheck_s``: the keys file and the admin token are re-read only then."""

    def __init__(self, path: Path, clock: Any, recheck_s: float) -> None:
        self.path, self.clock, self.recheck_s = path, clock, recheck_s
        self.exists = False
        self._stamp: tuple[int, int] | None = None
        self._checked_at = float("-inf")

    def changed(self, force: bool = False) -> bool:
        now = self.clock()
        if not force and now - self._checked_at < self.recheck_s:
            return False
        self._checked_at = now
        try:
            st = self.path.stat()
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        self.exists = stamp is not None
        if stamp == self._stamp and not force:
            return False
        self._stamp = stamp
        return True


class KeyStore:
    """The keys file, re-read when it changes; `authenticate` maps a presented key to its record."""

    def __init__(self, path: str | Path, clock: Any = time.monotonic, recheck_s: float = 1.0) -> None:
        self.path = Path(path).expanduser()
        self._file = _WatchedFile(self.path, clock, recheck_s)
        self._by_hash: dict[str, KeyRecord] = {}
        self.load_error: str | None = None
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        if not self._file.changed(force):
            return
        try:
            records = load_keys(self.path)
        except (ValueError, yaml.YAMLError) as err:
            # keep the keys in force: a half-written or broken file must not open or close the door
            self.load_error = str(err)
            return
        self.load_error = None
        self._by_hash = {r.sha256: r for r in records}

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, authorization: str | None) -> KeyRecord:
        """The record of the key in an ``Authorization: Bearer <key>`` header, or a 401."""
        self.refresh()
        if not authorization:
            raise RequestError(401, "missing API key: send 'Authorization: Bearer <key>'", "authorization",
                               kind="authentication_error", code="invalid_api_key")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise RequestError(401, "the Authorization header must be 'Bearer <key>'", "authorization",
                               kind="authentication_error", code="invalid_api_key")
        record = self._by_hash.get(hash_key(key))
        if record is None:
            raise RequestError(401, "invalid API key", "authorization", kind="authentication_error",
                               code="invalid_api_key")
        return record


@dataclass(frozen=True)
class RateCheck:
    """The headers to send either way; ``retry_after_s`` set when refused."""

    headers: dict[str, str]
    retry_after_s: int | None = None


class RateLimits:
    """Per-key requests and tokens over moving windows (the `limits` library, in memory)."""

    def __init__(self, default: RateSettings) -> None:
        self.default = default
        self._limiter = MovingWindowRateLimiter(MemoryStorage())
        self._items: dict[str, RateLimitItem] = {}
        self.refused = 0

    def _item(self, spec: str) -> RateLimitItem:
        item = self._items.get(spec)
        if item is None:
            item = self._items[spec] = parse(spec)
        return item

    def check(self, record: KeyRecord, tokens: int) -> RateCheck:
        """Take one request and ``tokens`` from ``record``'s budgets, or neither if either is out."""
        rate = record.rate or self.default
        req_item, tok_item = self._item(rate.requests), self._item(rate.tokens)
        key = record.id
        tokens = max(0, int(tokens))
        ok_req = self._limiter.test(req_item, "req", key)
        ok_tok = tokens <= tok_item.amount and self._limiter.test(tok_item, "tok", key, cost=max(tokens, 1))
        if ok_req and ok_tok:
            self._limiter.hit(req_item, "req", key)
            if tokens:
                self._limiter.hit(tok_item, "tok", key, cost=tokens)
        req_stats = self._limiter.get_window_stats(req_item, "req", key)
        tok_stats = self._limiter.get_window_stats(tok_item, "tok", key)
        now = time.time()
        headers = {
            "x-ratelimit-limit-requests": str(req_item.amount),
            "x-ratelimit-remaining-requests": str(req_stats.remaining),
            "x-ratelimit-reset-requests": f"{max(0.0, req_stats.reset_time - now):.3f}s",
            "x-ratelimit-limit-tokens": str(tok_item.amount),
            "x-ratelimit-remaining-tokens": str(tok_stats.remaining),
            "x-ratelimit-reset-tokens": f"{max(0.0, tok_stats.reset_time - now):.3f}s",
        }
        if ok_req and ok_tok:
            return RateCheck(headers)
        self.refused += 1
        if not ok_tok and tokens > tok_item.amount:
            raise RequestError(
                400, f"max_tokens {tokens} exceeds this key's token limit {rate.tokens}", "max_tokens",
                headers=headers)
        waits = [s.reset_time - now for ok, s in ((ok_req, req_stats), (ok_tok, tok_stats)) if not ok]
        return RateCheck(headers, max(1, math.ceil(max(waits))))


class AdminGuard:
    """The admin routes' token: from a file; none configured means the routes are closed (403).

    The file is re-read when it changes (checked at most once a second): rotating the token,
    or closing the admin API by removing the file, needs no redeploy.
    """

    HEADER = "x-brownout-admin-token"

    def __init__(self, token_file: str | None, clock: Any = time.monotonic, recheck_s: float = 1.0) -> None:
        self._file = _WatchedFile(Path(token_file).expanduser(), clock, recheck_s) if token_file else None
        self.token: str | None = None
        self._refresh(force=True)

    def _refresh(self, force: bool = False) -> None:
        if self._file is None or not self._file.changed(force):
            return
        try:
            self.token = (self._file.path.read_text(encoding="utf-8").strip() or None) if self._file.exists else None
        except OSError:
            self.token = None

    def check(self, headers: Mapping[str, str]) -> None:
        """Raise 403 (closed, or a wrong token) or 401 (no token sent); return if allowed.

        The token may come as ``Authorization: Bearer <token>`` or ``X-Brownout-Admin-Token``
        (so one client can carry an API key and the admin token at once).
        """
        self._refresh()
        if self.token is None:
            raise RequestError(403, "admin API disabled: no admin token configured (auth.admin_token_file)",
                               None, kind="permission_error")
        offered = []
        if headers.get(self.HEADER):
            offered.append(headers[self.HEADER].strip())
        scheme, _, value = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            offered.append(value.strip())
        if not offered:
            raise RequestError(401, "admin API needs its token: 'X-Brownout-Admin-Token: <token>' or "
                               "'Authorization: Bearer <token>'", "authorization", kind="authentication_error")
        expected = self.token.encode()
        # every offered value is compared, in constant time each, so timing says nothing
        if not any([hmac.compare_digest(o.encode("utf-8", "surrogatepass"), expected) for o in offered]):
            raise RequestError(403, "wrong admin token", "authorization", kind="permission_error")


async def read_body(request: Any, max_bytes: int, timeout_s: float) -> bytes:
    """The body, read with the size limit enforced as it arrives and a timeout on the whole read.

    A declared ``Content-Length`` over the limit is refused before reading anything; a chunked
    body stops being read at the first chunk past the limit (413). A body not complete within
    ``timeout_s`` is a 408.
    """
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise body_too_large(int(length), max_bytes)
    parts: list[bytes] = []
    size = 0

    async def _read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                err = RequestError(413, f"request body exceeds the limit of {max_bytes} bytes (max_body_bytes); "
                                   "reading stopped there", None)
                err.bytes_read = size  # type: ignore[attr-defined]  # how far the read got
                raise err
            parts.append(chunk)

    try:
        await asyncio.wait_for(_read(), timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(408, f"request body not received within {timeout_s:g} s (auth.body_read_timeout_s)",
                           None) from None
    return b"".join(parts)


# -- command line: keys and the admin token ------------------------------------------------------

def add_key(path: Path, tenant: str, tier: str, key_id: str | None = None,
            rate: RateSettings | None = None) -> tuple[str, KeyRecord]:
    """Create a key for ``tenant``; store its hash in ``path`` (0600); return (key, record)."""
    records = load_keys(path)
    key = new_key()
    key_id = key_id or f"key-{secrets.token_hex(4)}"
    if any(r.id == key_id for r in records):
        raise ValueError(f"id: {key_id!r} already exists in {path.name}")
    record = KeyRecord(id=key_id, sha256=hash_key(key), tenant=tenant, tier=Criticality(tier), rate=rate)
    records.append(record)
    doc = {"keys": [r.model_dump(mode="json", exclude_none=True) for r in records]}
    _private_write(path, "# Brownout API keys: SHA-256 hashes only (python -m serve_app.security add-key)\n"
                   + yaml.safe_dump(doc, sort_keys=False))
    return key, record


def ensure_admin_token(path: Path) -> tuple[str, bool]:
    """The admin token in ``path``, created (0600) if missing; (token, created)."""
    if path.exists() and path.read_text(encoding="utf-8").strip():
        return path.read_text(encoding="utf-8").strip(), False
    token = secrets.token_urlsafe(32)
    _private_write(path, token + "\n")
    return token, True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve_app.security", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add-key", help="create an API key, store its hash, print the key once")
    add.add_argument("--file", default=AuthSettings().keys_file)
    add.add_argument("--tenant", required=True)
    add.add_argument("--tier", default="standard", choices=[c.value for c in Criticality])
    add.add_argument("--id", default=None)
    add.add_argument("--requests", default=None, help="e.g. 10/second (default: the config's default_rate)")
    add.add_argument("--tokens", default=None, help="e.g. 2000/second")
    add.add_argument("--key-out", default=None, help="also write the key to this file (0600)")
    tok = sub.add_parser("admin-token", help="create the admin token if missing; print it")
    tok.add_argument("--file", default=AuthSettings().admin_token_file)
    ls = sub.add_parser("list-keys", help="ids, tenants and tiers (never keys)")
    ls.add_argument("--file", default=AuthSettings().keys_file)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "add-key":
            rate = None
            if args.requests or args.tokens:
                rate = RateSettings(**{k: v for k, v in (("requests", args.requests), ("tokens", args.tokens)) if v})
            key, record = add_key(Path(args.file).expanduser(), args.tenant, args.tier, args.id, rate)
            if args.key_out:
                _private_write(Path(args.key_out).expanduser(), key + "\n")
            print(key)
            print(f"(id {record.id}, tenant {record.tenant}, tier {record.tier.value}; only its hash is stored)",
                  file=sys.stderr)
        elif args.cmd == "admin-token":
            token, _ = ensure_admin_token(Path(args.file).expanduser())
            print(token)
        else:
            for r in load_keys(Path(args.file).expanduser()):
                print(f"{r.id}\t{r.tenant}\t{r.tier.value}")
    except (ValueError, ValidationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
