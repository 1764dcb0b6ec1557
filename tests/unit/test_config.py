"""Policy config: both spellings load; every bad input fails naming key, value and choices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from policies.config import DEFAULT_RECOVER_RATIO, PolicyError, load_policy, parse_policy
from policies.features import ALIASES, REGISTRY

ROOT = Path(__file__).resolve().parents[2]

REFERENCE = {
    "degradation": {
        "level1": {"trigger": {"gpu_util": 0.85, "queue_length": 20},
                   "disable": ["semantic_cache", "debug_log", "light_metrics"]},
        "level2": {"trigger": {"gpu_util": 0.95, "queue_length": 50},
                   "disable": ["personalization", "ab_test", "feature_stats"]},
        "level3": {"trigger": {"queue_length": 100, "avg_latency_ms": 3000},
                   "disable": ["all_non_critical"]},
    }
}


def test_reference_json_reads_unchanged() -> None:
    cfg = parse_policy(REFERENCE)
    assert cfg.trigger_thresholds(1) == {"gpu_util": 0.85, "queue_length": 20}
    off = cfg.off_levels()
    assert off["semantic_cache_lookup"] == off["semantic_cache_write"] == 1
    assert off["debug_capture"] == off["light_metrics"] == 1
    assert off["personalization"] == off["ab_test"] == off["feature_stats"] == 2
    # all_non_critical: every optional feature not already off lower down
    for name, spec in REGISTRY.items():
        assert (off[name] is None) == spec.critical
        if not spec.critical:
            assert off[name] <= 3


def test_reference_file_matches_the_reference_text() -> None:
    assert json.loads((ROOT / "configs" / "reference.json").read_text()) == REFERENCE
    assert load_policy(ROOT / "configs" / "reference.json") == parse_policy(REFERENCE)


def test_default_yaml_loads_with_defer_audit() -> None:
    cfg = load_policy(ROOT / "configs" / "degradation.yaml")
    assert cfg.off_mode("audit_log").value == "defer"
    assert cfg.off_levels()["semantic_cache_write"] == 1
    assert cfg.off_levels()["ab_test"] == 2


def test_recover_defaults_to_documented_fraction() -> None:
    cfg = parse_policy({"level1": {"trigger": {"gpu_util": 0.9}}})
    assert cfg.recover_thresholds(1)["gpu_util"] == pytest.approx(0.75)
    assert DEFAULT_RECOVER_RATIO == pytest.approx(0.75 / 0.9)


def test_bare_document_without_wrapper() -> None:
    assert parse_policy(REFERENCE["degradation"]) == parse_policy(REFERENCE)


@pytest.mark.parametrize(
    "doc, pattern",
    [
        ({"level1": {"trigger": {"gpu_utilisation": 0.9}}},
         r"unknown signal 'gpu_utilisation'.*valid signals: gpu_util, gpu_mem_ratio"),
        ({"level1": {"trigger": {"gpu_util": 0.9}, "disable": ["semantic_cash"]}},
         r"unknown feature 'semantic_cash'.*valid: .*semantic_cache"),
        ({"level1": {"trigger": {"gpu_util": 0.9}, "recover": {"gpu_util": 0.9}}},
         r"level1\.recover\.gpu_util: 0\.9 must be below level1\.trigger\.gpu_util: 0\.9"),
        ({"level1": {"trigger": {"gpu_util": 0.9}, "recover": {"queue_length": 3}}},
         r"level1\.recover\.queue_length: 3.* has no trigger"),
        ({"level1": {"trigger": {"gpu_util": 0.9}, "recover_dwell_s": -5}},
         r"level1\.recover_dwell_s.*greater than or equal to 0.*-5"),
        ({"level2": {"trigger": {"gpu_util": 0.9}, "cooldown_s": -1}},
         r"level2\.cooldown_s.*-1"),
        ({"level1": {"trigger": {"gpu_util": 0.9}, "escalate_after_s": "soon"}},
         r"level1\.escalate_after_s.*'soon'"),
        ({"level1": {"trigger": {"queue_length": 50}}, "level2": {"trigger": {"queue_length": 20}}},
         r"level2\.trigger\.queue_length: 20.* must be above level1\.trigger\.queue_length: 50"),
        ({"level1": {"trigger": {"gpu_util": 0.9}, "disable": ["auth"]}},
         r"feature 'auth' is critical and cannot be disabled"),
        ({"features": {"model": {"off_at": 3}}},
         r"feature 'model' is critical and cannot be disabled"),
        ({"features": {"audit_log": {"critical": True}}},
         r"features\.audit_log\.critical: True contradicts the registry"),
        ({"features": {"audit_logs": {"mode": "defer"}}},
         r"unknown feature 'audit_logs'.*valid: .*audit_log"),
        ({"features": {"audit_log": {"mode": "later"}}},
         r"features\.audit_log\.mode.*'skip', 'default' or 'defer'.*'later'"),
        ({"features": {"ab_test": {"mode": "defer"}}},
         r"features\.ab_test\.mode: 'defer' is only for side effects \(.*audit_log"),
        ({"features": {"ab_test": {"mode": "default"}}},
         r"mode 'default' needs a 'default' value"),
        ({"level4": {"trigger": {"gpu_util": 0.9}}}, r"unknown key 'level4'"),
        ({"level1": {"trigger": {"gpu_util": 0.9}, "triger": {}}}, r"unknown key 'triger'"),
        ({"level1": {"trigger": {"queue_length": -3}}},
         r"trigger\.queue_length: threshold must be a finite number >= 0, got -3"),
        ({"stale_after_s": 0}, r"stale_after_s.*greater than 0"),
        ({"stale_after_s": 10, "forget_after_s": 5},
         r"forget_after_s: 5 must be at least stale_after_s: 10"),
        ({"forget_after_s": 0}, r"forget_after_s.*greater than 0"),
        ({"forget_after_s": "a minute"}, r"forget_after_s.*'a minute'"),
        ({"degradation": {}, "extra": 1}, r"unknown top-level key\(s\).*'extra'"),
    ],
)
def test_bad_config_is_rejected_with_a_message_naming_it(doc: dict, pattern: str) -> None:
    with pytest.raises(PolicyError, match=pattern):
        parse_policy(doc)


def test_unreadable_yaml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("degradation: {level1: [unclosed")
    with pytest.raises(PolicyError, match=r"p\.yaml: not valid yaml"):
        load_policy(bad)


def test_aliases_name_registered_features_only() -> None:
    for alias, names in ALIASES.items():
        assert names and all(n in REGISTRY for n in names), alias
    # all_non_critical is every optional feature, and nothing else
    assert set(ALIASES["all_non_critical"]) == {n for n, spec in REGISTRY.items() if not spec.critical}


def test_serve_config_policy_is_the_default_policy() -> None:
    """The policy in serve_config.yaml (hot-reloadable) and configs/degradation.yaml agree."""
    import yaml

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (ingress,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "Ingress"]
    assert ingress["user_config"]["policy"] == yaml.safe_load((ROOT / "configs" / "degradation.yaml").read_text())
    parse_policy(ingress["user_config"]["policy"])


# -- slo, admission and flap damping sections ----------------------------------------------------

SLO_DOC = {"slo": {"e2e_p99_ms": 2000, "ttft_p99_ms": 800, "default_class": "standard",
                   "class_share": {"critical": 1.0, "standard": 0.8, "sheddable": 0.6}},
           "admission": {"overhead_ms": 100, "prior_rate_per_s": 10, "max_retry_after_s": 20},
           "flap_damping": {"window_s": 90, "dwell_factor": 3, "max_dwell_factor": 9, "reset_after_s": 300}}


def test_slo_admission_and_flap_damping_sections_load() -> None:
    cfg = parse_policy({"degradation": SLO_DOC})
    assert cfg.slo is not None and cfg.slo.e2e_p99_ms == 2000 and cfg.slo.class_share.sheddable == 0.6
    assert cfg.admission is not None and cfg.admission.max_retry_after_s == 20
    assert cfg.flap_damping.factor(0) == 1 and cfg.flap_damping.factor(1) == 3
    assert cfg.flap_damping.factor(2) == 9 and cfg.flap_damping.factor(50) == 9


def test_sections_are_optional_with_documented_defaults() -> None:
    cfg = parse_policy(REFERENCE)
    assert cfg.slo is None and cfg.admission is None
    fd = cfg.flap_damping
    assert (fd.window_s, fd.dwell_factor, fd.max_dwell_factor, fd.reset_after_s) == (120, 2, 8, 600)
    slo = parse_policy({"slo": {"e2e_p99_ms": 1500}}).slo
    assert slo is not None and slo.default_class == "standard" and slo.ttft_p99_ms is None
    assert (slo.class_share.critical, slo.class_share.standard, slo.class_share.sheddable) == (1.0, 0.9, 0.9)


@pytest.mark.parametrize(
    "doc, pattern",
    [
        ({"slo": {}}, r"slo\.e2e_p99_ms: Field required"),
        ({"slo": {"e2e_p99_ms": -5}}, r"slo\.e2e_p99_ms: .*greater than 0.*-5"),
        ({"slo": {"e2e_p99_ms": 2000, "e2e_p95_ms": 1000}}, r"unknown key 'e2e_p95_ms'"),
        ({"slo": {"e2e_p99_ms": 2000, "ttft_p99_ms": 2500}},
         r"ttft_p99_ms: 2500 must not exceed e2e_p99_ms: 2000"),
        ({"slo": {"e2e_p99_ms": 2000, "default_class": "gold"}},
         r"slo\.default_class: .*'critical', 'standard' or 'sheddable'.*'gold'"),
        ({"slo": {"e2e_p99_ms": 2000, "class_share": {"standard": 0.5, "sheddable": 0.7}}},
         r"class_share\.sheddable: 0\.7 must not exceed class_share\.standard: 0\.5"),
        ({"slo": {"e2e_p99_ms": 2000, "class_share": {"critical": 1.5}}},
         r"slo\.class_share\.critical: .*less than or equal to 1.*1\.5"),
        ({"slo": {"e2e_p99_ms": 2000, "class_share": {"bronze": 0.1}}}, r"unknown key 'bronze'"),
        ({"admission": {"overhead_ms": 50}}, r"admission: needs an 'slo' section"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"overhead_ms": 2000}},
         r"admission\.overhead_ms: 2000 must be below slo\.e2e_p99_ms: 2000"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"min_retry_after_s": 10, "max_retry_after_s": 5}},
         r"min_retry_after_s: 10 must not exceed max_retry_after_s: 5"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"min_retry_after_s": 0}},
         r"admission\.min_retry_after_s: .*greater than or equal to 1.*0"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"rate_alpha": 0}},
         r"admission\.rate_alpha: .*greater than 0"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"retry_after_s": 1}}, r"unknown key 'retry_after_s'"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"ramp_growth": 2}},
         r"admission: ramp_growth: 2: .*replaced by ramp_step"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"ramp_step": -1}},
         r"admission\.ramp_step: .*greater than or equal to 0.*-1"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"ramp_step": 1.5}}, r"admission\.ramp_step: .*1\.5"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"overtake_sigmas": -0.5}},
         r"admission\.overtake_sigmas: .*greater than or equal to 0.*-0\.5"),
        ({"slo": {"e2e_p99_ms": 2000}, "admission": {"overtake_sigmas": "lots"}},
         r"admission\.overtake_sigmas: .*lots"),
        ({"flap_damping": {"dwell_factor": 0.5}}, r"flap_damping\.dwell_factor: .*greater than or equal to 1.*0\.5"),
        ({"flap_damping": {"window_s": 300, "reset_after_s": 100}},
         r"flap_damping\.reset_after_s: 100 must be >= flap_damping\.window_s: 300"),
        ({"flap_damping": {"window": 30}}, r"unknown key 'window'"),
    ],
)
def test_bad_slo_admission_or_damping_is_rejected_naming_it(doc: dict, pattern: str) -> None:
    with pytest.raises(PolicyError, match=pattern):
        parse_policy(doc)


# -- the SLO-derived policy ----------------------------------------------------------------------


def test_derived_policy_from_the_slo_alone() -> None:
    from policies.slo import derive_policy

    cfg = derive_policy(parse_policy({"slo": {"e2e_p99_ms": 2000, "ttft_p99_ms": 800}}), max_num_seqs=16)
    assert cfg.trigger_thresholds(1) == {"model_queued": 4, "queue_length": 4, "predicted_wait_ms": 700,
                                         "refused_ratio": 0.02, "kv_cache_usage": 0.8,
                                         "model_replicas_pending": 1}
    assert cfg.trigger_thresholds(2) == {"model_queued": 8, "queue_length": 8, "predicted_wait_ms": 1000,
                                         "refused_ratio": 0.05, "kv_cache_usage": 0.9, "p95_latency_ms": 1800}
    assert cfg.trigger_thresholds(3) == {"model_queued": 12, "queue_length": 12, "predicted_wait_ms": 1400,
                                         "refused_ratio": 0.10, "p95_latency_ms": 2000, "ttft_p95_ms": 800}
    assert cfg.recover_thresholds(1)["queue_length"] == 1  # the queue must essentially empty
    # refusals at the door: any level recovers only once the window has (almost) none
    assert all(cfg.recover_thresholds(lv)["refused_ratio"] == 0.005 for lv in (1, 2, 3))
    assert cfg.recover_thresholds(3)["predicted_wait_ms"] == pytest.approx(840)
    # a pending model replica raises level 1 only, which recovers once none is pending
    assert cfg.recover_thresholds(1)["model_replicas_pending"] == 0.5
    assert "model_replicas_pending" not in cfg.trigger_thresholds(2)
    # levels it had to add carry the default plan and the shipped dwell and cooldown
    assert cfg.off_levels() == default_policy_off_levels()
    assert (cfg.dwell_s(2), cfg.cooldown_s(2)) == (30, 15)


@pytest.mark.parametrize(
    "refused, level",
    [(0.0, 0), (0.01, 0), (0.02, 1), (0.05, 2), (0.3, 3)],
)
def test_refusals_at_the_door_raise_the_derived_level_while_the_queue_looks_calm(refused: float, level: int) -> None:
    """Admission keeps the queue and the predicted wait under their triggers by refusing; the
    refused share alone raises the level, the highest it reaches in one tick."""
    from policies.controller import ControllerState, decide
    from policies.signals import Signals
    from policies.slo import derive_policy

    cfg = derive_policy(parse_policy({"slo": {"e2e_p99_ms": 2000}}), max_num_seqs=16)
    calm = {"model_queued": 0.0, "predicted_wait_ms": 300.0}
    state, transition = decide(cfg, ControllerState(), Signals(0.0, {**calm, "refused_ratio": refused}), 0.0)
    assert state.level == level
    if level:
        assert transition is not None and transition.reason.signal == "refused_ratio"


def test_a_level_raised_on_refusals_recovers_only_after_a_dwell_without_any() -> None:
    from policies.controller import ControllerState, decide
    from policies.signals import Signals
    from policies.slo import derive_policy

    cfg = derive_policy(parse_policy({"slo": {"e2e_p99_ms": 2000}}), max_num_seqs=16)
    calm = {"model_queued": 0.0, "predicted_wait_ms": 0.0}
    state, _ = decide(cfg, ControllerState(), Signals(0.0, {**calm, "refused_ratio": 0.5}), 0.0)
    assert state.level == 3
    dwell = cfg.dwell_s(3)
    for t in range(1, int(dwell) + 5):  # a trickle of refusals (1%) holds level 3 past its dwell
        state, _ = decide(cfg, state, Signals(float(t), {**calm, "refused_ratio": 0.01}), float(t))
    assert state.level == 3
    t0 = float(int(dwell) + 5)
    for t in range(int(dwell) + 1):  # none at all: one step down after the dwell
        state, _ = decide(cfg, state, Signals(t0 + t, {**calm, "refused_ratio": 0.0}), t0 + t)
    assert state.level == 2


def default_policy_off_levels():  # type: ignore[no-untyped-def]
    return load_policy(ROOT / "configs" / "degradation.yaml").off_levels()


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 4, 8, 16, 64, 256])
@pytest.mark.parametrize("max_waiting", [None, 0, 1, 5, 32])
def test_derived_queue_triggers_are_reachable_and_ascend(max_num_seqs: int, max_waiting: int | None) -> None:
    from policies.slo import derive_policy

    cfg = derive_policy(parse_policy({"slo": {"e2e_p99_ms": 2000}}), max_num_seqs, max_waiting)
    room = max_num_seqs if max_waiting is None else max_waiting
    seen = []
    for lv in (1, 2, 3):
        trig = cfg.trigger_thresholds(lv)
        for name in ("model_queued", "queue_length"):
            if name in trig:
                assert trig[name] <= room, (lv, name, trig[name], room)  # reachable
        seen.append(trig.get("queue_length"))
        # reached before standard work is refused (0.8 of the budget: 1520 ms of waiting)
        assert trig["predicted_wait_ms"] < 0.8 * 1900
        assert cfg.level(lv) is not None
    present = [q for q in seen if q is not None]
    assert present == sorted(set(present))


# The default policy before it was derived from an SLO: hand-written thresholds, which still work.
HAND_WRITTEN = yaml.safe_load((ROOT / "configs" / "hand_written.yaml").read_text())


def test_explicit_thresholds_win_and_the_reference_json_is_untouched() -> None:
    from policies.slo import derive_policy

    doc = parse_policy(HAND_WRITTEN).model_dump(mode="json", exclude_none=True)
    doc["slo"] = {"e2e_p99_ms": 2000}
    cfg = derive_policy(parse_policy(doc), max_num_seqs=16)
    # queue_length is named by the document: its values stand at every level
    assert [cfg.trigger_thresholds(lv)["queue_length"] for lv in (1, 2, 3)] == [4, 8, 12]
    assert cfg.trigger_thresholds(1)["gpu_util"] == 0.85
    # signals it does not name are derived, and reachable
    assert cfg.trigger_thresholds(3)["model_queued"] == 12
    assert cfg.dwell_s(1) == 30 and cfg.off_mode("audit_log").value == "defer"
    # no slo: nothing derived (the reference JSON reads exactly as before)
    ref = load_policy(ROOT / "configs" / "reference.json")
    assert derive_policy(ref, 16) == ref == parse_policy(REFERENCE)


def test_the_reference_json_is_refused_for_the_shipped_engine_naming_its_unreachable_trigger() -> None:
    """README: read unchanged, but not deployable on a batch of 16 (what `serve_app.app` and a
    `serve deploy` check with `fit_policy`)."""
    from policies.slo import fit_policy

    ref = load_policy(ROOT / "configs" / "reference.json")
    with pytest.raises(PolicyError, match=r"level1\.trigger\.queue_length: 20 can never fire: at most 16"):
        fit_policy(ref, 16)
    assert fit_policy(ref, 128) == ref  # a larger batch fits it


def test_deriving_twice_changes_nothing() -> None:
    from policies.slo import derive_policy

    once = derive_policy(parse_policy({"slo": {"e2e_p99_ms": 3000, "ttft_p99_ms": 900}}), 32, 20)
    assert derive_policy(once, 32, 20) == once
    parse_policy(once.model_dump(mode="json"))  # and it round-trips through the actor's store


def test_derived_policy_reaches_level_3_on_the_queue_the_caps_allow() -> None:
    """The old level 3 (queue_length 48) could never fire with 16 waiting; the derived one does."""
    from policies.controller import ControllerState, decide
    from policies.signals import Signals
    from policies.slo import derive_policy

    cfg = derive_policy(parse_policy({"slo": {"e2e_p99_ms": 2000}}), max_num_seqs=16)
    state = ControllerState()
    levels = []
    for t, waiting in enumerate([0, 2, 4, 8, 12, 16, 16]):  # vLLM's waiting queue: at most 16
        state, _ = decide(cfg, state, Signals(at=t, values={"queue_length": waiting}), float(t))
        levels.append(int(state.level))
    assert levels == [0, 0, 1, 2, 3, 3, 3]
    # why this was needed: the previous default's level 3 waited for 48 of at most 16
    from policies.config import PolicyError
    from policies.slo import check_reachable, fit_policy

    old = {**HAND_WRITTEN["degradation"], "level3": {**HAND_WRITTEN["degradation"]["level3"],
                                                      "trigger": {"queue_length": 48}}}
    with pytest.raises(PolicyError, match=r"level3\.trigger\.queue_length: 48 can never fire: at most 16"):
        fit_policy(parse_policy(old), 16)
    check_reachable(parse_policy(HAND_WRITTEN), 16)  # the shipped hand-written policy fits
    with pytest.raises(PolicyError, match=r"level3\.trigger\.queue_length: 12 can never fire: at most 8"):
        check_reachable(parse_policy(HAND_WRITTEN), 8)


def test_derive_rejects_a_bad_batch_size() -> None:
    from policies.slo import derive_policy

    with pytest.raises(ValueError, match=r"max_num_seqs must be >= 1, got 0"):
        derive_policy(parse_policy({"slo": {"e2e_p99_ms": 2000}}), 0)


# -- request shaping per level -------------------------------------------------------------------


def test_shape_section_loads_and_is_inherited_upward() -> None:
    cfg = parse_policy({"level1": {"trigger": {"gpu_util": 0.9}},
                        "level2": {"trigger": {"gpu_util": 0.95}, "shape": {"max_tokens": 128}},
                        "level3": {"shape": {"max_tokens": 64, "refuse": ["logprobs", "n"]}}})
    assert [(cfg.shape_at(lv).max_tokens, cfg.shape_at(lv).refuse) for lv in range(4)] == [
        (None, []), (None, []), (128, []), (64, ["n", "logprobs"]),
    ]
    assert cfg.level(1) is not None and cfg.level(1).shape.max_tokens is None  # optional


def test_default_yaml_shapes_levels_2_and_3() -> None:
    cfg = load_policy(ROOT / "configs" / "degradation.yaml")
    assert cfg.shape_at(0).max_tokens is None and cfg.shape_at(1).max_tokens is None
    assert cfg.shape_at(2).max_tokens == 128 and cfg.shape_at(2).refuse == []
    assert cfg.shape_at(3).max_tokens == 64 and cfg.shape_at(3).refuse == ["n", "logprobs"]
    assert [cfg.shape_at(lv).stream_interval for lv in range(4)] == [None, None, 4, 8]


@pytest.mark.parametrize(
    "doc, pattern",
    [
        ({"level2": {"shape": {"max_tokens": 0}}},
         r"level2\.shape\.max_tokens: .*greater than or equal to 1.*\(got 0\)"),
        ({"level2": {"shape": {"max_tokens": -64}}}, r"level2\.shape\.max_tokens: .*\(got -64\)"),
        ({"level2": {"shape": {"max_tokens": 64.5}}},
         r"level2\.shape\.max_tokens: .*valid integer.*\(got 64\.5\)"),
        ({"level2": {"shape": {"max_tokens": "64"}}}, r"level2\.shape\.max_tokens: .*\(got '64'\)"),
        ({"level2": {"shape": {"max_tokens": True}}}, r"level2\.shape\.max_tokens: .*\(got True\)"),
        ({"level3": {"shape": {"refuse": ["logprob"]}}},
         r"level3\.shape\.refuse: unknown field 'logprob'; valid: n, best_of, logprobs, prompt_logprobs"),
        ({"level3": {"shape": {"refuse": ["max_tokens"]}}}, r"unknown field 'max_tokens'; valid: n, "),
        ({"level3": {"shape": {"refuse": "n"}}}, r"level3\.shape\.refuse: .*valid list.*\(got 'n'\)"),
        ({"level3": {"shape": {"max_token": 64}}},
         r"level3\.shape\.max_token: unknown key 'max_token' \(value 64\)"),
        ({"level3": {"shape": {"cap_tokens": 64}}}, r"unknown key 'cap_tokens'"),
        ({"level3": {"shape": [64]}}, r"level3\.shape: .*\(got \[64\]\)"),
        ({"level2": {"shape": {"max_tokens": 64}}, "level3": {"shape": {"max_tokens": 128}}},
         r"level3\.shape\.max_tokens: 128 must not exceed level2\.shape\.max_tokens: 64 "
         r"\(a higher level never shapes less\)"),
        ({"level1": {"shape": {"max_tokens": 32}}, "level3": {"shape": {"max_tokens": 33}}},
         r"level3\.shape\.max_tokens: 33 must not exceed level1\.shape\.max_tokens: 32"),
        ({"level2": {"shape": {"stream_interval": 0}}},
         r"level2\.shape\.stream_interval: .*greater than or equal to 1.*\(got 0\)"),
        ({"level2": {"shape": {"stream_interval": "8"}}}, r"level2\.shape\.stream_interval: .*\(got '8'\)"),
        ({"level2": {"shape": {"stream_interval": 5000}}},
         r"level2\.shape\.stream_interval: .*less than or equal to 4096.*\(got 5000\)"),
        ({"level2": {"shape": {"stream_interval": 8}}, "level3": {"shape": {"stream_interval": 4}}},
         r"level3\.shape\.stream_interval: 4 must not be below level2\.shape\.stream_interval: 8 "
         r"\(a higher level never shapes less\)"),
    ],
)
def test_bad_shape_is_rejected_naming_key_value_and_choices(doc: dict, pattern: str) -> None:
    with pytest.raises(PolicyError, match=pattern):
        parse_policy(doc)


def test_equal_caps_at_consecutive_levels_are_allowed() -> None:
    cfg = parse_policy({"level2": {"shape": {"max_tokens": 64}}, "level3": {"shape": {"max_tokens": 64}}})
    assert cfg.shape_at(3).max_tokens == 64
    cfg = parse_policy({"level2": {"shape": {"stream_interval": 4}}, "level3": {"shape": {"stream_interval": 4}}})
    assert cfg.shape_at(3).stream_interval == 4
