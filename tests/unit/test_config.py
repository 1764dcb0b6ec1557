"""Policy config: both spellings load; every bad input fails naming key, value and choices."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

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
    assert not any(REGISTRY[n].critical for n in ALIASES["all_non_critical"])
    assert re.fullmatch(r"[a-z_]+", "all_non_critical")


def test_serve_config_policy_is_the_default_policy() -> None:
    """The policy in serve_config.yaml (hot-reloadable) and configs/degradation.yaml agree."""
    import yaml

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (ingress,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "Ingress"]
    assert ingress["user_config"]["policy"] == yaml.safe_load((ROOT / "configs" / "degradation.yaml").read_text())
    parse_policy(ingress["user_config"]["policy"])
