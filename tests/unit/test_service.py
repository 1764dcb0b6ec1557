"""PolicyCore (the policy actor's behaviour without Ray): reports, ticks, overrides, persistence."""

from __future__ import annotations

import json

from policies.config import parse_policy
from policies.features import OffMode
import pytest

from policies.service import OUTAGE_SAME_S, OUTAGES_KEPT, PolicyCore
from tests.fakes.clock import FakeClock

POLICY = {
    "stale_after_s": 2,
    "level1": {"trigger": {"queue_length": 4}, "recover": {"queue_length": 1},
               "recover_dwell_s": 3, "cooldown_s": 1, "disable": ["debug_capture"]},
    "level2": {"trigger": {"queue_length": 8}, "recover_dwell_s": 3, "cooldown_s": 1,
               "disable": ["ab_test"]},
    "level3": {"trigger": {"queue_length": 12}, "recover_dwell_s": 3, "cooldown_s": 1,
               "disable": ["all_non_critical"]},
    "features": {"audit_log": {"mode": "defer"}},
}


def core(clock: FakeClock, store: dict | None = None) -> PolicyCore:
    store = store if store is not None else {}
    return PolicyCore(parse_policy(POLICY), clock=clock, persist=lambda b: store.__setitem__("k", b),
                      restore=lambda: store.get("k"))


def test_reports_drive_the_level_up_and_stepwise_down() -> None:
    clock = FakeClock()
    c = core(clock)
    c.report("model:a", {"queue_length": 10})
    tr = c.tick()
    assert tr is not None and c.view().level == 2
    assert "ab_test" not in c.view().enabled and "debug_capture" not in c.view().enabled
    levels = []
    for _ in range(40):
        clock.advance(0.25)
        c.report("model:a", {"queue_length": 0})
        c.tick()
        levels.append(c.view().level)
    assert levels[-1] == 0
    assert [lv for i, lv in enumerate(levels) if i == 0 or levels[i - 1] != lv] == [2, 1, 0]
    assert [t["to"] for t in c.history()] == [2, 1, 0]
    assert c.view().modes == {"audit_log": OffMode.DEFER}
    assert c.get_state()["modes"] == {"audit_log": "defer"}


def test_a_silent_source_is_stale_then_forgotten_after_forget_after_s() -> None:
    """``forget_after_s`` from the config: the silent source stays (stale) until then, is gone
    after; unset, it is 60 s (or ``stale_after_s`` where longer)."""
    clock = FakeClock()
    c = PolicyCore(parse_policy({**POLICY, "forget_after_s": 10}), clock=clock)
    c.report("model:a", {"queue_length": 0})
    c.report("ingress:a", {"inflight": 0})
    for t in range(12):
        clock.advance(1)
        c.report("ingress:a", {"inflight": 0})
        c.tick()
        state = c.get_state()
        if t + 1 < 10:
            assert "model:a" in state["sources"], t
        if t + 1 > 10:
            assert "model:a" not in state["sources"] and state["sources"] == ["ingress:a"], t
    assert parse_policy(POLICY).forget_s == 60.0
    assert parse_policy({**POLICY, "stale_after_s": 90}).forget_s == 90.0


def test_unknown_signal_is_counted_not_raised() -> None:
    c = core(FakeClock())
    assert c.report("x", {"queue_lenght": 3}) is False
    assert c.report_errors == 1


def test_stale_model_report_holds_the_level() -> None:
    clock = FakeClock()
    c = core(clock)
    c.report("model:a", {"queue_length": 5})
    c.tick()
    assert c.view().level == 1
    clock.advance(3)  # the model's report is now stale (stale_after_s 2)
    c.report("ingress:a", {"inflight": 0})
    for _ in range(20):
        clock.advance(0.5)
        c.report("ingress:a", {"inflight": 0})
        c.tick()
    assert c.view().level == 1
    assert c.get_state()["recovery_blocked_by"] == ["queue_length"]


