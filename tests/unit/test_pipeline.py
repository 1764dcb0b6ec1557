"""The ingress pipeline with recorded stage calls: gating, order, failure, defer, headers, batching,
and a toy feature registered from outside."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from deployments.enrichments import registry
from deployments.enrichments.ab_test import EXCLUDED
from deployments.enrichments.base import run_calls
from deployments.enrichments.feature import RequestState
from deployments.enrichments.spool import DurableSpool
from policies.config import PolicyError, parse_policy
from policies.features import OffMode, PolicyView, enabled_set, optional_names, registered
from serve_app.pipeline import Pipeline
from tests.fakes import toy_feature
from tests.fakes.stages import FakeStages

FEATURES = registry.features()
OPTIONAL = set(optional_names())


def view(level: int, off: set[str] = frozenset(), modes: dict | None = None) -> PolicyView:
    return PolicyView(level=level, enabled=frozenset(optional_names()) - set(off), modes=modes or {})


def ctx(v: PolicyView, user: str | None = "user-1", explicit: frozenset = frozenset()) -> RequestState:
    msgs = [{"role": "user", "content": "  hello  "}]
    return RequestState(request_id="r1", user=user, messages=msgs, prompt=None,
                        sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}, explicit=explicit,
                        view=v, key_text="user: hello")


def pipeline(stages: FakeStages, spool_for=None, **kw) -> Pipeline:  # type: ignore[no-untyped-def]
    return Pipeline(FEATURES, stages, spool_for, settings={"ab_test": {"experiment": "exp"}}, **kw)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def whole_request(p: Pipeline, c: RequestState, answer: str = "answer") -> None:
    async def go() -> None:
        await p.pre(c)
        c.text = answer
        await p.post(c)
        p.decide_side_effects(c)
        await p.settle(c, c.record("stop", {"prompt_tokens": 1, "completion_tokens": 1}))
        await p.wait_idle()

    run(go())


def test_all_on_applies_pre_stages_in_declared_order() -> None:
    p = pipeline(FakeStages())
    c = ctx(view(0))
    run(p.pre(c))
    assert c.messages == [{"role": "system", "content": "Be friendly.\nBe brief."},
                          {"role": "user", "content": "hello"}]
    # personalization fills temperature first, then A/B overrides it (declared order)
    assert c.sampling["temperature"] == 0.7 and c.sampling["top_p"] == 0.9
    assert c.tags["variant"] == "concise" and c.bypassed == [] and c.failed == []
    assert c.headers()["X-Brownout-Level"] == "0" and c.headers()["X-Brownout-Bypassed"] == ""
    assert c.headers()["X-Brownout-Experiment"] == "exp=concise"


def test_client_set_sampling_is_never_overridden() -> None:
    p = pipeline(FakeStages())
    c = ctx(view(0), explicit=frozenset({"temperature"}))
    run(p.pre(c))
    assert c.sampling["temperature"] == 1.0 and c.sampling["top_p"] == 0.9


@pytest.mark.parametrize("level, off", [
    (1, {"semantic_cache_write", "debug_capture", "light_metrics"}),
    (2, {"semantic_cache_write", "debug_capture", "light_metrics", "personalization", "ab_test", "feature_stats"}),
    (3, OPTIONAL),
])
def test_disabled_stages_get_no_call_and_are_disclosed(level: int, off: set[str]) -> None:
    stages = FakeStages()
    p = pipeline(stages)
    c = ctx(view(level, off), user=None)  # no user: nothing personal, so the answer is cacheable
    whole_request(p, c)
    assert not (set(stages.calls) & off), stages.calls
    assert set(stages.calls) == OPTIONAL - off
    assert set(c.headers()["X-Brownout-Bypassed"].split(",")) - {""} == off
    assert p.bypassed == {f: 1 for f in off}
    if "ab_test" in off:
        assert c.tags["variant"] == EXCLUDED and c.headers()["X-Brownout-Experiment"] == "exp=excluded"


def test_one_handle_call_per_deployment_per_phase_and_none_for_in_process_stages() -> None:
    stages = FakeStages()
    p = pipeline(stages)
    whole_request(p, ctx(view(0), user=None))
    hosted = {f.host for f in FEATURES if f.host is not None}
    # pre: Personalization + SemanticCache; side effects: SemanticCache, AuditLog, Telemetry
    assert p.handle_calls == {"Personalization": 1, "SemanticCache": 2, "AuditLog": 1, "Telemetry": 1}
    assert set(p.handle_calls) == hosted
    assert sum(p.handle_calls.values()) == 5  # plus the model: 6 handle calls, down from 11
    assert stages.batches[None] == 3  # pre, post and side effects in the ingress process: no RPC
    p3 = pipeline(FakeStages())
    whole_request(p3, ctx(view(3, OPTIONAL)))
    assert sum(p3.handle_calls.values()) == 0


def test_failed_or_slow_stage_is_bypassed_and_counted() -> None:
    stages = FakeStages()
    stages.fail.add("personalization")
    stages.fail.add("ab_test")
    stages.slow_s["semantic_cache_lookup"] = 5
    p = pipeline(stages, default_timeout_s=0.2)
    c = ctx(view(0))
    run(p.pre(c))
    assert c.failed == ["personalization", "ab_test", "semantic_cache_lookup"]
    assert p.failures == {"personalization": 1, "ab_test": 1, "semantic_cache_lookup": 1}
    assert c.tags["variant"] == EXCLUDED  # a failed A/B stage also leaves the experiment
    assert "personalization" in c.headers()["X-Brownout-Bypassed"]


def test_a_stage_that_keeps_failing_opens_its_circuit_and_is_probed_back() -> None:
    """Two failures in a row open personalization's circuit: the next requests bypass it with no
    call (outcome circuit_open); after open_s one probe goes through and, well again, closes it."""
    from serve_app.breaker import BreakerSettings
    from tests.fakes.clock import FakeClock

    stages, clock, outcomes = FakeStages(), FakeClock(), []
    stages.fail.add("personalization")
    p = pipeline(stages, breaker=BreakerSettings(failure_threshold=2, open_s=10, probes=1), clock=clock,
                 on_outcome=lambda f, o: outcomes.append((f, o)))
    for _ in range(4):
        c = ctx(view(0))
        run(p.pre(c))
        assert "personalization" in c.failed
    assert stages.calls["personalization"] == 2
    assert outcomes.count(("personalization", "circuit_open")) == 2
    assert p.counters()["circuits"]["personalization"]["state"] == "open"
    assert p.counters()["circuits"]["ab_test"]["state"] == "closed"
    stages.fail.discard("personalization")
    clock.advance(10)
    c = ctx(view(0))
    run(p.pre(c))
    assert stages.calls["personalization"] == 3 and "personalization" not in c.failed
    assert p.counters()["circuits"]["personalization"]["state"] == "closed"


def test_cache_hit_is_applied_and_not_written_back() -> None:
    stages = FakeStages()
    stages.cache["user: hello"] = "cached!"
    p = pipeline(stages)
    c = ctx(view(0), user=None)
    whole_request(p, c)
    assert c.answer == "cached!" and c.headers()["X-Brownout-Cache"] == "hit"
    assert stages.calls["semantic_cache_write"] == 0


def test_personal_answers_are_not_cached() -> None:
    stages = FakeStages()
    p = pipeline(stages)
    whole_request(p, ctx(view(0), user="user-1"))  # personalized and in the treatment arm
    assert stages.calls["semantic_cache_write"] == 0


def test_default_mode_applies_the_configured_result() -> None:
    stages = FakeStages()
    p = pipeline(stages)
    v = PolicyView(level=2, enabled=frozenset(OPTIONAL - {"personalization"}),
                   modes={"personalization": OffMode.DEFAULT},
                   defaults={"personalization": {"system_prefix": "Be kind."}})
    c = ctx(v)
    run(p.pre(c))
    assert stages.calls["personalization"] == 0 and "personalization" in c.bypassed
    assert c.messages[0] == {"role": "system", "content": "Be kind.\nBe brief."}


def test_deferred_audit_records_come_out_in_order_when_allowed(tmp_path: Path) -> None:
    stages = FakeStages()
    p = pipeline(stages, lambda f: DurableSpool(tmp_path, f))
    off = view(3, OPTIONAL, modes={"audit_log": OffMode.DEFER})
    on = view(0, modes={"audit_log": OffMode.DEFER})

    async def scenario() -> None:
        for i in range(25):
            c = ctx(off)
            c.request_id = f"r{i}"
            p.decide_side_effects(c)
            assert c.deferred == [] and "audit_log" not in c.bypassed  # nothing promised before the fsync
            await p.settle(c, c.record("stop", {}))
            assert c.deferred == ["audit_log"]
            await p.wait_idle()
        assert stages.calls["audit_log"] == 0 and p.pending("audit_log") == 25
        # level drops: a new record queues behind the spooled ones, then all drain in order
        c = ctx(on)
        c.request_id = "r25"
        p.decide_side_effects(c)
        await p.settle(c, c.record("stop", {}))
        await p.wait_idle()
        await p.drain("audit_log")

    run(scenario())
    written = [r["request_id"] for call in stages.payloads["audit_log"] for r in call["records"]]
    assert written == [f"r{i}" for i in range(26)]
    assert p.pending("audit_log") == 0
    assert stages.calls["audit_log"] == 1  # the whole backlog in one batch


def test_features_not_given_are_neither_called_nor_listed() -> None:
    stages = FakeStages()
    p = Pipeline(registry.features(["ab_test"]), stages, None)
    c = ctx(view(0))
    run(p.pre(c))
    assert set(stages.calls) == {"ab_test"} and c.headers()["X-Brownout-Bypassed"] == ""


# -- a feature added from outside: one module (tests/fakes/toy_feature.py) + one registry line ----

TOY_POLICY = {
    "level1": {"trigger": {"queue_length": 4}, "disable": ["debug_capture"]},
    "level2": {"trigger": {"queue_length": 16}, "disable": ["toy_stamp"]},
    "level3": {"trigger": {"queue_length": 48}, "disable": ["all_non_critical"]},
}


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_a_registered_toy_feature_runs_is_bypassed_at_its_level_and_is_counted(level: int) -> None:
    with registered(toy_feature.SPEC):
        config = parse_policy(TOY_POLICY)
        assert config.off_levels()["toy_stamp"] == 2
        feats = registry.features()  # the registry resolves the toy's module like any other
        assert [f.name for f in feats][-1] == "toy_stamp"
        toy = feats[-1]
        local = {"toy_stamp": toy.worker.build({})}
        stages = FakeStages()

        async def call(host, calls):  # type: ignore[no-untyped-def]
            # the toy's real worker in-process; every other feature recorded by the fake
            mine = [i for i, (f, _) in enumerate(calls) if f in local]
            theirs = [i for i in range(len(calls)) if i not in mine]
            out = dict(zip(mine, await run_calls(local, [calls[i] for i in mine])))
            if theirs:
                out.update(zip(theirs, await stages(host, [calls[i] for i in theirs])))
            return [out[i] for i in range(len(calls))]

        p = Pipeline(feats, call, None)
        v = PolicyView(level=level, enabled=enabled_set(level, config.off_levels()))
        c = ctx(v)
        whole_request(p, c)
    bypassed = c.headers()["X-Brownout-Bypassed"].split(",")
    if level < 2:
        assert c.headers()["X-Toy-Stamp"] == "stamped:r1" and "toy_stamp" not in bypassed
        assert local["toy_stamp"].counters() == {"toy_stamp": 1} and p.calls["toy_stamp"] == 1
        assert "toy_stamp" not in p.handle_calls  # it runs in the ingress process
    else:
        assert "X-Toy-Stamp" not in c.headers() and "toy_stamp" in bypassed
        assert local["toy_stamp"].counters() == {"toy_stamp": 0} and p.bypassed["toy_stamp"] == 1
    assert "toy_stamp" not in registry.REGISTRY  # unregistered on leaving the block


def test_a_mode_the_feature_does_not_support_is_rejected_at_load() -> None:
    with registered(toy_feature.SPEC):
        with pytest.raises(PolicyError, match=r"features\.toy_stamp\.mode: feature 'toy_stamp' does not "
                                              r"support off-mode 'default'; it supports 'skip'"):
            parse_policy({**TOY_POLICY, "features": {"toy_stamp": {"mode": "default", "default": {}}}})
    with pytest.raises(PolicyError, match=r"features\.prompt_rewrite\.mode: feature 'prompt_rewrite' does not "
                                          r"support off-mode 'default'"):
        parse_policy({"features": {"prompt_rewrite": {"mode": "default", "default": {}}}})
    with pytest.raises(PolicyError, match=r"unknown feature 'toy_stamp'"):
        parse_policy(TOY_POLICY)  # not registered any more


# -- durable before promised, exactly once, bounded ------------------------------------------------

DEFER_AUDIT = {"audit_log": OffMode.DEFER}


def test_settle_names_a_deferral_only_once_it_is_on_disk(tmp_path: Path) -> None:
    """The promise (ctx.deferred -> X-Brownout-Deferred) comes after the fsync: at the moment the
    name appears, the record is already in the spool file."""
    spool_dir = tmp_path / "spool"
    p = pipeline(FakeStages(), lambda f: DurableSpool(spool_dir, f))
    c = ctx(view(3, OPTIONAL, modes=DEFER_AUDIT))

    async def go() -> list[str]:
        p.decide_side_effects(c)
        assert c.planned == ["audit_log"] and c.deferred == [] and "X-Brownout-Deferred" not in c.headers()
        assert "audit_log" not in c.bypassed
        return await p.settle(c, c.record("stop", {}))

    assert run(go()) == ["audit_log"] and c.headers()["X-Brownout-Deferred"] == "audit_log"
    on_disk = [json.loads(line) for line in (spool_dir / "audit_log.spool").read_bytes().splitlines()]
    assert [r["record_id"] for r in on_disk] == ["r1:audit_log"]
    assert p.deferred == {"audit_log": 1}


def test_a_stream_promises_nothing_in_its_headers(tmp_path: Path) -> None:
    """Stream rule: headers are built after decide_side_effects only; the deferral is named by
    what settle returns at the end of the stream (its final event)."""
    p = pipeline(FakeStages(), lambda f: DurableSpool(tmp_path, f))
    c = ctx(view(3, OPTIONAL, modes=DEFER_AUDIT))
    p.decide_side_effects(c)
    headers = c.headers()
    assert "X-Brownout-Deferred" not in headers
    assert "audit_log" not in headers["X-Brownout-Bypassed"].split(",")
    assert run(p.settle(c, c.record("stop", {}))) == ["audit_log"]


def test_a_full_spool_is_not_promised_but_disclosed_and_counted(tmp_path: Path) -> None:
    p = pipeline(FakeStages(), lambda f: DurableSpool(tmp_path, f, max_bytes=10))
    c = ctx(view(3, OPTIONAL, modes=DEFER_AUDIT))
    assert run(p.settle(c, c.record("stop", {}))) == []
    assert c.deferred == [] and "audit_log" in c.headers()["X-Brownout-Bypassed"].split(",")
    assert p.counters()["not_spooled"] == {"audit_log:spool_full": 1}
    assert p.counters()["spools"]["audit_log"]["refused_full"] == 1


def test_concurrent_requests_share_the_deferral_fsync(tmp_path: Path) -> None:
    p = pipeline(FakeStages(), lambda f: DurableSpool(tmp_path, f))
    cs = []
    for i in range(40):
        c = ctx(view(3, OPTIONAL, modes=DEFER_AUDIT))
        c.request_id = f"r{i}"
        cs.append(c)

    async def go() -> None:
        await p.open_spool("audit_log")
        await asyncio.gather(*(p.settle(c, c.record("stop", {})) for c in cs))

    run(go())
    stats = p.counters()["spools"]["audit_log"]
    assert stats["appended"] == 40 and stats["fsyncs"] < 40
    assert all(c.deferred == ["audit_log"] for c in cs)


def test_a_request_is_settled_exactly_once_whichever_end_comes_first(tmp_path: Path) -> None:
    stages = FakeStages()
    p = pipeline(stages)
    c = ctx(view(0), user=None)

    async def go() -> None:
        await p.settle(c, c.record("stop", {}))
        p.abandon(c, "client_dropped")  # the stream's end callback, after the last byte
        assert await p.settle_outcome(c, "failed") == []
        await p.settle(c, c.record("stop", {}))
        await p.wait_idle()

    run(go())
    assert stages.calls["audit_log"] == 1 and p.audited == {"ok": 1}
    (payload,) = stages.payloads["audit_log"]
    assert payload["records"][0]["record_id"] == "r1:audit_log" and payload["records"][0]["outcome"] == "ok"


@pytest.mark.parametrize("outcome, status", [("failed", 500), ("client_dropped", None), ("refused", 503)])
def test_failed_dropped_and_refused_requests_are_audited_with_their_outcome(outcome: str, status: int | None) -> None:
    stages = FakeStages()
    p = pipeline(stages)
    c = ctx(view(0), user=None)
    c.text = "partial ans"

    async def go() -> None:
        p.abandon(c, outcome, status)
        await p.wait_idle()

    run(go())
    # only the audit log takes failures: no cache write, no stats of a failed request
    assert set(stages.calls) == {"audit_log"} and stages.calls["audit_log"] == 1
    (rec,) = stages.payloads["audit_log"][0]["records"]
    assert rec["outcome"] == outcome and rec.get("status") == status and rec["record_id"] == "r1:audit_log"
    assert p.audited == {outcome: 1}


def test_an_unknown_outcome_is_refused() -> None:
    p = pipeline(FakeStages())
    with pytest.raises(ValueError, match="outcome must be one of"):
        run(p.settle_outcome(ctx(view(0)), "exploded"))


def test_a_refused_request_while_the_audit_is_deferred_is_spooled(tmp_path: Path) -> None:
    p = pipeline(FakeStages(), lambda f: DurableSpool(tmp_path, f))
    c = ctx(view(3, OPTIONAL, modes=DEFER_AUDIT))
    assert run(p.settle_outcome(c, "refused", 429)) == ["audit_log"]
    assert p.pending("audit_log") == 1 and p.bypassed == {}  # nothing else counted for a refusal


def test_records_json_cannot_hold_are_escaped_and_counted_never_lost(tmp_path: Path) -> None:
    stages = FakeStages()
    p = pipeline(stages, lambda f: DurableSpool(tmp_path, f))
    c = ctx(view(3, OPTIONAL, modes=DEFER_AUDIT))
    c.tags["weird"] = {1, 2}
    c.tags["latency"] = float("nan")
    c.messages = [{"role": "user", "content": "lone \ud800 surrogate"}]
    assert run(p.settle(c, c.record("stop", {}))) == ["audit_log"]
    assert p.escaped == {"audit_log": 2}
    c2 = ctx(view(0, modes=DEFER_AUDIT))
    c2.request_id = "r2"

    async def drain() -> None:
        await p.drain("audit_log")

    run(drain())
    (rec,) = stages.payloads["audit_log"][0]["records"]
    assert rec["weird"] == {"$unencodable": "set"} and rec["latency"] == "nan"
    assert rec["prompt"][0]["content"] == "lone \ud800 surrogate"


def test_a_failing_side_effect_task_is_counted_not_silent(tmp_path: Path) -> None:
    async def broken(host, calls):  # type: ignore[no-untyped-def]
        raise AssertionError("a bug in the caller")  # not an Exception a stage call maps

    p = Pipeline(FEATURES, broken, None, settings={"ab_test": {"experiment": "exp"}})

    async def go() -> None:
        c = ctx(view(0), user=None)
        p._spawn(_raise())
        await p.settle(c, c.record("stop", {}))
        await p.wait_idle()

    async def _raise() -> None:
        raise KeyError("boom")

    run(go())
    assert p.task_errors["KeyError"] == 1


def test_background_side_effects_are_capped_and_the_overflow_is_counted(tmp_path: Path) -> None:
    stages = FakeStages()
    stages.slow_s["light_metrics"] = 0.3
    p = pipeline(stages, lambda f: DurableSpool(tmp_path, f), max_background=2)
    on = view(0, modes=DEFER_AUDIT)

    async def go() -> None:
        for i in range(5):
            c = ctx(on, user=None)
            c.request_id = f"r{i}"
            await p.settle(c, c.record("stop", {}))
            assert len(p._background) <= 2
        await p.wait_idle()
        await p.drain("audit_log")

    run(go())
    # 2 requests ran in the background; for the 3 others the audit record was made durable
    # inline (then drained), the rest shed and counted
    assert p.shed["light_metrics"] == 3 and "audit_log" not in p.shed
    written = sorted(r["request_id"] for call in stages.payloads["audit_log"] for r in call["records"])
    assert written == [f"r{i}" for i in range(5)]


def test_max_background_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_background must be >= 1, got 0"):
        pipeline(FakeStages(), max_background=0)


def test_drain_adopts_orphaned_spools_of_another_replica(tmp_path: Path) -> None:
    """A replica scaled down left records under its rank's name; the survivor drains them."""
    gone = DurableSpool(tmp_path, "audit_log-ingress2")
    for i in range(3):
        gone.append({"request_id": f"old{i}"})  # written before records carried ids
    gone.close()  # its process stopped: the lock is free
    stages = FakeStages()
    p = pipeline(stages, lambda f: DurableSpool(tmp_path, f"{f}-ingress0"))
    run(p.drain("audit_log"))
    written = [r for call in stages.payloads["audit_log"] for r in call["records"]]
    assert [r["request_id"] for r in written] == ["old0", "old1", "old2"]
    assert [r["record_id"] for r in written] == ["old0:audit_log", "old1:audit_log", "old2:audit_log"]
    assert not (tmp_path / "audit_log-ingress2.spool").exists()


