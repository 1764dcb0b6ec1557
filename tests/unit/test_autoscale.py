"""Autoscaling with degradation: the pure rule (policies.autoscale), the controller-side feed and
adapter (deployments.autoscaling) with fake handles, the derived policy's pending trigger, and
the args that configure it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError

from deployments.autoscaling import PolicyFeed, decide
from policies.autoscale import MAX_REFUSED, SCALE_UP_REFUSED, PolicyLoad, desired_replicas, pending_replicas
from policies.config import parse_policy
from policies.controller import ControllerState
from policies.controller import decide as decide_level
from policies.signals import Signals
from policies.slo import derive_policy

CALM = PolicyLoad(level=0, refused_ratio=0.0)


@pytest.mark.parametrize(
    ("running", "ongoing", "target", "policy", "expected", "why"),
    [
        (1, 8, 16, CALM, 0.5, "half a batch: Serve's queue rule, free to scale down"),
        (2, 48, 16, CALM, 3.0, "the queue asks for more"),
        (2, 8, 16, PolicyLoad(1, 0.0), 2.0, "degraded: never below running"),
        (2, 8, 16, PolicyLoad(0, 0.01), 2.0, "refusals in the window: never below running"),
        (1, 3, 16, PolicyLoad(2, 0.5), 2.0, "admission hides the queue; half refused: double"),
        (2, 3, 16, PolicyLoad(3, 0.75), 8.0, "three quarters refused: four times"),
        (1, 3, 16, PolicyLoad(3, 0.99), 1 / (1 - MAX_REFUSED), "at most ten times"),
        (1, 3, 16, PolicyLoad(0, SCALE_UP_REFUSED / 2), 1.0, "a few refusals in a busy window: no reason"),
        (1, 3, 16, PolicyLoad(0, 0.05), 1.0, "a lone refusal (1 of the 20-decision floor) is no reason to scale up"),
        (1, 3, 16, PolicyLoad(2, 0.1), 1 / 0.9, "two refusals in a quiet window are"),
        (1, 40, 16, PolicyLoad(1, 0.5), 2.5, "the larger of the two"),
        (1, 8, 16, None, 1.0, "policy unreadable: fail static, no scale-down"),
        (3, 80, 16, None, 5.0, "policy unreadable: the queue may still scale up"),
        (0, 4, 16, CALM, 0.25, "no replica runs: the queue alone"),
    ],
)
def test_desired_replicas(running: int, ongoing: float, target: float, policy: PolicyLoad | None,
                          expected: float, why: str) -> None:
    assert desired_replicas(running, ongoing, target, policy) == pytest.approx(expected), why


def test_desired_replicas_rejects_a_zero_target() -> None:
    with pytest.raises(ValueError, match="target_ongoing"):
        desired_replicas(1, 1, 0, CALM)


@pytest.mark.parametrize(("target", "running", "pending"), [(1, 1, 0), (3, 1, 2), (1, 2, 0), (2, 0, 2)])
def test_pending_replicas(target: int, running: int, pending: int) -> None:
    assert pending_replicas(target, running) == pending


# -- the feed: non-blocking reads, one-way reports --------------------------------------------


class Ref:
    def __init__(self, value: Any) -> None:
        self.value, self.done = value, False


class Method:
    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, []

    def remote(self, *args: Any) -> Ref:
        self.calls.append(args)
        return Ref(self.fn(*args))


class FakeActor:
    def __init__(self, load: PolicyLoad) -> None:
        self.current = load
        self.load = Method(lambda: self.current)
        self.report = Method(lambda source, signals: True)


def feed_for(actor: FakeActor | None, resolves: list[int] | None = None) -> PolicyFeed:
    def resolve() -> FakeActor:
        if resolves is not None:
            resolves.append(1)
        if actor is None:
            raise ValueError("Failed to look up actor with name 'brownout-policy'")
        return actor

    return PolicyFeed("autoscaler:app/VLLMModel", resolve, ready=lambda ref: ref.done, get=lambda ref: ref.value)


def test_feed_never_waits_for_the_actor_and_keeps_one_read_in_flight() -> None:
    actor = FakeActor(PolicyLoad(2, 0.3))
    feed = feed_for(actor)
    assert feed.load(0.0) is None  # the read was started, not awaited
    assert len(actor.load.calls) == 1
    assert feed.load(1.5) is None  # still not finished: no second call piles up
    assert len(actor.load.calls) == 1
    feed._inflight.done = True
    assert feed.load(1.6) == PolicyLoad(2, 0.3)
    assert len(actor.load.calls) == 2  # read_s had passed since the first: the next one starts
    # the answer holds for stale_s, then counts as none (fail static)
    assert feed.load(6.5) == PolicyLoad(2, 0.3)
    assert feed.load(6.7) is None


def test_feed_reads_at_most_every_read_s() -> None:
    actor = FakeActor(CALM)
    feed = feed_for(actor)
    feed.load(0.0)
    feed._inflight.done = True
    feed.load(0.1)  # the answer arrives; read_s not yet passed: no new call
    assert len(actor.load.calls) == 1
    feed.load(1.0)
    assert len(actor.load.calls) == 2


def test_feed_reports_pending_on_change_and_heartbeat_only() -> None:
    actor = FakeActor(CALM)
    feed = feed_for(actor)
    sent = [feed.report_pending(p, t) for p, t in [(0, 0.0), (0, 0.1), (1, 0.2), (1, 0.3), (1, 1.3), (0, 1.4)]]
    assert sent == [True, False, True, False, True, True]
    assert actor.report.calls[1] == ("autoscaler:app/VLLMModel", {"model_replicas_pending": 1.0})


def test_feed_backs_off_resolving_a_missing_actor() -> None:
    resolves: list[int] = []
    feed = feed_for(None, resolves)
    assert feed.load(0.0) is None and not feed.report_pending(1, 0.0)
    assert feed.load(1.0) is None and not feed.report_pending(1, 2.0)
    assert len(resolves) == 1 and feed.failures == 1  # tried again only after resolve_s
    feed.load(5.0)
    assert len(resolves) == 2


def test_feed_survives_an_actor_that_dies_under_a_read() -> None:
    actor = FakeActor(CALM)
    feed = feed_for(actor)
    feed.load(0.0)

    def boom(ref: Any) -> Any:
        raise RuntimeError("ActorDiedError")

    feed._get = boom
    feed._inflight.done = True
    assert feed.load(0.1) is None
    assert feed.failures == 1 and feed._inflight is None


# -- the adapter: what Serve's controller gets ----------------------------------------------------


@dataclass
class Config:
    target: float = 16.0

    def get_target_ongoing_requests(self) -> float:
        return self.target


@dataclass
class Ctx:
    current_num_replicas: int
    target_num_replicas: int
    total_num_requests: float
    config: Config = field(default_factory=Config)
    app_name: str = "app"
    deployment_name: str = "VLLMModel"


def ready_feed(load: PolicyLoad) -> tuple[PolicyFeed, FakeActor]:
    actor = FakeActor(load)
    feed = feed_for(actor)
    feed.load(0.0)
    feed._inflight.done = True
    feed.load(0.01)
    return feed, actor


def test_adapter_scales_on_refusals_and_reports_the_pending_replica() -> None:
    feed, actor = ready_feed(PolicyLoad(2, 0.5))
    desired, state = decide(Ctx(current_num_replicas=1, target_num_replicas=2, total_num_requests=3), feed, 0.5)
    assert desired == pytest.approx(2.0)
    assert state == {"level": 2, "refused_ratio": 0.5}
    assert actor.report.calls[-1] == ("autoscaler:app/VLLMModel", {"model_replicas_pending": 1.0})


def test_adapter_leaves_a_cold_start_to_serve() -> None:
    feed, actor = ready_feed(CALM)
    desired, _ = decide(Ctx(current_num_replicas=0, target_num_replicas=1, total_num_requests=0), feed, 0.5)
    assert desired == 1.0
    assert actor.report.calls[-1][1] == {"model_replicas_pending": 1.0}


# -- the policy hears the autoscaler --------------------------------------------------------------


def test_a_pending_replica_raises_level_1_and_its_arrival_lets_it_recover() -> None:
    cfg = derive_policy(parse_policy({"slo": {"e2e_p99_ms": 2000}, "level1": {"recover_dwell_s": 5, "cooldown_s": 0}}),
                        max_num_seqs=16)
    state, transition = decide_level(cfg, ControllerState(), Signals(0.0, {"model_replicas_pending": 1.0}), 0.0)
    assert int(state.level) == 1
    assert transition is not None and transition.reason.signal == "model_replicas_pending"
    state, _ = decide_level(cfg, state, Signals(3.0, {"model_replicas_pending": 1.0}), 3.0)
    assert int(state.level) == 1  # still pending: held
    for t in (4.0, 6.0, 8.9):
        state, _ = decide_level(cfg, state, Signals(t, {"model_replicas_pending": 0.0}), t)
        assert int(state.level) == 1  # serving, within the dwell
    state, _ = decide_level(cfg, state, Signals(9.0, {"model_replicas_pending": 0.0}), 9.0)
    assert int(state.level) == 0


def test_without_autoscaling_the_signal_is_absent_and_changes_nothing() -> None:
    cfg = derive_policy(parse_policy({"slo": {"e2e_p99_ms": 2000}}), max_num_seqs=16)
    state, transition = decide_level(cfg, ControllerState(), Signals(0.0, {"predicted_wait_ms": 0.0}), 0.0)
    assert int(state.level) == 0 and transition is None


# -- configuration --------------------------------------------------------------------------------


def test_autoscaling_args_become_serves_autoscaling_config() -> None:
    from serve_app.app import BrownoutArgs

    args = BrownoutArgs.model_validate({"model": {"max_num_seqs": 8, "autoscaling": {"max_replicas": 3}}})
    assert args.model.autoscaling is not None
    cfg = args.model.autoscaling.serve_config(args.model.max_num_seqs)
    assert cfg["target_ongoing_requests"] == 8.0  # one full batch per replica
    assert (cfg["min_replicas"], cfg["max_replicas"]) == (1, 3)
    assert cfg["policy"] == {"policy_function": "deployments.autoscaling:brownout_autoscaling_policy"}
    from ray.serve.config import AutoscalingConfig

    serve_cfg = AutoscalingConfig(**cfg)  # Serve accepts it and imports the policy function
    assert not serve_cfg.policy.is_default_policy_function()


@pytest.mark.parametrize(
    ("autoscaling", "names"),
    [
        ({"max_replicas": 0}, "model.autoscaling.max_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas=2 must be >= min_replicas=3"),
        ({"max_replicas": 2, "min_replicas": 0}, "model.autoscaling.min_replicas"),
        ({"max_replicas": 2, "look_back_period_s": 0}, "model.autoscaling.look_back_period_s"),
        # at or below the interval the replicas push their queue at (metrics_interval_s, 10 s)
        ({"max_replicas": 2, "look_back_period_s": 10}, "look_back_period_s=10 must be above metrics_interval_s=10"),
        ({"max_replicas": 2, "upscale_delay": 1}, "upscale_delay"),
        ({}, "model.autoscaling.max_replicas"),
    ],
)
def test_bad_autoscaling_args_name_the_key(autoscaling: dict[str, Any], names: str) -> None:
    from serve_app.app import BrownoutArgs

    with pytest.raises(ValidationError, match=re.escape(names)):
        BrownoutArgs.model_validate({"model": {"autoscaling": autoscaling}})


def test_the_look_back_window_is_checked_against_the_push_interval_in_force() -> None:
    """Ray 2.60's replicas and handles push their queue every ``metrics_interval_s`` (the
    environment variable Serve names as its replacement is defined but never read), so the
    window is checked against that field, and the field reaches Serve's autoscaling_config."""
    from ray.serve.config import AutoscalingConfig

    from serve_app.app import BrownoutArgs

    with pytest.raises(ValidationError, match=re.escape("model.autoscaling.look_back_period_s")):
        BrownoutArgs.model_validate({"model": {"autoscaling": {"max_replicas": 2, "look_back_period_s": 3}}})
    shipped = BrownoutArgs.model_validate({"model": {"autoscaling": {"max_replicas": 2}}}).model.autoscaling
    assert shipped is not None and shipped.serve_config(16)["metrics_interval_s"] == 10
    args = BrownoutArgs.model_validate(
        {"model": {"autoscaling": {"max_replicas": 2, "metrics_interval_s": 1, "look_back_period_s": 3}}})
    auto = args.model.autoscaling
    assert auto is not None and (auto.metrics_interval_s, auto.look_back_period_s) == (1, 3)
    serve_cfg = AutoscalingConfig(**{k: v for k, v in auto.serve_config(16).items() if k != "policy"})
    assert (serve_cfg.metrics_interval_s, serve_cfg.look_back_period_s) == (1, 3)
    with pytest.raises(ValidationError, match=re.escape("look_back_period_s=3 must be above metrics_interval_s=5")):
        BrownoutArgs.model_validate(
            {"model": {"autoscaling": {"max_replicas": 2, "metrics_interval_s": 5, "look_back_period_s": 3}}})
    with pytest.raises(ValidationError, match=re.escape("model.autoscaling.metrics_interval_s")):
        BrownoutArgs.model_validate({"model": {"autoscaling": {"max_replicas": 2, "metrics_interval_s": 0}}})