def test_rejected_config_keeps_the_running_one() -> None:
    c = core(FakeClock())
    before = c.config
    out = c.update_config({"level1": {"trigger": {"queue_length": 4}, "recover": {"queue_length": 9}}})
    assert out["ok"] is False and "level1.recover.queue_length: 9" in out["error"]
    assert c.config is before and c.last_config_error
    out = c.update_config({**POLICY, "level1": {**POLICY["level1"], "trigger": {"queue_length": 6}}})
    assert out == {"ok": True, "changed": True, "config_version": 2}
    assert c.config.trigger_thresholds(1) == {"queue_length": 6}
    assert c.update_config({**POLICY, "level1": {**POLICY["level1"], "trigger": {"queue_length": 6}}})["changed"] is False


def test_override_validation_errors_are_returned() -> None:
    c = core(FakeClock())
    assert c.set_override(level=9)["ok"] is False
    assert "exactly one" in c.set_override(level=1, feature="ab_test", enabled=True)["error"]
    assert "needs 'enabled'" in c.set_override(feature="ab_test")["error"]
    assert "critical" in c.set_override(feature="model", enabled=False)["error"]


def test_restart_restores_config_pin_and_feature_overrides() -> None:
    clock, store = FakeClock(), {}
    c = core(clock, store)
    c.update_config({**POLICY, "stale_after_s": 3})
    c.set_override(level=3, ttl_s=100, note="incident 42")
    c.set_override(feature="debug_capture", enabled=True)
    saved = json.loads(store["k"])
    assert saved["pin"]["level"] == 3

    clock.advance(1)
    again = core(clock, store)  # what Ray's restart of the actor does
    assert again.config.stale_after_s == 3 and again.config_version == 2
    assert again.view().level == 3 and again.get_state()["pin"]["note"] == "incident 42"
    assert "debug_capture" in again.view().enabled
    clock.advance(100)
    again.tick()
    assert again.get_state()["pin"] is None


def test_the_model_outages_replicas_report_are_merged_kept_and_survive_a_restart() -> None:
    clock, store = FakeClock(), {}
    c = core(clock, store)
    assert c.model_outages() == []
    assert c.record_outage(1000.0, 120.0) == [120.0]
    # a second ingress replica saw the same outage begin later and end a probe later: one outage,
    # at the longer duration, either way round
    assert c.record_outage(1000.0 + OUTAGE_SAME_S - 0.5, 118.0) == [120.0]
    assert c.record_outage(1001.0, 125.0) == [125.0]
    assert c.record_outage(1000.0 + OUTAGE_SAME_S + 0.5, 60.0) == [125.0, 60.0]  # another outage
    for i, d in enumerate((30.0, 40.0, 50.0, 70.0)):
        c.record_outage(2000.0 + 100 * i, d)
    assert c.model_outages() == [60.0, 30.0, 40.0, 50.0, 70.0] and len(c.model_outages()) == OUTAGES_KEPT
    assert c.record_outage(500.0, 9.0) == [60.0, 30.0, 40.0, 50.0, 70.0]  # older than all kept: dropped
    for bad in ({"ended_at": float("nan")}, {"duration_s": -1.0}, {"duration_s": float("inf")},
                {"ended_at": "3000"}, {"duration_s": True}):
        args = {"ended_at": 3000.0, "duration_s": 10.0, **bad}
        (name,) = bad
        with pytest.raises(ValueError, match=f"record_outage: {name}="):
            c.record_outage(**args)
    assert c.model_outages() == [60.0, 30.0, 40.0, 50.0, 70.0]  # a bad report keeps nothing
    assert [o["duration_s"] for o in c.get_state()["model_outages"]] == [60.0, 30.0, 40.0, 50.0, 70.0]

    again = core(clock, store)  # what Ray's restart of the actor does
    assert again.model_outages() == [60.0, 30.0, 40.0, 50.0, 70.0]
    saved = json.loads(store["k"])
    saved["outages"][0] = [2500.0, -5.0]  # one corrupt entry loses only itself
    store["k"] = json.dumps(saved).encode()
    assert core(clock, store).model_outages() == [30.0, 40.0, 50.0, 70.0]


