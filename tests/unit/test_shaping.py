"""Level-driven request shaping: table tests per level, and hypothesis invariants."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.config import REFUSABLE, load_policy, parse_policy
from policies.shaping import (
    NO_SHAPING,
    REFUSED_FIELDS,
    REQUEST_FIELDS,
    SHAPED_HEADER,
    STREAM_FIELD,
    UNSHAPED,
    Change,
    ShapingPlan,
    shape,
)
from policies.slo import derive_policy

ROOT = Path(__file__).resolve().parents[2]

# level 1 sheds features only; level 2 caps at 128; level 3 caps at 64 and refuses logprobs, n
POLICY = parse_policy({
    "level1": {"trigger": {"queue_length": 4}, "disable": ["debug_capture"]},
    "level2": {"trigger": {"queue_length": 8}, "shape": {"max_tokens": 128}},
    "level3": {"trigger": {"queue_length": 12},
               "shape": {"max_tokens": 64, "refuse": ["logprobs", "n"]}},
})
PLAN = ShapingPlan.from_config(POLICY)


@pytest.mark.parametrize(
    "name, level, fields, header, updates",
    [
        ("level 0 never shapes", 0, {"max_tokens": 512, "logprobs": True, "n": 4}, None, {}),
        ("a level without shape leaves the request alone", 1, {"max_tokens": 512}, None, {}),
        ("cap applied when the request asks for more", 2, {"max_tokens": 512},
         "max_tokens=512->128", {"max_tokens": 128}),
        ("a request under the cap is unchanged", 2, {"max_tokens": 100}, None, {}),
        ("a request exactly at the cap is unchanged", 2, {"max_tokens": 128}, None, {}),
        ("the default (64) is under both caps", 3, {"max_tokens": 64}, None, {}),
        ("the tighter cap of the higher level", 3, {"max_tokens": 512},
         "max_tokens=512->64", {"max_tokens": 64}),
        ("max_completion_tokens is capped under its own name", 3, {"max_completion_tokens": 200},
         "max_completion_tokens=200->64", {"max_completion_tokens": 64}),
        ("min_tokens above the cap is lowered with it", 3, {"max_tokens": 300, "min_tokens": 100},
         "max_tokens=300->64, min_tokens=100->64", {"max_tokens": 64, "min_tokens": 64}),
        ("min_tokens under the cap stays", 3, {"max_tokens": 300, "min_tokens": 10},
         "max_tokens=300->64", {"max_tokens": 64}),
        ("a level-2 field refused only at 3 is served at 2", 2, {"max_tokens": 50, "logprobs": True},
         None, {}),
        ("values that ask for nothing are not refused", 3,
         {"max_tokens": 32, "n": 1, "logprobs": False, "top_logprobs": 0, "best_of": None}, None, {}),
        ("completions' logprobs 0 asks for nothing", 3, {"logprobs": 0}, None, {}),
        ("a field not on the refuse list is served", 3, {"best_of": 3, "prompt_logprobs": 2}, None, {}),
        ("missing and None fields are not asked for", 3, {}, None, {}),
        ("above the top level reads as the top level", 7, {"max_tokens": 512},
         "max_tokens=512->64", {"max_tokens": 64}),
        ("below 0 reads as 0", -1, {"max_tokens": 512}, None, {}),
    ],
)
def test_shape_table(name: str, level: int, fields: dict[str, Any], header: str | None,
                     updates: dict[str, int]) -> None:
    shaped = shape(PLAN, level, fields)
    assert shaped.refusal is None, name
    assert shaped.header == header, name
    assert shaped.updates == updates, name
    if header is None:
        assert shaped is UNSHAPED  # the common case allocates nothing


@pytest.mark.parametrize(
    "name, level, fields, field, text",
    [
        ("logprobs at level 3", 3, {"max_tokens": 16, "logprobs": True}, "logprobs",
         r"^logprobs=true is not served at brownout level 3 .*with no logprobs"),
        ("top_logprobs asks for logprobs", 3, {"top_logprobs": 5}, "top_logprobs",
         r"^top_logprobs=5 is not served at brownout level 3"),
        ("completions' logprobs k > 0", 3, {"logprobs": 2}, "logprobs", r"^logprobs=2 is not served"),
        ("n > 1", 3, {"n": 4, "max_tokens": 512}, "n", r"^n=4 is not served at brownout level 3.* n=1"),
        ("refused above the level that lists it", 9, {"n": 2}, "n", r"level 9"),
        ("refusal wins over a cap (nothing is served)", 3, {"max_tokens": 512, "logprobs": True},
         "logprobs", r"logprobs"),
    ],
)
def test_refuse_table(name: str, level: int, fields: dict[str, Any], field: str, text: str) -> None:
    shaped = shape(PLAN, level, fields)
    r = shaped.refusal
    assert r is not None, name
    assert (r.status, r.field, r.code) == (400, field, "not_served_at_level"), name
    assert r.level == level and r.value == fields[field]
    assert shaped.changes == () and shaped.updates == {}
    assert shaped.header == f"{field}=refused"
    assert re.search(text, r.message), (name, r.message)


# level 2 streams in fours, level 3 in eights and caps at 64
STREAMED = ShapingPlan.from_config(parse_policy({
    "level1": {"trigger": {"queue_length": 4}},
    "level2": {"trigger": {"queue_length": 8}, "shape": {"stream_interval": 4}},
    "level3": {"trigger": {"queue_length": 12},
               "shape": {"max_tokens": 64, "refuse": ["logprobs"], "stream_interval": 8}},
}))


@pytest.mark.parametrize(
    "name, level, fields, header, interval",
    [
        ("level 0 never shapes a stream", 0, {STREAM_FIELD: 1}, None, None),
        ("a level without it leaves a stream alone", 1, {STREAM_FIELD: 1}, None, None),
        ("a stream at level 2 goes in fours", 2, {"max_tokens": 16, STREAM_FIELD: 1}, "stream_interval=1->4", 4),
        ("at level 3 in eights, beside the cap", 3, {"max_tokens": 300, STREAM_FIELD: 1},
         "max_tokens=300->64, stream_interval=1->8", 8),
        ("a request that does not stream is untouched", 3, {"max_tokens": 16, STREAM_FIELD: None}, None, None),
        ("... nor one that says nothing of streaming", 2, {"max_tokens": 16}, None, None),
        ("an engine already at the level's interval", 2, {STREAM_FIELD: 4}, None, None),
        ("an engine above it is never lowered", 2, {STREAM_FIELD: 16}, None, None),
        ("an engine below it is raised", 3, {STREAM_FIELD: 4}, "stream_interval=4->8", 8),
    ],
)
def test_stream_interval_table(name: str, level: int, fields: dict[str, Any], header: str | None,
                               interval: int | None) -> None:
    shaped = shape(STREAMED, level, fields)
    assert shaped.refusal is None, name
    assert shaped.header == header, name
    assert shaped.stream_interval == interval, name
    if header is None:
        assert shaped is UNSHAPED


def test_the_stream_interval_is_not_a_sampling_setting_and_a_refusal_wins() -> None:
    shaped = shape(STREAMED, 3, {"max_tokens": 300, STREAM_FIELD: 1})
    # the semantic cache scopes by the sampling settings: the increments do not change the answer
    assert shaped.apply_to({"max_tokens": 300, "temperature": 0.0}) == {"max_tokens": 64, "temperature": 0.0}
    assert shaped.updates == {"max_tokens": 64, STREAM_FIELD: 8}
    refused = shape(STREAMED, 3, {"logprobs": True, STREAM_FIELD: 1})
    assert refused.refusal is not None and refused.changes == () and refused.stream_interval is None


def test_inheritance_across_levels() -> None:
    """A cap or a refusal set at level k holds at every level above k, unless tightened."""
    plan = ShapingPlan.from_config(parse_policy({
        "level1": {"trigger": {"queue_length": 4}, "shape": {"max_tokens": 256, "refuse": ["best_of"]}},
        "level2": {"trigger": {"queue_length": 8}},  # says nothing: inherits level 1
        "level3": {"trigger": {"queue_length": 12}, "shape": {"refuse": ["n"]}},  # adds n, keeps 256
    }))
    assert [(plan.at(lv).max_tokens, plan.at(lv).refuse) for lv in range(4)] == [
        (None, ()), (256, ("best_of",)), (256, ("best_of",)), (256, ("n", "best_of")),
    ]
    assert shape(plan, 2, {"best_of": 2}).refusal is not None
    assert shape(plan, 3, {"max_tokens": 300}).header == "max_tokens=300->256"


def test_inheritance_across_a_missing_level() -> None:
    plan = ShapingPlan.from_config(parse_policy({
        "level1": {"trigger": {"queue_length": 4}, "shape": {"max_tokens": 100}},
        "level3": {"trigger": {"queue_length": 12}},
    }))
    assert [plan.at(lv).max_tokens for lv in range(4)] == [None, 100, 100, 100]
    plan = ShapingPlan.from_config(parse_policy({
        "level1": {"trigger": {"queue_length": 4}, "shape": {"stream_interval": 2}},
        "level2": {"trigger": {"queue_length": 8}, "shape": {"max_tokens": 50}},
        "level3": {"trigger": {"queue_length": 12}},
    }))
    assert [plan.at(lv).stream_interval for lv in range(4)] == [None, 2, 2, 2]


def test_no_policy_shaping_and_no_plan_shape_nothing() -> None:
    unshaped_policy = parse_policy({"level3": {"trigger": {"gpu_util": 0.9}}})
    for plan in (NO_SHAPING, ShapingPlan.from_config(unshaped_policy)):
        for level in range(4):
            assert shape(plan, level, {"max_tokens": 10**6, "n": 9, "logprobs": True}) is UNSHAPED


def test_apply_to_sets_the_engine_keys() -> None:
    sampling = {"max_tokens": 400, "min_tokens": 90, "temperature": 0.5}
    shaped = shape(PLAN, 3, {"max_completion_tokens": 400, "min_tokens": 90})
    assert shaped.apply_to(sampling) == {"max_tokens": 64, "min_tokens": 64, "temperature": 0.5}
    assert sampling["max_tokens"] == 400  # the input is not mutated
    assert UNSHAPED.apply_to(sampling) == sampling


def test_header_name_and_change_text() -> None:
    assert SHAPED_HEADER == "X-Brownout-Shaped"
    assert str(Change("max_tokens", 512, 64)) == "max_tokens=512->64"


def test_refused_fields_cover_the_config_choices_and_are_read() -> None:
    assert tuple(REFUSED_FIELDS) == REFUSABLE
    for checks in REFUSED_FIELDS.values():
        for field, _, _ in checks:
            assert field in REQUEST_FIELDS


def test_default_policy_shapes_as_documented() -> None:
    """Level 2 caps at 128 and streams in fours, level 3 caps at 64 (= limits.default_max_tokens),
    refuses n, logprobs and streams in eights."""
    plan = ShapingPlan.from_config(load_policy(ROOT / "configs" / "degradation.yaml"))
    assert [(plan.at(lv).max_tokens, plan.at(lv).refuse, plan.at(lv).stream_interval) for lv in range(4)] == [
        (None, (), None), (None, (), None), (128, (), 4), (64, ("n", "logprobs"), 8),
    ]
    default_max_tokens, max_tokens_limit = 64, 512  # serve_config.yaml limits
    for level in range(4):  # a request that asks for nothing is never shortened
        assert shape(plan, level, {"max_tokens": default_max_tokens}) is UNSHAPED
    assert shape(plan, 3, {"max_tokens": max_tokens_limit}).header == "max_tokens=512->64"


def test_derived_policy_keeps_the_shaping_and_round_trips() -> None:
    doc = load_policy(ROOT / "configs" / "degradation.yaml").model_dump(mode="json", exclude_none=True)
    doc["slo"] = {"e2e_p99_ms": 2000}
    cfg = derive_policy(parse_policy(doc), max_num_seqs=16)
    assert cfg.shape_at(3).max_tokens == 64 and cfg.shape_at(2).max_tokens == 128
    assert (cfg.shape_at(2).stream_interval, cfg.shape_at(3).stream_interval) == (4, 8)
    assert parse_policy(cfg.model_dump(mode="json")) == cfg  # through the actor's store


# -- invariants ----------------------------------------------------------------------------------

caps = st.one_of(st.none(), st.integers(1, 1000))
refusals = st.lists(st.sampled_from(REFUSABLE), unique=True, max_size=len(REFUSABLE))


@st.composite
def policies(draw: st.DrawFn) -> Any:
    doc: dict[str, Any] = {}
    ceiling, floor = 10**6, 1
    for lv in (1, 2, 3):
        if draw(st.booleans()):
            cap = draw(caps)
            if cap is not None:
                cap = min(cap, ceiling)  # valid configs only: caps never grow with the level
                ceiling = cap
            interval = draw(st.one_of(st.none(), st.integers(1, 32)))
            if interval is not None:
                interval = max(interval, floor)  # ... nor increments shrink
                floor = interval
            doc[f"level{lv}"] = {"trigger": {"queue_length": 4 * lv},
                                 "shape": {"max_tokens": cap, "refuse": draw(refusals),
                                           "stream_interval": interval}}
    return parse_policy(doc)


requests = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 2000),
    "max_completion_tokens": st.integers(1, 2000),
    "min_tokens": st.integers(0, 2000),
    "n": st.integers(1, 5),
    "best_of": st.one_of(st.none(), st.integers(1, 5)),
    "logprobs": st.one_of(st.none(), st.booleans(), st.integers(0, 5)),
    "top_logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 5)),
    STREAM_FIELD: st.one_of(st.none(), st.integers(1, 16)),
})


@given(policies(), requests)
def test_a_higher_level_never_shapes_less(policy: Any, fields: dict[str, Any]) -> None:
    plan = ShapingPlan.from_config(policy)
    results = [shape(plan, lv, fields) for lv in range(4)]
    assert results[0] is UNSHAPED
    for lo, hi in zip(results, results[1:]):
        if lo.refusal is not None:
            assert hi.refusal is not None  # refused at k: refused above k
        elif hi.refusal is None:
            for field, value in lo.updates.items():
                if field == STREAM_FIELD:  # larger increments are more shaping
                    assert hi.updates.get(field, fields[field]) >= value
                else:
                    assert hi.updates.get(field, fields[field]) <= value
            assert set(lo.updates) <= set(hi.updates)


@given(policies(), requests, st.integers(0, 3))
def test_shaping_only_lowers_and_reports_every_change(
    policy: Any, fields: dict[str, Any], level: int
) -> None:
    shaped = shape(ShapingPlan.from_config(policy), level, fields)
    cap, interval = policy.shape_at(level).max_tokens, policy.shape_at(level).stream_interval
    for change in shaped.changes:
        if change.field == STREAM_FIELD:  # a stream's increments only grow, to the level's
            assert change.after == interval > change.before == fields[STREAM_FIELD]
        else:
            assert change.after == cap < change.before == fields[change.field]
        assert str(change) in (shaped.header or "")
    if shaped.refusal is None and fields.get(STREAM_FIELD) is not None and interval is not None:
        assert (shaped.stream_interval or fields[STREAM_FIELD]) == max(interval, fields[STREAM_FIELD])
    if shaped.refusal is None and cap is not None:
        after = {**fields, **shaped.updates}
        capped = ("max_tokens", "max_completion_tokens", "min_tokens")
        assert all(after[f] <= cap for f in capped if f in after)
    assert (shaped.header is None) == (shaped.refusal is None and not shaped.changes)
