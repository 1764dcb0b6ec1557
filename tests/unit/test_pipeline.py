"""The ingress pipeline with recorded stage calls: gating, order, failure, defer, headers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deployments.enrichments.spool import DurableSpool
from serve_app.pipeline import EXCLUDED, OPTIONAL, LevelSnapshot, Pipeline, RequestContext
from tests.fakes.stages import FakeStages


def snapshot(level: int, off: set[str] = frozenset(), modes: dict | None = None) -> LevelSnapshot:
    return LevelSnapshot(level=level, enabled=frozenset(OPTIONAL) - set(off), modes=modes or {})


def ctx(snap: LevelSnapshot, user: str | None = "user-1", explicit: frozenset = frozenset()) -> RequestContext:
    msgs = [{"role": "user", "content": "  hello  "}]
    return RequestContext(request_id="r1", user=user, messages=msgs, prompt=None,
                          sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}, explicit=explicit,
                          snapshot=snap, key_text="user: hello")


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_all_on_applies_pre_stages_in_declared_order() -> None:
    stages = FakeStages()
    p = Pipeline(stages, None, experiment="exp")
    c = ctx(snapshot(0))
    run(p.pre(c))
    assert c.messages == [{"role": "system", "content": "Be friendly.\nBe brief."},
                          {"role": "user", "content": "hello"}]
    # personalization fills temperature first, then A/B overrides it (declared order)
    assert c.sampling["temperature"] == 0.7 and c.sampling["top_p"] == 0.9
    assert c.variant == "concise" and c.bypassed == [] and c.failed == []
    assert c.headers()["X-Brownout-Level"] == "0" and c.headers()["X-Brownout-Bypassed"] == ""


def test_client_set_sampling_is_never_overridden() -> None:
    p = Pipeline(FakeStages(), None)
    c = ctx(snapshot(0), explicit=frozenset({"temperature"}))
    run(p.pre(c))
    assert c.sampling["temperature"] == 1.0 and c.sampling["top_p"] == 0.9


@pytest.mark.parametrize("level, off", [
    (1, {"semantic_cache_write", "debug_capture", "light_metrics"}),
    (2, {"semantic_cache_write", "debug_capture", "light_metrics", "personalization", "ab_test", "feature_stats"}),
    (3, set(OPTIONAL)),
])
def test_disabled_stages_get_no_call_and_are_disclosed(level: int, off: set[str]) -> None:
    stages = FakeStages()
    p = Pipeline(stages, None, experiment="exp")
    c = ctx(snapshot(level, off))
    run(p.pre(c))
    p.plan_side_effects(c)
    text = run(p.post(c, "answer"))

    async def effects() -> None:
        p.side_effects(c, p.record(c, text, "stop", {"prompt_tokens": 1, "completion_tokens": 1}))
        await p.wait_idle()

    run(effects())
    assert not (set(stages.calls) & off), stages.calls
    assert set(stages.calls) == set(OPTIONAL) - off - {"semantic_cache_write"} | (
        {"semantic_cache_write"} if "semantic_cache_write" not in off else set())
    assert set(c.headers()["X-Brownout-Bypassed"].split(",")) - {""} == off
    if "ab_test" in off:
        assert c.variant == EXCLUDED and c.headers()["X-Brownout-Experiment"] == "exp=excluded"


def test_failed_or_slow_stage_is_bypassed_and_counted() -> None:
    stages = FakeStages()
    stages.fail.add("personalization")
    stages.slow_s["ab_test"] = 5
    p = Pipeline(stages, None, default_timeout_s=0.2, experiment="exp")
    c = ctx(snapshot(0))
    run(p.pre(c))
    assert c.failed == ["personalization", "ab_test"]
    assert p.failures == {"personalization": 1, "ab_test": 1}
    assert c.variant == EXCLUDED  # a failed A/B stage also leaves the experiment
    assert "personalization" in c.headers()["X-Brownout-Bypassed"]


def test_cache_hit_is_applied() -> None:
    stages = FakeStages()
    stages.cache["user: hello"] = "cached!"
    p = Pipeline(stages, None)
    c = ctx(snapshot(0))
    run(p.pre(c))
    assert c.cache_answer == "cached!" and c.headers()["X-Brownout-Cache"] == "hit"


def test_deferred_audit_records_come_out_in_order_when_allowed(tmp_path: Path) -> None:
    stages = FakeStages()
    p = Pipeline(stages, lambda f: DurableSpool(tmp_path, f), experiment="exp")
    off = snapshot(3, set(OPTIONAL), modes={"audit_log": "defer"})
    on = snapshot(0, modes={"audit_log": "defer"})

    async def scenario() -> None:
        for i in range(25):
            c = ctx(off)
            c.request_id = f"r{i}"
            p.plan_side_effects(c)
            assert c.deferred == ["audit_log"] and "audit_log" not in c.bypassed
            p.side_effects(c, p.record(c, "x", "stop", {}))
            await p.wait_idle()
        assert stages.calls["audit_log"] == 0 and p.pending("audit_log") == 25
        # level drops: a new record queues behind the spooled ones, then all drain in order
        c = ctx(on)
        c.request_id = "r25"
        p.plan_side_effects(c)
        p.side_effects(c, p.record(c, "x", "stop", {}))
        await p.wait_idle()
        await p.drain("audit_log")

    run(scenario())
    written = [r["request_id"] for call in stages.payloads["audit_log"] for r in call["records"]]
    assert written == [f"r{i}" for i in range(26)]
    assert p.pending("audit_log") == 0


def test_unavailable_features_are_neither_called_nor_listed() -> None:
    stages = FakeStages()
    p = Pipeline(stages, None, available=frozenset({"ab_test"}), experiment="exp")
    c = ctx(snapshot(0))
    run(p.pre(c))
    assert set(stages.calls) == {"ab_test"} and c.headers()["X-Brownout-Bypassed"] == ""