def test_corrupt_snapshot_starts_from_given_config() -> None:
    c = PolicyCore(parse_policy(POLICY), clock=FakeClock(), restore=lambda: b"{not json")
    assert c.view().level == 0 and c.config == parse_policy(POLICY)


def test_slo_policy_gets_derived_triggers_for_the_batch_and_survives_a_restart() -> None:
    """The ingress sends the engine's batch with the policy; later callers (an operator, a
    benchmark) may leave it out: the remembered batch is used, also after a restart."""
    clock, store = FakeClock(), {}
    c = core(clock, store)
    doc = {**POLICY, "slo": {"e2e_p99_ms": 2000}}
    assert c.update_config(doc, batch_slots=16)["changed"]
    # the document names queue_length itself; the rest is derived (model_queued at 4, 8, 12)
    assert c.config.level1.trigger["queue_length"] == 4 and c.config.level1.trigger["model_queued"] == 4
    assert c.config.level3.trigger["predicted_wait_ms"] == 1400
    version = c.config_version
    assert c.update_config(doc) == {"ok": True, "changed": False, "config_version": version}
    restarted = core(clock, store)
    assert restarted.batch_slots == 16 and restarted.config == c.config
    assert restarted.update_config(doc)["changed"] is False


def test_a_queue_trigger_the_engine_cannot_reach_is_rejected_naming_it() -> None:
    c = core(FakeClock())
    doc = {**POLICY, "level3": {**POLICY["level3"], "trigger": {"queue_length": 48}}}
    out = c.update_config(doc, batch_slots=16)
    assert out["ok"] is False
    assert "level3.trigger.queue_length: 48 can never fire: at most 16 requests wait in vLLM" in out["error"]
    assert c.config == parse_policy(POLICY)  # the running policy stays


def test_which_copy_wins_deploy_versus_operator_versus_restart() -> None:
    """The last change wins: an operator's update survives replica restarts re-sending the
    same deployed document, and an actor restart; a changed deployed document replaces it."""
    clock, store = FakeClock(), {}
    c = core(clock, store)
    deployed = {**POLICY, "level1": {**POLICY["level1"], "trigger": {"queue_length": 5}}}
    assert c.update_config(deployed, 16, "deploy")["changed"] is True
    assert c.config.trigger_thresholds(1) == {"queue_length": 5}
    operator = {**POLICY, "level1": {**POLICY["level1"], "trigger": {"queue_length": 6}}}
    assert c.update_config(operator)["changed"] is True  # origin "operator" by default
    # a replica restart (or Serve calling reconfigure twice) sends the deployed document again
    out = c.update_config(deployed, 16, "deploy")
    assert out["ok"] is True and out["changed"] is False and "kept" in out
    assert c.config.trigger_thresholds(1) == {"queue_length": 6}
    # the actor restarts: the operator's copy and the last deployed digest come back
    restarted = core(clock, store)
    assert restarted.config.trigger_thresholds(1) == {"queue_length": 6} and restarted.config_origin == "operator"
    assert restarted.update_config(deployed, 16, "deploy")["changed"] is False
    assert restarted.config.trigger_thresholds(1) == {"queue_length": 6}
    # a new `serve deploy` with a changed policy replaces the operator's copy
    changed = {**POLICY, "level1": {**POLICY["level1"], "trigger": {"queue_length": 7}}}
    assert restarted.update_config(changed, 16, "deploy")["changed"] is True
    assert restarted.config.trigger_thresholds(1) == {"queue_length": 7} and restarted.config_origin == "deploy"
    # the same deployed document under another batch size is a new deploy
    assert restarted.update_config(operator)["changed"] is True
    assert restarted.update_config(changed, 12, "deploy")["changed"] is True
    assert restarted.update_config(changed, 12, "nobody")["ok"] is False


