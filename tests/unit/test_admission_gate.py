"""The ingress's admission gate: classes, refusals in OpenAI's shape, tickets released once."""

from __future__ import annotations

import asyncio
import math

import pytest

from policies.admission import Criticality
from policies.config import parse_policy
from serve_app.admission import AdmissionGate
from serve_app.openai_api import RequestError
from tests.fakes.clock import FakeClock

LEVEL = {"trigger": {"queue_length": 4}}
# Three distinct shares, so that each class's cap shows (the default is 1.0 / 0.9 / 0.9).
SPREAD = {"critical": 1.0, "standard": 0.8, "sheddable": 0.6}
SLO_POLICY = {"level1": LEVEL, "slo": {"e2e_p99_ms": 2000, "class_share": SPREAD},
              # 10 requests/s, 1.9 s budget: critical cap 19, standard 15, sheddable 11; without the
              # ramp, which with nothing served yet holds the classes below critical to 4 while
              # critical work arrives (its own tests below)
              "admission": {"prior_rate_per_s": 10, "overhead_ms": 100, "ramp_step": 0}}


def gate(policy: dict = SLO_POLICY, refusals: list | None = None) -> AdmissionGate:
    g = AdmissionGate(max_num_seqs=16, clock=FakeClock(),
                      on_refusal=(lambda c, r: refusals.append((c, r))) if refusals is not None else None)
    g.configure(parse_policy(policy))
    return g


def fill(g: AdmissionGate, n: int) -> list:
    return [g.admit(None, base=Criticality.CRITICAL) for _ in range(n)]


def serve_pairs(g: AdmissionGate, clock: FakeClock, latency_s: float, pairs: int = 5) -> None:
    """``pairs`` pairs of standard requests, each pair in flight together for ``latency_s``."""
    for _ in range(pairs):
        pair = [g.admit(None), g.admit(None)]
        clock.advance(latency_s)
        for ticket in pair:
            g.release(ticket, served=True)


def test_without_slo_everything_is_admitted_and_classified() -> None:
    g = gate({"level1": LEVEL})
    tickets = [g.admit(None) for _ in range(500)]
    assert g.in_flight == 500 and tickets[0].deadline_at is None
    assert tickets[0].criticality is Criticality.STANDARD and g.signals() == {}


def test_admitted_ticket_carries_deadline_and_priority() -> None:
    g = gate()
    t = g.admit(None)
    assert t.criticality is Criticality.STANDARD and t.priority == 1
    assert t.deadline_at == pytest.approx(1000.0 + 2.0)
    assert g.in_flight == 1 and g.admitted == {"standard": 1}


def test_sheddable_is_refused_first_with_429_and_a_computed_retry_after() -> None:
    refusals: list = []
    g = gate(refusals=refusals)
    fill(g, 11)
    with pytest.raises(RequestError) as err:
        g.admit("sheddable")
    e = err.value
    assert e.status == 429 and e.kind == "rate_limit_error"
    assert e.headers == {"Retry-After": "1", "X-Brownout-Criticality": "sheddable"}
    assert "11 requests ahead, sheddable admitted below 11" in e.message
    # refused by its own share of the budget, with no critical demand measured: the message says so
    assert e.message.startswith("sheddable requests are admitted only while predicted to finish within "
                                "1.2 s, class_share.sheddable (0.6) of the 2 s objective's budget (11 requests ahead")
    assert g.admit("standard").criticality is Criticality.STANDARD  # standard still fits
    assert refusals == [(Criticality.SHEDDABLE, "class_share_exhausted")]
    assert g.refused == {("sheddable", "class_share_exhausted"): 1} and g.in_flight == 12


def test_saturated_is_503_and_retry_after_grows_with_the_backlog() -> None:
    g = gate()
    fill(g, 19)
    with pytest.raises(RequestError) as first:
        g.admit(None, base=Criticality.CRITICAL)
    assert first.value.status == 503 and first.value.kind == "service_unavailable"
    g.in_flight = 60  # a deeper backlog (admitted before the measured rate fell): later retry
    with pytest.raises(RequestError) as deeper:
        g.admit(None, base=Criticality.CRITICAL)
    assert int(deeper.value.headers["Retry-After"]) > int(first.value.headers["Retry-After"])


def test_header_lowers_never_raises_and_a_bad_value_is_a_400_naming_it() -> None:
    g = gate({**SLO_POLICY, "slo": {"e2e_p99_ms": 2000, "default_class": "sheddable", "class_share": SPREAD}})
    assert g.admit("critical").criticality is Criticality.SHEDDABLE
    with pytest.raises(RequestError) as err:
        g.admit("urgent")
    assert err.value.status == 400 and err.value.param == "X-Brownout-Criticality"
    assert "unknown class 'urgent'" in err.value.message


