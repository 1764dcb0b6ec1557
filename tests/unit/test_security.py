"""The core path's guards, as plain logic: keys, rate limits, the admin token, bounded bodies."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from policies.admission import Criticality
from serve_app.openai_api import ChatCompletionRequest, RequestError, parse_body
from serve_app.security import (
    AdminGuard,
    AuthSettings,
    KeyStore,
    RateLimits,
    RateSettings,
    add_key,
    ensure_admin_token,
    hash_key,
    main,
    read_body,
)
from tests.fakes.clock import FakeClock


def status(fn: Any, *args: Any) -> int:
    with pytest.raises(RequestError) as info:
        fn(*args)
    return info.value.status


# -- keys ----------------------------------------------------------------------------------------

def test_a_key_is_stored_as_its_hash_in_a_private_file(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "keys.yaml"
    key, record = add_key(path, "acme", "critical")
    text = path.read_text()
    assert key not in text and hash_key(key) in text and record.tier is Criticality.CRITICAL
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    add_key(path, "acme", "standard", "dup")
    with pytest.raises(ValueError, match=r"id: 'dup' already exists"):
        add_key(path, "acme", "standard", "dup")


def test_keys_authenticate_and_anything_else_is_a_401(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    key, _ = add_key(path, "acme", "sheddable", "k1")
    store = KeyStore(path)
    record = store.authenticate(f"Bearer {key}")
    assert (record.id, record.tenant, record.tier) == ("k1", "acme", Criticality.SHEDDABLE)
    assert status(store.authenticate, None) == 401
    assert status(store.authenticate, f"Basic {key}") == 401
    assert status(store.authenticate, "Bearer bo-not-a-key") == 401
    assert status(store.authenticate, "Bearer ") == 401


def test_the_keys_file_is_reread_when_it_changes_and_a_broken_one_keeps_the_old_keys(tmp_path: Path) -> None:
    path, clock = tmp_path / "keys.yaml", FakeClock()
    first, _ = add_key(path, "acme", "standard", "k1")
    store = KeyStore(path, clock=clock, recheck_s=1.0)
    second, _ = add_key(path, "beta", "standard", "k2")
    clock.advance(2)
    assert store.authenticate(f"Bearer {second}").tenant == "beta"
    path.write_text("keys: [{id: k3, sha256: nothex, tenant: x}]\n")
    clock.advance(2)
    assert store.authenticate(f"Bearer {first}").tenant == "acme"  # kept
    assert store.load_error and "keys.0.sha256" in store.load_error


def test_cli_adds_a_key_prints_it_once_and_lists_without_keys(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "keys.yaml"
    assert main(["add-key", "--file", str(path), "--tenant", "acme", "--tier", "critical", "--id", "ops",
                 "--requests", "5/second"]) == 0
    key = capsys.readouterr().out.strip()
    assert KeyStore(path).authenticate(f"Bearer {key}").rate == RateSettings(requests="5/second")
    assert main(["list-keys", "--file", str(path)]) == 0
    assert capsys.readouterr().out.strip() == "ops\tacme\tcritical"
    assert main(["add-key", "--file", str(path), "--tenant", "acme", "--requests", "often"]) == 2
    assert "requests: 'often' is not a rate" in capsys.readouterr().err


# -- rate limits ---------------------------------------------------------------------------------

def test_requests_over_the_rate_are_refused_with_retry_after_and_budget_headers(tmp_path: Path) -> None:
    _, record = add_key(tmp_path / "k.yaml", "acme", "standard", "k1", RateSettings(requests="3/minute"))
    rates = RateLimits(RateSettings())
    checks = [rates.check(record, 10) for _ in range(4)]
    assert [c.retry_after_s for c in checks[:3]] == [None, None, None]
    assert [c.headers["x-ratelimit-remaining-requests"] for c in checks[:3]] == ["2", "1", "0"]
    refused = checks[3]
    assert refused.retry_after_s is not None and 1 <= refused.retry_after_s <= 60
    assert refused.headers["x-ratelimit-limit-requests"] == "3" and rates.refused == 1


def test_tokens_are_charged_and_a_refused_request_takes_nothing(tmp_path: Path) -> None:
    _, record = add_key(tmp_path / "k.yaml", "acme", "standard", "k1",
                        RateSettings(requests="100/minute", tokens="100/minute"))
    rates = RateLimits(RateSettings())
    assert rates.check(record, 60).retry_after_s is None
    assert rates.check(record, 60).retry_after_s is not None  # 120 > 100
    ok = rates.check(record, 40)  # the refused 60 took nothing
    assert ok.retry_after_s is None and ok.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RequestError, match=r"max_tokens 500 exceeds this key's token limit 100/minute"):
        rates.check(record, 500)


def test_keys_have_their_own_budgets(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    _, a = add_key(path, "acme", "standard", "a", RateSettings(requests="1/minute"))
    _, b = add_key(path, "beta", "standard", "b", RateSettings(requests="1/minute"))
    rates = RateLimits(RateSettings())
    assert rates.check(a, 1).retry_after_s is None and rates.check(a, 1).retry_after_s is not None
    assert rates.check(b, 1).retry_after_s is None


def test_a_bad_rate_in_the_config_names_the_key_and_value() -> None:
    with pytest.raises(ValueError, match=r"tokens: 'lots' is not a rate"):
        AuthSettings.model_validate({"default_rate": {"tokens": "lots"}})
    with pytest.raises(ValueError, match=r"api_keys"):
        AuthSettings.model_validate({"api_keys": "off"})
    with pytest.raises(ValueError, match=r"max_override_ttl_s"):
        AuthSettings.model_validate({"max_override_ttl_s": float("inf")})


# -- the admin token -----------------------------------------------------------------------------

def test_admin_is_closed_without_a_token_and_checks_it_otherwise(tmp_path: Path) -> None:
    assert status(AdminGuard(None).check, {}) == 403
    assert status(AdminGuard(str(tmp_path / "missing")).check, {"authorization": "Bearer x"}) == 403
    token, created = ensure_admin_token(tmp_path / "admin_token")
    assert created and ensure_admin_token(tmp_path / "admin_token") == (token, False)
    assert stat.S_IMODE((tmp_path / "admin_token").stat().st_mode) == 0o600
    guard = AdminGuard(str(tmp_path / "admin_token"))
    assert status(guard.check, {}) == 401
    assert status(guard.check, {"authorization": "Bearer wrong"}) == 403
    assert status(guard.check, {"x-brownout-admin-token": token[:-1]}) == 403
    guard.check({"authorization": f"Bearer {token}"})
    guard.check({"authorization": "Bearer some-api-key", "x-brownout-admin-token": token})


# -- bodies --------------------------------------------------------------------------------------

class FakeRequest:
    def __init__(self, chunks: Any, headers: dict[str, str] | None = None) -> None:
        self.headers, self._chunks, self.consumed = headers or {}, chunks, 0

    async def stream(self) -> Any:
        async for chunk in self._chunks:
            self.consumed += len(chunk)
            yield chunk


async def endless(chunk: bytes, delay_s: float = 0.0) -> Any:
    while True:
        if delay_s:
            await asyncio.sleep(delay_s)
        yield chunk


def test_a_chunked_body_is_cut_off_at_the_limit_not_read_whole() -> None:
    request = FakeRequest(endless(b"x" * 65536))
    with pytest.raises(RequestError) as info:
        asyncio.run(read_body(request, 1 << 20, 5.0))
    assert info.value.status == 413 and "reading stopped" in info.value.message
    assert request.consumed <= (1 << 20) + 65536


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    request = FakeRequest(endless(b"x"), {"content-length": str(10 << 20)})
    with pytest.raises(RequestError) as info:
        asyncio.run(read_body(request, 1 << 20, 5.0))
    assert info.value.status == 413 and request.consumed == 0


def test_a_slow_body_times_out_with_408() -> None:
    with pytest.raises(RequestError) as info:
        asyncio.run(read_body(FakeRequest(endless(b"x", 0.05)), 1 << 20, 0.2))
    assert info.value.status == 408


def test_a_body_within_limits_is_read_whole() -> None:
    async def chunks() -> Any:
        for part in (b'{"a":', b' 1}'):
            yield part

    assert asyncio.run(read_body(FakeRequest(chunks()), 1024, 1.0)) == b'{"a": 1}'


def test_a_lone_surrogate_is_a_400_naming_the_field() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    with pytest.raises(RequestError) as info:
        parse_body(raw, ChatCompletionRequest, 1 << 20)
    assert info.value.status == 400 and info.value.param == "messages.0.content"


def test_keys_file_yaml_is_what_the_docs_say(tmp_path: Path) -> None:
    add_key(tmp_path / "k.yaml", "acme", "standard", "k1")
    doc = yaml.safe_load((tmp_path / "k.yaml").read_text())
    assert set(doc["keys"][0]) == {"id", "sha256", "tenant", "tier"}


def test_the_admin_token_file_is_reread_removing_it_closes_the_api(tmp_path: Path) -> None:
    clock, path = FakeClock(), tmp_path / "admin_token"
    token, _ = ensure_admin_token(path)
    guard = AdminGuard(str(path), clock=clock)
    guard.check({"x-brownout-admin-token": token})
    path.unlink()
    clock.advance(2)
    assert status(guard.check, {"x-brownout-admin-token": token}) == 403
    rotated, _ = ensure_admin_token(path)
    clock.advance(2)
    assert status(guard.check, {"x-brownout-admin-token": token}) == 403  # the old one is wrong now
    guard.check({"x-brownout-admin-token": rotated})