def test_slo_policy_without_a_known_batch_is_kept_as_written() -> None:
    c = core(FakeClock())
    c.update_config({**POLICY, "slo": {"e2e_p99_ms": 2000}})
    assert "model_queued" not in c.config.level1.trigger


def test_a_replica_that_has_not_heard_from_the_actor_serves_at_its_start_level() -> None:
    from policies.features import REGISTRY
    from policies.service import start_view

    critical = {n for n, s in REGISTRY.items() if s.critical}
    assert start_view(None, 3).enabled == critical and int(start_view(None, 3).level) == 3
    assert start_view(None, 0).enabled == frozenset(REGISTRY)
    config = parse_policy({"degradation": {"level1": {"trigger": {"inflight": 10}, "disable": ["ab_test"]},
                                           "level3": {"trigger": {"inflight": 30},
                                                      "disable": ["audit_log", "semantic_cache_lookup"]},
                                           "features": {"audit_log": {"mode": "defer"}}}})
    v = start_view(config, 3)
    assert "ab_test" not in v.enabled and "audit_log" not in v.enabled and "semantic_cache_lookup" not in v.enabled
    assert critical <= v.enabled and v.config_version == 0 and v.mode("audit_log").value == "defer"
    assert "ab_test" in start_view(config, 0).enabled


def test_view_seq_moves_exactly_when_what_a_reader_acts_on_changes() -> None:
    """The long-poll (`PolicyActor.watch`) answers when `view_seq` moves: on a level change,
    an operator's pin or feature override, a new policy, a replica starting or ceasing to
    report; not on a tick that changed nothing."""
    clock = FakeClock()
    c = core(clock)
    c.report("model:a", {"queue_length": 0})
    c.tick()
    assert c.publish() and c.view().replicas == {"model": 1}  # a replica began reporting
    seq = c.view_seq
    c.report("model:a", {"queue_length": 0})
    c.tick()
    assert not c.publish() and c.view_seq == seq  # nothing changed
    c.report("model:a", {"queue_length": 10})
    c.tick()
    assert c.publish() and c.view_seq == seq + 1 and c.view().level == 2
    assert not c.publish()  # once per change
    c.set_override(feature="personalization", enabled=False)
    assert c.publish() and c.view_seq == seq + 2
    c.set_override(level=3, ttl_s=30)
    assert c.publish() and c.view_seq == seq + 3
    doc = {**POLICY, "stale_after_s": 3}
    assert c.update_config(doc)["changed"]
    assert c.publish() and c.view_seq == seq + 4
    c.report("model:b", {"queue_length": 10})
    c.tick()
    assert c.publish() and c.view_seq == seq + 5 and c.view().replicas == {"model": 2}
    clock.advance(4)  # past stale_after_s (3 s): neither replica counts
    c.tick()
    assert c.publish() and c.view().replicas == {}


def test_a_report_that_alone_reaches_a_higher_trigger_asks_for_an_early_tick() -> None:
    clock = FakeClock()
    c = core(clock)
    assert not c.may_escalate({"queue_length": 3})  # below level 1's 4
    assert c.may_escalate({"queue_length": 4})
    assert not c.may_escalate({"gpu_util": 0.99})  # not a trigger of this policy
    c.report("model:a", {"queue_length": 10})
    c.tick()  # level 2: only level 3's trigger (12) is above it now
    assert not c.may_escalate({"queue_length": 10}) and c.may_escalate({"queue_length": 12})


def test_a_nodes_batch_of_reports_counts_each_and_rejects_only_the_bad_one() -> None:
    clock = FakeClock()
    c = core(clock)
    kept = c.report_many([("model:a", {"queue_length": 2}, []), ("model:b", {"bogus": 1.0}, []),
                          ("ingress:c", {"inflight": 3}, ["p95_latency_ms"])])
    assert kept == 2 and c.report_errors == 1 and c.failed_reads == 1
    c.tick()
    assert c.signals.values["queue_length"] == 2 and "p95_latency_ms" in c.signals.stale