def test_a_refusal_because_the_model_is_down_is_a_503_counted_by_class_as_model_down() -> None:
    refusals: list = []
    g = gate(refusals=refusals)
    err = g.refuse_unavailable("sheddable", Criticality.CRITICAL, "the model is unavailable (gone)", 42)
    assert err.status == 503 and err.kind == "service_unavailable" and err.message == "the model is unavailable (gone)"
    assert err.headers == {"Retry-After": "42", "X-Brownout-Criticality": "sheddable"}  # the header lowered it
    assert g.refuse_unavailable(None, None, "down", 1).headers["X-Brownout-Criticality"] == "standard"
    assert refusals == [(Criticality.SHEDDABLE, "model_down"), (Criticality.STANDARD, "model_down")]
    assert g.state()["refused"] == {"sheddable:model_down": 1, "standard:model_down": 1}
    assert g.in_flight == 0 and g.state()["admitted"] == {}  # nothing admitted, nothing measured
    with pytest.raises(RequestError) as bad:  # a bad header is still its own 400
        g.refuse_unavailable("urgent", None, "down", 1)
    assert bad.value.status == 400 and bad.value.param == "X-Brownout-Criticality" and len(refusals) == 2


def test_release_is_idempotent_and_only_served_requests_measure_the_model() -> None:
    clock = FakeClock()
    g = AdmissionGate(max_num_seqs=16, clock=clock)
    # the built-in prior (a guess: 1 s alone, a full batch of 16 in 2 s) gives way to
    # measurements; switched off, admission admits everything and goes on measuring
    g.configure(parse_policy({**SLO_POLICY, "admission": {"overhead_ms": 100, "enabled": False}}))
    t = g.admit(None)
    g.release(t, served=False)
    g.release(t, served=True)
    assert g.in_flight == 0

    def at_a_time(k: int, served: bool) -> None:
        for _ in range(10):  # k admitted together; the engine's line: 1 s alone, 2 s per extra request
            group = [g.admit(None) for _ in range(k)]
            clock.advance(1.0 + 2.0 * (k - 1))
            for ticket in group:
                g.release(ticket, served=served)

    at_a_time(2, served=False)  # aborts and errors say nothing about capacity
    assert g.controller.rate_per_s == pytest.approx(8.0)
    at_a_time(1, served=True)
    at_a_time(2, served=True)
    model = g.controller.model
    assert model.per_request_s == pytest.approx(2.0, rel=0.1) and model.base_s == pytest.approx(1.0, abs=0.15)
    assert g.state()["per_request_s"] == round(model.per_request_s, 3) and g.drain_s() == 1
    # the predicted wait's time constant: twice the measured latency alone
    assert g.state()["wait_smoothing_s"] == round(2 * model.latency_s(1), 3)
    fill(g, 2)  # 2 in flight drain at a full batch's rate, 16 / (1 + 2 * 15) per second
    assert g.drain_s() == math.ceil(2 / g.controller.rate_per_s) == 4


def test_the_level_in_force_selects_its_own_model() -> None:
    clock = FakeClock()
    g = AdmissionGate(max_num_seqs=16, clock=clock)
    g.set_level(2)  # before any policy: remembered
    g.configure(parse_policy(SLO_POLICY))
    assert g.controller.level == 2 and g.state()["level"] == 2
    for _ in range(5):
        pair = [g.admit(None), g.admit(None)]
        clock.advance(1.0)
        for ticket in pair:
            g.release(ticket, served=True)
    slow = g.controller.max_admitted(Criticality.CRITICAL)
    g.set_level(0)  # level 0 never measured here: its prior (10/s) applies
    assert g.controller.max_admitted(Criticality.CRITICAL) == 19 > slow
    g.set_level(2)
    assert g.controller.max_admitted(Criticality.CRITICAL) == slow


def test_the_requests_ahead_measure_only_a_queue_the_door_did_not_bound() -> None:
    g = gate()
    seen: list[int] = []
    g.controller.observe_completion = lambda now, latency_s, service_s, ahead=0: seen.append(ahead)
    door_on = fill(g, 18)  # behind the door: admitted when n < cap, ahead + 1 is at most the cap
    for ticket in door_on:
        g.release(ticket, served=True)
    g.configure(parse_policy({**SLO_POLICY, "admission": {**SLO_POLICY["admission"], "enabled": False}}))
    door_off = [g.admit(None) for _ in range(40)]  # nothing bounds the queue: the ahead count
    for ticket in door_off:
        g.release(ticket, served=True)
    assert seen == [0] * 18 + list(range(40))


def test_reload_keeps_the_gate_and_can_turn_admission_off() -> None:
    g = gate()
    ctl = g.controller
    g.configure(parse_policy({**SLO_POLICY, "slo": {"e2e_p99_ms": 4000, "class_share": SPREAD}}))
    assert g.controller is ctl and ctl.max_admitted(Criticality.CRITICAL) == 39
    g.configure(parse_policy({**SLO_POLICY, "admission": {"enabled": False}}))
    # switched off: everything is admitted, but the controller stays warm (same rate, signals)
    assert g.controller is ctl and g.state()["enabled"] is False
    tickets = [g.admit(None) for _ in range(100)]
    assert all(t.deadline_at is None for t in tickets) and g.signals()["predicted_wait_ms"] > 0
    g.configure(parse_policy({"level1": LEVEL}))  # no slo at all: no controller
    assert g.controller is None and g.signals() == {}


# -- preemption: a more important request takes the place of waiting work below it ----------