def test_abandon_when_the_cap_is_reached_spools_the_audit_record(tmp_path: Path) -> None:
    stages = FakeStages()
    stages.slow_s["audit_log"] = 0.3
    p = pipeline(stages, lambda f: DurableSpool(tmp_path, f), max_background=1)
    on = view(0, modes=DEFER_AUDIT)

    async def go() -> None:
        await p.open_spool("audit_log")
        first = ctx(on, user=None)
        await p.settle(first, first.record("stop", {}))  # holds the only background slot
        dropped = ctx(on, user=None)
        dropped.request_id = "r2"
        p.abandon(dropped, "client_dropped")
        await p.wait_idle()
        await asyncio.sleep(0.05)  # the group commit's flusher

    run(go())
    assert p.pending("audit_log") == 1 and p.deferred == {"audit_log": 1} and p.shed == {}


# -- per-feature cost and bypasses by cause (issue 13) ----------------------------------------------


def test_bypasses_are_counted_by_cause_level_override_error_timeout_breaker() -> None:
    from serve_app.breaker import BreakerSettings

    stages, hooked = FakeStages(), []
    stages.fail.add("personalization")
    stages.slow_s["semantic_cache_lookup"] = 5
    p = pipeline(stages, default_timeout_s=0.2, breaker=BreakerSettings(failure_threshold=1, open_s=60),
                 on_bypass=lambda f, c: hooked.append((f, c)))
    p.off_levels = {"ab_test": 2, "prompt_rewrite": 1}
    # level 1: prompt_rewrite off by the level; ab_test off although level 1 allows it: an override
    v = PolicyView(level=1, enabled=frozenset(OPTIONAL - {"prompt_rewrite", "ab_test"}))
    run(p.pre(ctx(v)))
    first = p.bypass_counts()
    assert first["prompt_rewrite"] == {"level": 1} and first["ab_test"] == {"override": 1}
    assert first["personalization"] == {"error": 1} and first["semantic_cache_lookup"] == {"timeout": 1}
    run(p.pre(ctx(v)))  # both circuits opened on their first failure: no call, bypassed at once
    second = p.bypass_counts()
    assert second["personalization"] == {"error": 1, "breaker": 1}
    assert second["semantic_cache_lookup"] == {"timeout": 1, "breaker": 1}
    assert sorted(hooked) == sorted((f, c) for f, by in second.items() for c, n in by.items() for _ in range(n))
    assert {c for f, c in hooked} <= {"level", "override", "error", "timeout", "breaker"}
    assert p.counters()["bypassed_by_cause"] == second


