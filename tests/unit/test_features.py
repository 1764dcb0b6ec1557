from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.features import REGISTRY, FeatureOverride, enabled, enabled_set

OPTIONAL = sorted(n for n, s in REGISTRY.items() if not s.critical)


@given(
    off=st.fixed_dictionaries({n: st.one_of(st.none(), st.integers(1, 3)) for n in OPTIONAL}),
    feature=st.sampled_from(OPTIONAL),
    level=st.integers(0, 2),
)
def test_off_at_k_stays_off_above_k(off: dict, feature: str, level: int) -> None:
    if not enabled(feature, level, off):
        assert not enabled(feature, level + 1, off)


def test_critical_features_always_on() -> None:
    off = {n: 1 for n in OPTIONAL}
    assert enabled_set(3, off) == {n for n, s in REGISTRY.items() if s.critical}


def test_override_wins_both_ways() -> None:
    off = {"ab_test": 2}
    assert not enabled("ab_test", 2, off)
    assert enabled("ab_test", 3, off, {"ab_test": FeatureOverride("ab_test", True)})
    assert not enabled("ab_test", 0, off, {"ab_test": FeatureOverride("ab_test", False)})


def test_unknown_feature_is_an_error() -> None:
    with pytest.raises(KeyError, match="unknown feature 'nope'"):
        enabled("nope", 0, {})


def test_registry_lines_state_supported_off_modes_consistently() -> None:
    from policies.features import FeatureSpec, OffMode, Stage

    with pytest.raises(ValueError, match="only side effects can be deferred"):
        FeatureSpec("x", Stage.PRE, False, "", frozenset({OffMode.SKIP, OffMode.DEFER}), impl="m:X")
    with pytest.raises(ValueError, match="must support 'skip'"):
        FeatureSpec("x", Stage.SIDE_EFFECT, False, "", frozenset({OffMode.DEFER}), impl="m:X")
    with pytest.raises(ValueError, match="needs an impl"):
        FeatureSpec("x", Stage.PRE, False, "")
    assert all(OffMode.SKIP in s.off_modes for s in REGISTRY.values())


def test_policy_view_is_typed_whatever_it_is_built_from() -> None:
    from policies.features import Level, OffMode, PolicyView

    v = PolicyView(level=2, enabled=["ab_test"], modes={"audit_log": "defer"}, config_version=3)
    assert v.level is Level.AUXILIARY and v.enabled == frozenset({"ab_test"})
    assert v.mode("audit_log") is OffMode.DEFER and v.mode("ab_test") is OffMode.SKIP
    assert v.to_dict()["modes"] == {"audit_log": "defer"} and v.to_dict()["level"] == 2
    assert PolicyView.all_on().enabled == frozenset(REGISTRY)