def test_a_critical_request_at_the_full_door_takes_the_place_of_the_least_important_waiting_one() -> None:
    refusals: list = []
    clock = FakeClock()
    g = AdmissionGate(max_num_seqs=16, clock=clock, on_refusal=lambda c, r: refusals.append((c, r)))
    g.configure(parse_policy(SLO_POLICY))  # critical cap 19
    stopped: list[str] = []
    lower = {}
    for name, klass in [("old sheddable", "sheddable"), ("young sheddable", "sheddable"), ("standard", "standard")]:
        clock.advance(0.1)
        lower[name] = g.admit(klass)
        g.waiting(lower[name], lambda name=name: stopped.append(name))
    running = g.admit("sheddable")  # admitted, but the model has started it: it keeps its place
    fill(g, 15)
    assert g.in_flight == 19 and g.state()["waiting"] == 3
    critical = g.admit(None, base=Criticality.CRITICAL)
    victim = lower["young sheddable"]  # the least important class, and the one that waited least
    assert stopped == ["young sheddable"] and victim.preempted and victim.released
    assert not running.preempted and critical.ahead == 18 and g.in_flight == 19
    assert g.refused == {("sheddable", "preempted"): 1} and refusals == [(Criticality.SHEDDABLE, "preempted")]
    err = g.preempted_error(victim)
    assert err.status == 429 and err.kind == "rate_limit_error" and err.param is None
    assert err.headers["X-Brownout-Criticality"] == "sheddable" and int(err.headers["Retry-After"]) >= 1
    # the Retry-After of a sheddable request refused at the door now: its backlog over its cap
    ctl, now = g.controller, clock()
    assert int(err.headers["Retry-After"]) == ctl.retry_after_s(
        19, ctl.class_cap(Criticality.SHEDDABLE, now), Criticality.SHEDDABLE, now)
    assert "preempted before the model started it" in err.message
    g.release(victim, served=False)  # the victim's own handler releases it again: a no-op
    assert g.in_flight == 19
    # next: the old sheddable one, then standard; a started request is never a victim
    g.admit(None, base=Criticality.CRITICAL)
    g.started(lower["standard"])
    with pytest.raises(RequestError) as full:
        g.admit(None, base=Criticality.CRITICAL)
    assert full.value.status == 503 and stopped == ["young sheddable", "old sheddable"]
    assert not lower["standard"].preempted and g.in_flight == 19


def test_a_class_displaces_only_classes_below_it_and_critical_waits_for_nobody() -> None:
    g = gate()  # caps: critical 19, standard 15, sheddable 11
    stopped: list[str] = []
    tickets = fill(g, 14)
    for t in tickets:
        g.waiting(t, lambda: stopped.append("critical"))  # critical never gives way
    standard = g.admit("standard")
    g.waiting(standard, lambda: stopped.append("standard"))
    assert g.state()["waiting"] == 1 and g.in_flight == 15
    with pytest.raises(RequestError) as own:  # standard at its cap: no class below it waits
        g.admit("standard")
    assert own.value.status == 429 and stopped == []
    with pytest.raises(RequestError):  # sheddable below its own: nothing below it at all
        g.admit("sheddable")
    assert stopped == [] and not standard.preempted


def test_preemption_switched_off_refuses_as_before() -> None:
    g = gate({**SLO_POLICY, "admission": {**SLO_POLICY["admission"], "preempt_waiting": False}})
    waiting = g.admit("sheddable")
    g.waiting(waiting, lambda: pytest.fail("preempted with preempt_waiting: false"))
    fill(g, 18)
    with pytest.raises(RequestError) as err:
        g.admit(None, base=Criticality.CRITICAL)
    assert err.value.status == 503 and not waiting.preempted


def test_until_started_refuses_the_preempted_request_and_cancels_its_model_call() -> None:
    async def scenario() -> None:
        g = gate()
        victim = g.admit("sheddable")
        fill(g, 18)
        calls: list[str] = []

        class Call:  # the model call's handle (a DeploymentResponseGenerator's cancel)
            def cancel(self) -> None:
                calls.append("cancelled")

        waits = asyncio.ensure_future(g.until_started(victim, asyncio.sleep(30), Call()))
        await asyncio.sleep(0)  # it waits for the model now
        assert g.state()["waiting"] == 1
        g.admit(None, base=Criticality.CRITICAL)  # the door is full: it takes the victim's place
        with pytest.raises(RequestError) as err:
            await asyncio.wait_for(waits, 5)
        assert err.value.status == 429 and "preempted" in err.value.message
        assert calls == ["cancelled"] and g.state()["waiting"] == 0 and g.in_flight == 19

    asyncio.run(scenario())


def test_until_started_passes_results_and_client_cancels_through() -> None:
    async def scenario() -> None:
        g = gate()
        t = g.admit("standard")
        assert await g.until_started(t, asyncio.sleep(0, result="first event")) == "first event"
        assert g.state()["waiting"] == 0  # started: it keeps its place from now on
        with pytest.raises(ValueError):  # the step's own failure is the caller's to map
            await g.until_started(t, _raise(ValueError("model said no")))
        # the client goes away while it waits: a cancellation, not a preemption
        waits = asyncio.ensure_future(g.until_started(t, asyncio.sleep(30)))
        await asyncio.sleep(0)
        waits.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waits
        assert not t.preempted and g.state()["waiting"] == 0 and g.in_flight == 1
        # critical requests and a gate with admission off never register a wait
        c = g.admit(None, base=Criticality.CRITICAL)
        assert await g.until_started(c, asyncio.sleep(0, result=1)) == 1
        g.configure(parse_policy({**SLO_POLICY, "admission": {"enabled": False}}))
        assert await g.until_started(g.admit("sheddable"), asyncio.sleep(0, result=2)) == 2

    asyncio.run(scenario())