def test_policy_core_load_is_the_level_and_the_refused_share_of_the_last_tick() -> None:
    from policies.service import PolicyCore

    now = [100.0]
    core = PolicyCore(derive_policy(parse_policy({"slo": {"e2e_p99_ms": 2000}}), max_num_seqs=16),
                      clock=lambda: now[0])
    assert core.load() == PolicyLoad(0, 0.0)  # nothing reported: nothing refused
    core.report("ingress-1", {"refused_ratio": 0.2, "predicted_wait_ms": 0.0})
    assert core.load() == PolicyLoad(0, 0.0)  # read at the tick, as the level is
    core.tick()
    assert core.load() == PolicyLoad(3, 0.2)  # a fifth refused raises level 3 in one step


def test_a_lone_refusal_in_the_window_asks_for_no_replica() -> None:
    """What the door's window reads for one refusal among a few decisions, through the rule: no
    scale-up (the docstring's promise, checked on the real window, not on a chosen number)."""
    from policies.admission import RefusalWindow

    window = RefusalWindow(5.0)
    for i in range(4):
        window.add(1.0 + 0.1 * i, refused=False)
    window.add(1.5, refused=True)
    lone = window.ratio(1.6)
    assert lone == pytest.approx(1 / RefusalWindow.MIN_DECISIONS)
    assert desired_replicas(1, 3, 16, PolicyLoad(2, lone)) == 1.0
    window.add(1.7, refused=True)
    assert desired_replicas(1, 3, 16, PolicyLoad(2, window.ratio(1.8))) == pytest.approx(1 / 0.9)