def test_without_the_policy_every_disabled_stage_counts_as_the_level() -> None:
    p = pipeline(FakeStages())
    run(p.pre(ctx(view(0, off={"ab_test"}))))
    assert p.bypass_counts()["ab_test"] == {"level": 1}


def test_a_timeout_reported_by_the_worker_is_a_timeout() -> None:
    from deployments.enrichments.base import Outcome

    async def call(host, calls):  # type: ignore[no-untyped-def]
        return [Outcome(error="TimeoutError") for _ in calls]

    p = Pipeline(registry.features(["personalization"]), call, None)
    run(p.pre(ctx(view(0))))
    assert p.bypass_counts() == {"personalization": {"timeout": 1}}


def test_each_stage_call_is_costed_with_its_wall_time_and_the_workers_cpu() -> None:
    from deployments.enrichments.base import Outcome
    from tests.fakes.clock import FakeClock

    clock = FakeClock()

    async def call(host, calls):  # type: ignore[no-untyped-def]
        clock.advance(0.25 if host == "SemanticCache" else 0.01)  # the stage's wall time, as the ingress sees it
        return [Outcome(result={}, cpu_s=0.02) if f != "ab_test" else Outcome(error="RuntimeError")
                for f, _ in calls]

    p = Pipeline(registry.features(["semantic_cache_lookup", "ab_test"]), call, None, clock=clock)
    for _ in range(4):
        run(p.pre(ctx(view(0))))
    costs = p.costs()
    lookup, ab = costs["semantic_cache_lookup"], costs["ab_test"]
    assert lookup["calls"] == 4 and lookup["failures"] == 0 and lookup["cpu_calls"] == 4
    assert lookup["cpu_ms_per_call"] == pytest.approx(20.0)
    assert 10.0 <= lookup["latency_ms_per_call"] <= 260.0  # sent concurrently with the in-process one
    assert ab["calls"] == 4 and ab["failures"] == 4 and ab["cpu_calls"] == 0  # a failure reports no CPU
    assert lookup["window"]["calls"] == 4
    assert set(costs) == {"semantic_cache_lookup", "ab_test"}


def test_a_slow_stage_ranks_first_by_cost() -> None:
    from policies.feature_cost import merge, rank

    stages = FakeStages()
    stages.slow_s["semantic_cache_lookup"] = 0.05
    p = pipeline(stages)
    for _ in range(3):
        run(p.pre(ctx(view(0))))
    ranked = rank(merge(p.costs(), {}))
    assert ranked[0]["feature"] == "semantic_cache_lookup", [(r["feature"], r["cost_ms"]) for r in ranked]
    assert ranked[0]["calls"] == 3 and ranked[0]["window"]["cost_ms"] >= 150