async def _raise(err: Exception) -> None:
    raise err


# -- the wait for a model replica is bounded by the deadline ----------------------------------


def test_until_reached_passes_the_first_event_through_within_the_deadline() -> None:
    async def scenario() -> None:
        refusals: list = []
        g = gate(refusals=refusals)
        t = g.admit("standard")
        g._clock.advance(1.9)  # 0.1 s of its 2 s left
        assert await g.until_reached(t, asyncio.sleep(0.01, result="reached")) == "reached"
        assert refusals == [] and not t.expired and g.in_flight == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("left_s", [0.05, 0.0, -1.0])
def test_until_reached_refuses_with_503_at_the_deadline_and_cancels_the_wait(left_s: float) -> None:
    async def scenario() -> None:
        refusals: list = []
        g = gate(refusals=refusals)
        t = g.admit("sheddable")
        g._clock.advance(2.0 - left_s)  # the deadline is 2 s after admission
        never = asyncio.get_running_loop().create_future()  # no replica takes it
        with pytest.raises(RequestError) as err:
            await asyncio.wait_for(g.until_reached(t, never), 5)
        assert err.value.status == 503 and "deadline" in err.value.message
        assert err.value.headers["Retry-After"].isdigit() and int(err.value.headers["Retry-After"]) >= 1
        assert err.value.headers["X-Brownout-Criticality"] == "sheddable"
        assert never.cancelled() and t.expired and not t.preempted
        assert refusals == [(Criticality.SHEDDABLE, "expired")] and g.refused == {("sheddable", "expired"): 1}
        assert g.in_flight == 1  # the caller releases the ticket, as for any failure after admission

    asyncio.run(scenario())


def test_until_reached_does_not_bound_a_request_without_a_deadline() -> None:
    async def scenario() -> None:
        g = gate({**SLO_POLICY, "admission": {"enabled": False}})
        t = g.admit("standard")
        assert t.deadline_at is None
        g._clock.advance(100.0)
        assert await g.until_reached(t, asyncio.sleep(0.05, result="reached")) == "reached"
        assert g.refused == {}

    asyncio.run(scenario())


def test_a_request_waiting_for_a_replica_can_be_preempted_and_is_not_counted_expired() -> None:
    async def scenario() -> None:
        g = gate()
        victim = g.admit("sheddable")
        fill(g, 18)

        class Call:
            cancelled = 0

            def cancel(self) -> None:
                Call.cancelled += 1

        never = asyncio.get_running_loop().create_future()
        waits = asyncio.ensure_future(g.until_started(victim, g.until_reached(victim, never), Call()))
        for _ in range(3):  # until it waits for a replica
            await asyncio.sleep(0)
        g.admit(None, base=Criticality.CRITICAL)  # the door is full: it takes the victim's place
        with pytest.raises(RequestError) as err:
            await asyncio.wait_for(waits, 5)
        assert err.value.status == 429 and "preempted" in err.value.message
        assert never.cancelled() and Call.cancelled == 1 and not victim.expired
        assert g.refused == {("sheddable", "preempted"): 1}

    asyncio.run(scenario())


# -- a critical request at the full door waits for the next freed slot ------------------------


def test_a_critical_request_at_the_full_door_waits_for_a_freed_slot_it_can_finish_in_time_with() -> None:
    async def scenario() -> None:
        refusals: list = []
        g = gate(refusals=refusals)
        first = fill(g, 19)  # critical's cap
        g._clock.advance(0.5)
        arrived = g._clock()
        waits = asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL))
        await asyncio.sleep(0)
        assert g.state()["queued"] == 1 and not waits.done() and g.in_flight == 19
        assert g.state()["critical_wait_s"] == 1.0  # half the 2 s objective
        with pytest.raises(RequestError) as lower:  # the line is ahead of every lower class
            g.admit("standard")
        assert lower.value.status == 503
        g._clock.advance(0.05)
        # 18 left: joining them it is predicted to finish 0.05 + 2.0 s after its arrival, past the
        # 2 s objective: it waits on, and the freed slot stays free (the line is still ahead)
        g.release(first[0], served=False)
        await asyncio.sleep(0)
        assert not waits.done() and g.state()["queued"] == 1 and g.in_flight == 18
        with pytest.raises(RequestError):
            g.admit("standard")
        g.release(first[1], served=False)  # 17 left: 0.05 + 1.9 s, in time
        ticket = await asyncio.wait_for(waits, 5)
        assert ticket.criticality is Criticality.CRITICAL and g.in_flight == 18
        assert ticket.deadline_at == pytest.approx(arrived + 2.0)  # the SLO runs from its arrival
        assert ticket.admitted_at == pytest.approx(arrived + 0.05)
        assert g.state()["queued"] == 0
        assert refusals == [(Criticality.STANDARD, "saturated")] * 2

    asyncio.run(scenario())


def test_a_freed_slot_goes_to_a_later_arrival_still_in_time_before_one_that_no_longer_is() -> None:
    async def scenario() -> None:
        g = gate()
        tickets = fill(g, 19)
        early = asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL))
        await asyncio.sleep(0)
        g._clock.advance(0.5)
        late = asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL))
        await asyncio.sleep(0)
        assert g.state()["queued"] == 2
        g.release(tickets[0], served=False)  # 18 left: 2.0 s predicted; only the one that just came is in time
        ticket = await asyncio.wait_for(late, 5)
        assert ticket.admitted_at == pytest.approx(g._clock()) and not early.done()
        assert g.state()["queued"] == 1 and g.in_flight == 19
        # the first waits on, until its wait ends: no slot it could finish in time with freed
        with pytest.raises(RequestError) as err:
            await asyncio.wait_for(early, 5)
        assert err.value.status == 503 and g.state()["queued"] == 0

    asyncio.run(scenario())


def test_a_critical_request_waits_out_a_moment_of_a_slow_engine_reading() -> None:
    async def scenario() -> None:
        g = gate()
        fill(g, 5)
        g.observe_speed(101, 10.0)  # 8 applied: critical's cap falls below the 5 in flight
        assert g.state()["class_cap"]["critical"] < 5 and g.state()["critical_wait_s"] == 1.0
        waits = asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL))
        await asyncio.sleep(0)
        assert not waits.done() and g.state()["queued"] == 1
        g._clock.advance(0.3)
        g.observe_speed(101, 1.0)  # the reading ends: 0.3 + 0.7 s predicted, in time
        ticket = await asyncio.wait_for(waits, 5)
        assert ticket.criticality is Criticality.CRITICAL and g.in_flight == 6 and g.state()["queued"] == 0

    asyncio.run(scenario())


def test_a_critical_request_is_refused_past_its_wait_and_counted_once() -> None:
    async def scenario() -> None:
        refusals: list = []
        g = gate(refusals=refusals)
        tickets = fill(g, 19)
        # half the 2 s SLO (within the 1.8 s an idle server leaves): refused after 1 s with nothing freed
        with pytest.raises(RequestError) as err:
            await asyncio.wait_for(g.admit_waiting(None, base=Criticality.CRITICAL), 5)
        assert err.value.status == 503 and int(err.value.headers["Retry-After"]) >= 1
        assert err.value.headers["X-Brownout-Criticality"] == "critical"
        assert refusals == [(Criticality.CRITICAL, "saturated")] and g.state()["queued"] == 0
        g.release(tickets[0], served=False)  # nobody in line: the slot stays free
        assert g.in_flight == 18

    asyncio.run(scenario())


@pytest.mark.parametrize("klass, policy", [
    ("standard", SLO_POLICY),  # lower classes never wait
    ("sheddable", SLO_POLICY),
    ("critical", {**SLO_POLICY, "admission": {**SLO_POLICY["admission"], "critical_wait_share": 0}}),
])
def test_who_does_not_wait_is_refused_at_once(klass: str, policy: dict) -> None:
    async def scenario() -> None:
        g = gate(policy)
        fill(g, 19)
        waits = asyncio.ensure_future(g.admit_waiting(None, base=Criticality(klass)))
        await asyncio.sleep(0)
        assert waits.done() and g.state()["queued"] == 0
        assert isinstance(waits.exception(), RequestError)

    asyncio.run(scenario())


@pytest.mark.parametrize("critical_rate, waits", [(3.0, True), (30.0, False)])
def test_critical_work_waits_only_while_it_alone_does_not_saturate_the_server(critical_rate: float,
                                                                              waits: bool) -> None:
    async def scenario() -> None:
        g = gate()  # the server completes 10 requests/s
        for _ in range(int(critical_rate * 20)):  # 20 s of critical demand; the door fills to its cap
            g._clock.advance(1.0 / critical_rate)
            if g.in_flight < 19:
                g.admit(None, base=Criticality.CRITICAL)
            else:  # the door is full: a refused arrival, measured all the same
                assert not g.controller.decide(Criticality.CRITICAL, g.in_flight, g._clock()).admitted
        assert g.in_flight == 19
        assert g.controller.saturated_by(Criticality.CRITICAL, g._clock()) is not waits
        pending = asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL))
        await asyncio.sleep(0)
        # at 30/s every slot a release frees goes to the next critical arrival: refused at once
        assert pending.done() is not waits and g.state()["queued"] == int(waits)
        if waits:
            pending.cancel()
        else:
            assert pending.exception().status == 503

    asyncio.run(scenario())


def test_a_client_that_goes_away_while_waiting_takes_no_slot() -> None:
    async def scenario() -> None:
        g = gate()
        tickets = fill(g, 19)
        waits = asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL))
        await asyncio.sleep(0)
        waits.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waits
        assert g.state()["queued"] == 0
        g.release(tickets[0], served=False)
        assert g.in_flight == 18 and g.refused == {}

    asyncio.run(scenario())


def test_a_level_change_keeps_the_caps_it_left_until_the_requests_admitted_before_it_leave() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        g = AdmissionGate(max_num_seqs=16, clock=clock)
        g.set_level(2)
        g.configure(parse_policy(SLO_POLICY))
        for _ in range(5):  # level 2 measured slow: pairs take 1.5 s
            pair = [g.admit(None), g.admit(None)]
            clock.advance(1.5)
            for ticket in pair:
                g.release(ticket, served=True)
        clock.advance(60.0)  # the standard work no longer arrives: critical alone is held too
        slow = g.controller.max_admitted(Criticality.CRITICAL)
        assert slow < 19
        old = fill(g, slow)  # admitted at level 2: they carry its work
        waits = asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL))
        await asyncio.sleep(0)
        assert g.state()["queued"] == 1 and not waits.done()
        g.set_level(0)  # level 0's model (its prior, 10/s) would admit up to 19, but not yet
        await asyncio.sleep(0)
        assert not waits.done() and g.controller.max_admitted(Criticality.CRITICAL) == slow
        assert g.state()["caps_held_s"] == 2.0  # at most one SLO
        g.release(old[0], served=False)  # a freed slot: the line goes in, within the held caps
        ticket = await asyncio.wait_for(waits, 5)
        assert ticket.criticality is Criticality.CRITICAL and g.in_flight == slow
        with pytest.raises(RequestError):  # still held: full at level 2's cap
            g.admit(None, base=Criticality.CRITICAL)
        for t in old[1:]:
            g.release(t, served=False)
        # the last request admitted before the change has left: level 0's caps apply
        assert g.controller.max_admitted(Criticality.CRITICAL) == 19 and g.state()["caps_held_s"] is None
        fill(g, 19 - g.in_flight)
        assert g.in_flight == 19

    asyncio.run(scenario())


def test_a_level_that_admitted_nothing_is_not_held_at_the_next_change() -> None:
    """The hold bounds the caps by the levels the requests in flight were admitted at. A level
    in force only while the door was full for it admitted none of them, so its caps bound
    nothing at the next change (measured 12-07: level 2's caps, at 1, held every class for 2.2 s
    after level 3 came, and critical requests were refused)."""
    clock = FakeClock()
    g = AdmissionGate(max_num_seqs=16, clock=clock)
    g.configure(parse_policy(SLO_POLICY))

    caps = {}
    for level, latency_s in [(1, 1.5), (2, 0.3), (3, 0.3)]:  # level 1 measured slow, 2 and 3 fast
        g.set_level(level)
        serve_pairs(g, clock, latency_s)
        caps[level] = g.controller.max_admitted(Criticality.CRITICAL)
    assert caps[1] < caps[2] == caps[3]
    clock.advance(10.0)
    admitted = fill(g, caps[1] + 1)  # admitted at level 3
    g.set_level(1)  # down: level 1's own caps at once; the door is full for every class
    assert g.controller.max_admitted(Criticality.CRITICAL) == caps[1] and g.state()["caps_held_s"] is not None
    with pytest.raises(RequestError):
        g.admit(None, base=Criticality.CRITICAL)
    clock.advance(0.5)
    g.set_level(2)  # level 1 admitted nothing: only level 3's caps still bound the door
    assert g.controller.max_admitted(Criticality.CRITICAL) == caps[2] and g.state()["caps_held_s"] is not None
    assert g.state()["level_models_replaced"] == 0
    g.admit(None, base=Criticality.CRITICAL)
    for t in admitted:
        g.release(t, served=False)
    assert g.state()["caps_held_s"] is None


def test_a_level_change_with_nothing_in_flight_applies_the_new_caps_at_once() -> None:
    clock = FakeClock()
    g = AdmissionGate(max_num_seqs=16, clock=clock)
    g.set_level(2)
    g.configure(parse_policy(SLO_POLICY))
    for _ in range(5):
        pair = [g.admit(None), g.admit(None)]
        clock.advance(1.5)
        for ticket in pair:
            g.release(ticket, served=True)
    assert g.controller.max_admitted(Criticality.CRITICAL) < 19
    g.set_level(0)
    assert g.controller.max_admitted(Criticality.CRITICAL) == 19 and g.state()["caps_held_s"] is None


def test_a_higher_level_measured_in_a_slower_phase_starts_from_the_level_in_force() -> None:
    """Levels are ordered by cost: at a change up, a model of the new level slower than what the
    level in force just measured is replaced by the model in force, and counted in the state."""
    clock = FakeClock()
    g = AdmissionGate(max_num_seqs=16, clock=clock)
    g.configure(parse_policy(SLO_POLICY))

    g.set_level(3)
    serve_pairs(g, clock, 1.5)  # level 3, in a slow phase of the machine
    slow = g.controller.max_admitted(Criticality.CRITICAL)
    g.set_level(2)
    serve_pairs(g, clock, 0.3)  # level 2, now, five times as fast
    fast = g.controller.max_admitted(Criticality.CRITICAL)
    assert slow < fast and g.state()["level_models_replaced"] == 0
    g.set_level(3)
    assert g.controller.max_admitted(Criticality.CRITICAL) == fast
    assert g.state()["level_models_replaced"] == 1


def test_a_machine_changing_speed_is_counted_in_the_state() -> None:
    """Pairs served at 0.3 s, then at 1.5 s at the same concurrency (a noisy neighbour): the
    model reads a machine five times slower (`ServiceModel.shift`), rescales its line, the caps
    fall at once, and the state counts it."""
    clock = FakeClock()
    g = AdmissionGate(max_num_seqs=16, clock=clock)
    g.configure(parse_policy(SLO_POLICY))

    serve_pairs(g, clock, 0.3, 10)
    fast = g.controller.max_admitted(Criticality.CRITICAL)
    assert g.state()["speed_shifts"] == 0 and g.state()["latency_alone_s"] is None  # none alone
    alone = g.admit(None)
    clock.advance(0.25)
    g.release(alone, served=True)
    assert g.state()["latency_alone_s"] == pytest.approx(0.25)
    serve_pairs(g, clock, 1.5, 2)  # the first window also holds fast pairs: two steps
    assert g.state()["speed_shifts"] == 2
    serve_pairs(g, clock, 1.5, 5)
    assert g.state()["speed_shifts"] == 2  # the machine stays slow: read once
    assert g.controller.model.latency_s(2) == pytest.approx(1.5, rel=0.05)
    assert g.controller.max_admitted(Criticality.CRITICAL) < fast / 3


def test_a_reloaded_policy_whose_caps_have_room_lets_the_line_in_without_waiting_for_a_release() -> None:
    async def scenario() -> None:
        g = gate()
        fill(g, 19)  # critical's cap at a 2 s SLO
        waits = [asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL)) for _ in range(2)]
        await asyncio.sleep(0)
        assert g.state()["queued"] == 2
        g.configure(parse_policy({**SLO_POLICY, "slo": {"e2e_p99_ms": 2100, "class_share": SPREAD}}))  # 2.0 s budget: cap 20
        first = await asyncio.wait_for(waits[0], 5)
        assert first.criticality is Criticality.CRITICAL and first.deadline_at == pytest.approx(1000.0 + 2.1)
        await asyncio.sleep(0)
        assert g.in_flight == 20 and g.state()["queued"] == 1 and not waits[1].done()  # the cap holds
        waits[1].cancel()

    asyncio.run(scenario())


def test_waiting_requests_are_let_in_when_admission_is_switched_off() -> None:
    async def scenario() -> None:
        g = gate()
        fill(g, 19)
        waits = asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL))
        await asyncio.sleep(0)
        g.configure(parse_policy({**SLO_POLICY, "admission": {"enabled": False}}))
        ticket = await asyncio.wait_for(waits, 5)
        assert ticket.deadline_at is None and g.in_flight == 20

    asyncio.run(scenario())


@pytest.mark.parametrize("critical_rate, limit, why", [
    # critical demand near the server's rate: standard is refused below its share's cap (15), to
    # keep room for critical work
    (8.0, "reserve", "standard requests are being shed to keep room for more important work"),
    # critical demand over the server's rate: standard is shut out, even from an idle server
    (30.0, "shut_out", "standard requests are shed while more important work alone arrives as fast"),
])
def test_a_refusal_names_the_limit_that_refused_it(critical_rate: float, limit: str, why: str) -> None:
    g = gate()  # the server completes 10 requests/s
    ctl = g.controller
    arrivals = sorted([(i / critical_rate, Criticality.CRITICAL) for i in range(int(critical_rate * 60))]
                      + [(i / 3.0, Criticality.STANDARD) for i in range(180)])  # 60 s; standard at 3/s
    start = g._clock()
    for t, klass in arrivals:  # each to an idle server: only the arrival counts
        g._clock.now = start + t
        ctl.decide(klass, 0, g._clock())
    g._clock.advance(0.5)
    cap = ctl.class_cap(Criticality.STANDARD, g._clock())
    assert cap < ctl.max_admitted(Criticality.STANDARD) == 15
    g.in_flight = cap
    with pytest.raises(RequestError) as err:
        g.admit("standard")
    assert err.value.status == 429 and err.value.message.startswith(why), err.value.message
    assert "class_share" not in err.value.message
    assert ctl.decide(Criticality.STANDARD, cap, g._clock()).limited_by == limit


def test_a_refusal_for_the_work_that_would_overtake_it_says_so() -> None:
    """With a batch of 8 (the server still completes 10 requests/s), standard work waits for a
    slot past 8 in flight, and critical work arriving at 5/s meanwhile starts before it: its cap
    counts that, and the refusal says why, naming the class's share."""
    g = AdmissionGate(max_num_seqs=8, clock=FakeClock())
    g.configure(parse_policy(SLO_POLICY))
    ctl = g.controller
    start = g._clock()
    for i in range(300):  # 60 s of critical work at 5/s, each to an idle server
        g._clock.now = start + i / 5.0
        ctl.decide(Criticality.CRITICAL, 0, g._clock())
    g._clock.advance(0.1)
    cap = ctl.overtaken_cap(Criticality.STANDARD, g._clock())
    assert 8 <= cap < ctl.max_admitted(Criticality.STANDARD) == 15
    g.in_flight = cap
    with pytest.raises(RequestError) as err:
        g.admit("standard")
    assert err.value.status == 429 and err.value.message.startswith(
        "standard requests are admitted only while predicted to finish within 1.6 s, class_share.standard (0.8)"
    ), err.value.message
    assert "counting the more important requests that arrive while one waits" in err.value.message
    assert g.state()["overtaken_cap"] == {"critical": 19, "standard": cap, "sheddable": ctl.overtaken_cap(
        Criticality.SHEDDABLE, g._clock())}


def test_the_state_shows_the_latency_tail_and_the_limit_it_sets() -> None:
    clock = FakeClock()
    g = AdmissionGate(max_num_seqs=16, clock=clock)
    g.configure(parse_policy(SLO_POLICY))
    assert g.state()["latency_tail"] == 1.0 and g.state()["tail_limit"] is None  # nothing measured
    for k in range(60):  # served one at a time, every other one 1.5 x slower: a spread
        t = g.admit(None)
        clock.advance(0.5 if k % 2 else 0.75)
        g.release(t, served=True)
    ctl = g.controller
    assert ctl.tail_factor > 1.0 and ctl.tail_limit is not None
    assert g.state()["latency_tail"] == round(ctl.tail_factor, 3) and g.state()["tail_limit"] == ctl.tail_limit
    assert g.state()["tail_holds"] is False  # no critical work arrives


def test_the_ramp_refusal_names_itself_and_the_state_shows_it() -> None:
    clock = FakeClock()
    g = AdmissionGate(max_num_seqs=16, clock=clock)
    g.configure(parse_policy({**SLO_POLICY, "admission": {**SLO_POLICY["admission"], "ramp_step": 3}}))
    assert g.state()["ramp_limit"] is None and g.state()["ramp_step"] == 3  # no critical work has arrived
    tickets = fill(g, 4)  # critical work arrives; nothing served yet
    assert g.state()["measured_reach"] == 0 and g.state()["ramp_limit"] == 4
    # four critical arrivals at one moment: 4 / tau on the long estimate, 4 / (tau / 5) on the fast one
    tau_s = g.controller.settings.reserve_window_s
    assert g.state()["arrival_rate_per_s"] == {"critical": [round(4 / tau_s, 3), round(20 / tau_s, 3)],
                                               "standard": [0.0, 0.0], "sheddable": [0.0, 0.0]}
    with pytest.raises(RequestError) as err:
        g.admit("standard")
    assert err.value.status == 429 and err.value.message.startswith(
        "standard requests are admitted up to 3 requests above the load the service was measured at lately"
    ), err.value.message
    assert g.refused == {("standard", "class_share_exhausted"): 1}
    # five arrivals at about 2.5/s (fast estimate) against 4 / 0.4 s drained at the ramp's cap: a
    # clump, not demand past it; the 429 stands and is counted, the level's signal stays 0
    assert g.state()["ramp_pressed"] is False and g.signals()["refused_ratio"] == 0.0
    clock.advance(0.8)
    for t in tickets:  # served together: four in flight over their lives
        g.release(t, served=True)
    assert g.state()["measured_reach"] == 4 and g.state()["ramp_limit"] == 7
    assert [g.admit("standard") for _ in range(7)] and g.in_flight == 7
    with pytest.raises(RequestError, match="3 requests above the load"):  # the ramp again, one step up
        g.admit("standard")
    assert g.signals()["refused_ratio"] == 0.0
    # arrivals past what the door drains at the ramp's cap (7 / latency(7)) press it: its refusals count
    drain = 7 / g.controller.predictor.latency_s(7)
    for _ in range(round(drain)):
        with pytest.raises(RequestError, match="above the load the service was measured at lately"):
            g.admit("sheddable")
    assert g.state()["ramp_pressed"] is True
    assert g.signals()["refused_ratio"] > 0.0


def test_the_ramp_refusal_says_the_configured_step() -> None:
    g = AdmissionGate(max_num_seqs=16, clock=FakeClock())
    g.configure(parse_policy({**SLO_POLICY, "admission": {**SLO_POLICY["admission"], "ramp_step": 1}}))
    fill(g, 4)  # critical work arrives; nothing served yet: the floor of 4
    with pytest.raises(RequestError) as err:
        g.admit("standard")
    assert err.value.message.startswith(
        "standard requests are admitted up to 1 request above the load the service was measured at lately"
    ), err.value.message


def test_the_door_predicts_with_the_mean_slowdown_of_the_model_replicas_read_lately() -> None:
    g = gate()
    clock = g._clock
    assert isinstance(clock, FakeClock)
    caps = g.state()["max_admitted"]
    assert (g.state()["engine_slowdown"], g.state()["slowdown_applied"]) == (1.0, 1.0)
    g.observe_speed(101, 4.0)
    g.observe_speed(102, 1.0)  # the ingress's requests spread over both: the mean, 2.5
    assert (g.state()["engine_slowdown"], g.state()["slowdown_applied"]) == (2.5, 2.0)  # less the margin
    assert g.state()["max_admitted"]["critical"] < caps["critical"]
    clock.advance(4.0)
    g.observe_speed(102, 1.0)
    clock.advance(2.0)  # replica 101 last read 6 s ago: it no longer counts
    g.observe_speed(102, 1.0)
    assert g.state()["slowdown_applied"] == 1.0 and g.state()["max_admitted"] == caps
    for bad in (float("nan"), 0.0, -1.0, "2"):
        g.observe_speed(103, bad)  # type: ignore[arg-type]
    assert g.state()["engine_slowdown"] == 1.0


def test_a_faster_engine_hands_a_freed_place_to_a_critical_request_waiting_at_the_door() -> None:
    g = gate({**SLO_POLICY, "admission": {**SLO_POLICY["admission"], "critical_wait_share": 0.5}})
    g.observe_speed(101, 2.5)
    cap = g.state()["max_admitted"]["critical"]
    fill(g, cap)

    async def scenario() -> bool:
        waiter = asyncio.ensure_future(g.admit_waiting(None, base=Criticality.CRITICAL))
        await asyncio.sleep(0)
        assert g.state()["queued"] == 1
        g.observe_speed(101, 1.0)  # the engine is back to its usual speed: the cap doubles
        ticket = await asyncio.wait_for(waiter, 1.0)
        return ticket.criticality is Criticality.CRITICAL

    assert asyncio.run(scenario())
