"""A seeded simulation of the admission door under overload: compare settings side by side.

The overload benchmark runs on a shared 2-core machine whose speed moved by a fifth within an
hour (bench/RESULTS.md), so single runs cannot separate two admission settings whose
effects are a few percent. This replays the same seeded arrivals through `AdmissionController`
(the real one, from ``policies.admission``) in front of a model of the engine, for several
settings at once:

- arrivals: Poisson at ``--rate`` req/s with the benchmark's 20/50/30 critical/standard/sheddable
  mix (``--mix``), after a calm of one request at a time (as the adaptive runs start);
- the engine (``--engine``): ``ps``, processor sharing, each of ``n`` requests in flight
  progressing at ``1 / latency(n)`` of its work per second, past the batch too (the default, as
  the results stored before 12-07 were run); or ``priority``, vLLM's scheduler with
  ``scheduling_policy: priority`` as the service runs it: at most the batch runs, each running
  request progressing at ``1 / latency(running)``, the rest wait in the order (class, arrival)
  and start as slots free, so a critical request that arrives later starts before a standard
  one that waits; one whose deadline has passed before it starts is dropped
  (`policies.admission.should_drop`, as the model deployment does) and counts as late;
  ``latency`` one of three shapes (``concave``: the shape
  measured on 2 cores, 0.78 s alone, steep to 4 in flight and nearly flat to the batch of 16;
  ``linear``; ``convex``; ``knee``: the 2-core EPYC of 12-03, measured from the clients' records
  of an adaptive run (each request's latency against the requests in flight over its life): 0.62
  s alone, 0.11 s more per request up to 9 in flight and 0.41 s per request past that, where
  the CPU runs out; ``avx2``: the 2-core AVX2 EPYC of 12-07, the line the door fitted in three
  adaptive runs at 3 x C0 (median 1.45 s + 0.38 s per request in flight: 1.83 s alone)), times
  ``--scale``, queueing past the batch;
- noise: each request's work is lognormal (``--noise``, the log's standard deviation), and the
  engine's speed drifts as a random walk every 5 s (``--drift``), within 0.75-1.4;
- a slow phase (``--slow FROM,TO,FACTOR``): the engine ``FACTOR`` times slower from ``FROM``
  to ``TO`` seconds into the load (a noisy neighbour); the report then adds the share of the
  requests sent after it that were within the SLO (how fast the door recovers), and of those
  sent during it the shares refused and late;
- the engine's slowdown told to the door (``--speed-lag S``): the slow phase's factor, ``S``
  seconds late (`AdmissionController.set_speed`; on the service the model replicas measure it
  from the engine's steps, `policies.engine_speed`, and the ingress reads it every second), an
  oracle of the slow phase only (the drift below is left to the door to learn);
- critical's own cap (``--critical-cap``): ``share``, its share's cap at the model's mean, as the
  service runs it; ``tail``, also at most `AdmissionController.tail_limit` (where the measured
  latency's tail, not its mean, is within critical's budget; the limit the classes below are held
  to while it holds); ``ramp``, also at most `AdmissionController.ramp_limit` (the concurrency
  served lately plus the ramp's step). The two held variants were the open ideas of 12-07 for the
  critical requests late at critical's own cap; each waits at the full door as any critical
  request does (below);
- the gate's critical wait (`serve_app.admission`: a critical request at a full door waits up to
  `AdmissionController.critical_wait_s` for a freed slot it is still predicted to finish in time
  with, `AdmissionController.in_time_after`, unless critical work alone saturates the server:
  `AdmissionController.saturated_by`; ``--wait-rule first``: up to ``critical_wait_share`` of the
  SLO for the first freed slot, the rule before 12-07 evening); a request is on time when its latency
  plus ``overhead_ms`` (50 ms outside the gate; the door itself assumes its shipped 100 ms) is
  within the SLO. Preemption of waiting requests at the door is not modelled.

Settings compare on common random numbers: a seed fixes the arrivals, their classes, each
request's work (drawn when it arrives, admitted or not) and the drift, so one setting's decisions
change none of the traffic the others see, and a difference between settings is theirs, not the
draw's. (Before 12-05 evening, a request's work was drawn when it was admitted, so the first
different decision shifted every later draw, and two settings of one seed were offered different
traffic: results stored before then compare settings on different draws.)

It is a model, not a measurement: it says how settings rank against each other under the same
noise, and what they trade, not what the machine will serve.

Usage::

    .venv/bin/python bench/door_sim.py --rate 12.9 --scale 0.95 --shares 1,0.9,0.75 --shares 1,0.9,0.9
    .venv/bin/python bench/door_sim.py --preset issue10 --shares 1,0.9,0.75 --shares 1,0.9,0.9 \\
        --shares 1,1,1 --json bench/results/door_sim_shares.json
    .venv/bin/python bench/door_sim.py --rate 7 --shape knee --noise 0.2 --calm-s 60 --seeds 16 \\
        --shares 1,0.8,0.6 --ramp-step 0 --ramp-step 3
    .venv/bin/python bench/door_sim.py --rate 2.3 --shape knee --noise 0.2 --calm-s 60 --seeds 48 \\
        --seconds 120 --slow 10,40,3 --shares 1,0.9,0.9
    .venv/bin/python bench/door_sim.py --rate 2.4 --rate 3.2 --rate 4 --shape knee --noise 0.2 --calm-s 60 \\
        --seeds 32 --seconds 225 --mix 0/100/0 --shares 1,0.9,0.9 --shares 1,1,1

The report pools the seeds; ``pair_seeds`` counts the seeds (runs) in which both halves of issue
10's 1.5 x C0 item held: at least 95% of the requests within the SLO, and at most 1% of the
served ones late (the p99 within it).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import parse_mix  # noqa: E402
from policies.admission import AdmissionController, Criticality, ShareClock, should_drop  # noqa: E402
from policies.config import AdmissionConfig, ClassShares, SloConfig  # noqa: E402

CLASSES = tuple(Criticality)
CRITICAL_CAPS = ("share", "tail", "ramp")
BATCH = 16
SHAPES = ("concave", "linear", "convex", "knee", "avx2")
ENGINES = ("ps", "priority")
OVERTAKE_DEFAULT = AdmissionConfig.model_fields["overtake_sigmas"].default


def engine_latency(n: float, shape: str = "concave") -> float:
    """Seconds a request takes with ``n`` in flight (itself included), at speed 1."""
    k = min(n, BATCH) - 1
    if shape == "concave":
        within = 0.78 + 0.55 * (1.0 - math.exp(-k / 1.5)) + 0.02 * k
    elif shape == "linear":
        within = 0.78 + 0.07 * k
    elif shape == "convex":
        within = 0.78 + 0.004 * k * k
    elif shape == "knee":
        within = 0.62 + 0.11 * k + 0.3 * max(0.0, k - 8)
    elif shape == "avx2":
        within = 1.83 + 0.38 * k
    else:
        raise ValueError(f"shape: unknown {shape!r}; valid: {', '.join(SHAPES)}")
    return within * max(1.0, n / BATCH)


DEFAULT_SHARES: tuple[float, float, float] = tuple(  # type: ignore[assignment]
    getattr(ClassShares(), c.value) for c in CLASSES)  # the policy's defaults


@dataclass(frozen=True)
class Setting:
    shares: tuple[float, float, float] = DEFAULT_SHARES
    reserve_quantile: float = 0.99
    critical_wait_share: float = AdmissionConfig.model_fields["critical_wait_share"].default
    ramp_step: int | None = AdmissionConfig.model_fields["ramp_step"].default  # None: a fifth of the batch
    speed_lag_s: float | None = None  # the slow phase's factor told to the door this late; None: not told
    overtaken: bool = True  # False: the door as before 12-07, its caps not counting the work that overtakes
    overtake_sigmas: float | None = None  # None: the policy's default (`AdmissionConfig.overtake_sigmas`)
    # True: a freed slot goes to a waiting critical request only while it is still predicted to
    # finish in time (`AdmissionController.in_time_after`), and it waits up to `critical_wait_s`;
    # False: the first in line takes it, as before 12-07 evening
    wait_in_time: bool = True
    # critical's own cap: "share" (the service's), or also held to `tail_limit` or `ramp_limit`
    critical_cap: str = "share"

    @property
    def label(self) -> str:
        return (f"shares {'/'.join(f'{s:g}' for s in self.shares)}, reserve {self.reserve_quantile:g}, "
                f"wait {self.critical_wait_share:g}{' in time' if self.wait_in_time else ''}, ramp {'batch/5' if self.ramp_step is None else self.ramp_step}"
                + ("" if self.speed_lag_s is None else f", speed {self.speed_lag_s:g} s late")
                + ("" if self.overtaken else ", overtaking not counted")
                + ("" if self.overtake_sigmas is None or not self.overtaken
                   else f", overtaking at +{self.overtake_sigmas:g} sd")
                + ("" if self.critical_cap == "share" else f", critical held to its {self.critical_cap} limit"))


class CriticalHeld(AdmissionController):
    """The controller with critical's own cap also held to `tail_limit` (``hold`` "tail") or
    `ramp_limit` (``hold`` "ramp") where there is one: a variant to compare, not the service's."""

    hold = "share"

    def critical_cap(self, now: float) -> int:
        cap = super().critical_cap(now)
        limit = (self.tail_limit if self.hold == "tail" else self.ramp_limit(now) if self.hold == "ramp"
                 else None)
        return cap if limit is None else min(cap, limit)


def simulate(setting: Setting, rate: float, seed: int, scale: float = 1.0, shape: str = "concave",
             seconds: float = 60.0, noise: float = 0.1, drift: float = 0.03, slo_ms: float = 2000.0,
             overhead_ms: float = 50.0, mix: tuple[float, float, float] = (0.2, 0.5, 0.3),
             calm_s: float = 30.0, dt: float = 0.01,
             slow: tuple[float, float, float] | None = None, engine: str = "ps") -> dict:
    """One seeded run; counts per class (offered, refused, late, on time; ``dropped``: late ones
    the engine dropped before starting them) and the door's in flight.

    ``engine``: ``ps`` (processor sharing past the batch) or ``priority`` (at most the batch
    runs; the rest wait in (class, arrival) order, as vLLM's priority scheduler keeps them).

    ``slow``: ``(from_s, to_s, factor)``, the engine ``factor`` times slower from ``from_s`` to
    ``to_s`` into the load (a noisy neighbour); ``after_slow`` then counts the requests sent
    after it (offered, on time) and ``during_slow`` those sent during it (offered, refused,
    late). ``setting.speed_lag_s``: tell the door the slow phase's factor this many seconds late."""
    slo = SloConfig(e2e_p99_ms=slo_ms, class_share=dict(zip((c.value for c in CLASSES), setting.shares)))
    if setting.critical_cap not in CRITICAL_CAPS:
        raise ValueError(f"critical_cap: unknown {setting.critical_cap!r}; valid: {', '.join(CRITICAL_CAPS)}")
    ctl = CriticalHeld(slo, AdmissionConfig(overhead_ms=100, reserve_quantile=setting.reserve_quantile,
                                            critical_wait_share=setting.critical_wait_share,
                                            ramp_step=setting.ramp_step, overtake_sigmas=(
                                                None if not setting.overtaken
                                                else OVERTAKE_DEFAULT if setting.overtake_sigmas is None
                                                else setting.overtake_sigmas)), slots=BATCH)
    ctl.hold = setting.critical_cap
    if engine not in ENGINES:
        raise ValueError(f"engine: unknown {engine!r}; valid: {', '.join(ENGINES)}")
    rng, share, t, speed = random.Random(seed), ShareClock(), 0.0, 1.0

    slowed = 1.0

    def latency(n: float) -> float:
        return scale * speed * slowed * engine_latency(n, shape)

    while t < calm_s:  # one request at a time
        took = latency(1) * math.exp(rng.gauss(0.0, noise))
        t += took + 0.5
        ctl.observe_completion(t, took, took)
    start, end = t, t + seconds
    slo_s, outside_s = slo_ms / 1000.0, overhead_ms / 1000.0
    fixed_wait_s = setting.critical_wait_share * slo_s  # ``--wait-rule first``
    arrive, next_drift = t + rng.expovariate(rate), t
    running: list[list] = []  # [arrived, work done, work needed, share mark, class]
    queued: list[list] = []  # admitted, waiting for the engine's batch (``priority``), in start order
    line: list[tuple[float, float]] = []  # critical requests waiting at a full door: (arrived, work)
    counts = {c: {"offered": 0, "refused": 0, "late": 0, "on_time": 0, "dropped": 0} for c in CLASSES}
    in_flight: list[int] = []
    after_slow = {"offered": 0, "on_time": 0}
    during_slow = {"offered": 0, "refused": 0, "late": 0}

    def slow_at(x: float) -> float:
        return slow[2] if slow is not None and during(x) else 1.0

    def door() -> int:  # admitted and unfinished: what the ingress counts
        return len(running) + len(queued)

    def start_request(arrived: float, work: float, klass: Criticality, now: float) -> None:
        r = [arrived, 0.0, work, share.mark(now, door() + 1), klass]
        if engine == "ps" or len(running) < BATCH:
            running.append(r)
        else:  # vLLM's waiting queue: by priority, then arrival
            bisect.insort(queued, r, key=lambda q: (q[4].rank, q[0]))

    def start_queued(now: float) -> None:
        while queued and len(running) < BATCH:
            r = queued.pop(0)
            if should_drop(r[0] + slo_s, now):  # past its deadline before it starts: dropped, not computed
                share.mark(now, door())
                counts[r[4]]["late"] += 1
                counts[r[4]]["dropped"] += 1
                during_slow["late"] += during(r[0])
                continue
            running.append(r)

    def after(arrived: float) -> bool:
        return slow is not None and arrived - start >= slow[1]

    def during(arrived: float) -> bool:
        return slow is not None and slow[0] <= arrived - start < slow[1]

    while t < end + 3.0 * slo_s:
        t += dt
        slowed = slow_at(t)
        if setting.speed_lag_s is not None:
            ctl.set_speed(slow_at(t - setting.speed_lag_s), t)
        if t >= next_drift:
            speed = min(1.4, max(0.75, speed * math.exp(rng.gauss(0.0, drift))))
            next_drift = t + 5.0
        if running:
            step = dt / latency(len(running))
            for r in [r for r in running if r[1] + step >= r[2]]:
                running.remove(r)
                mark = share.mark(t, door())
                ctl.observe_completion(t, t - r[0], mark - r[3])
                on_time = t - r[0] + outside_s <= slo_s
                counts[r[4]]["on_time" if on_time else "late"] += 1
                after_slow["on_time"] += on_time and after(r[0])
                during_slow["late"] += (not on_time) and during(r[0])
            for r in running:
                r[1] += step
            start_queued(t)
        wait_s = ctl.critical_wait_s() if setting.wait_in_time else fixed_wait_s
        if setting.wait_in_time:  # freed slots to those still in time, first in line first
            kept = []
            for arrived, work in line:
                if door() < ctl.class_cap(Criticality.CRITICAL, t) and ctl.in_time_after(t - arrived, door()):
                    start_request(arrived, work, Criticality.CRITICAL, t)
                else:
                    kept.append((arrived, work))
            line[:] = kept
        else:
            while line and door() < ctl.class_cap(Criticality.CRITICAL, t):  # a freed slot
                start_request(*line.pop(0), Criticality.CRITICAL, t)
        while line and t - line[0][0] > wait_s:  # waited its share: refused
            during_slow["refused"] += during(line.pop(0)[0])
            counts[Criticality.CRITICAL]["refused"] += 1
        while arrive <= t and arrive < end:
            klass = rng.choices(CLASSES, weights=mix)[0]
            work = math.exp(rng.gauss(0.0, noise))  # drawn for every arrival, admitted or not
            counts[klass]["offered"] += 1
            after_slow["offered"] += after(arrive)
            during_slow["offered"] += during(arrive)
            if ctl.decide(klass, door() + len(line), arrive).admitted:
                start_request(arrive, work, klass, arrive)
            elif (klass is Criticality.CRITICAL and wait_s > 0
                  and not ctl.saturated_by(klass, arrive, usual_speed=setting.wait_in_time)):
                line.append((arrive, work))
            else:
                counts[klass]["refused"] += 1
                during_slow["refused"] += during(arrive)
            arrive += rng.expovariate(rate)
        if start <= t < end:
            in_flight.append(door())
    return {"counts": {c.value: v for c, v in counts.items()}, "in_flight_median": statistics.median(in_flight),
            "seconds": seconds, "after_slow": after_slow, "during_slow": during_slow}


def summarize(runs: list[dict]) -> dict:
    """Pooled over seeds: goodput, share of all requests on time, per class on time and shed."""
    pooled = {c.value: {k: sum(r["counts"][c.value][k] for r in runs)
                        for k in ("offered", "refused", "late", "on_time", "dropped")}
              for c in CLASSES}
    offered = sum(p["offered"] for p in pooled.values())
    on_time = sum(p["on_time"] for p in pooled.values())
    seconds = sum(r["seconds"] for r in runs)
    crit = pooled["critical"]
    after = sum(r["after_slow"]["offered"] for r in runs)
    slowed = {} if not after else {  # a run with a slow phase (`simulate`'s ``slow``)
        "after_slow_within": round(sum(r["after_slow"]["on_time"] for r in runs) / after, 4),
        "after_slow_by_seed": [round(r["after_slow"]["on_time"] / max(1, r["after_slow"]["offered"]), 3)
                               for r in runs],
        "during_slow_refused": round(sum(r["during_slow"]["refused"] for r in runs)
                                     / max(1, sum(r["during_slow"]["offered"] for r in runs)), 4),
        "during_slow_late": round(sum(r["during_slow"]["late"] for r in runs)
                                  / max(1, sum(r["during_slow"]["offered"] for r in runs)), 4),
    }

    def pair(r: dict) -> bool:  # issue 10's 1.5 x item in one run: >= 95% within, p99 of the served within
        c = r["counts"].values()
        offered_, on_time_, late_ = (sum(x[k] for x in c) for k in ("offered", "on_time", "late"))
        return on_time_ >= 0.95 * offered_ and late_ <= 0.01 * (on_time_ + late_)

    def critical_99(r: dict) -> bool:
        c = r["counts"]["critical"]
        return c["on_time"] >= 0.99 * c["offered"]

    return {
        "goodput_rps": round(on_time / seconds, 3),
        "within_slo": round(on_time / max(1, offered), 4),
        "critical_within_slo": round(crit["on_time"] / max(1, crit["offered"]), 4),
        "critical_refused": crit["refused"], "critical_late": crit["late"], "critical_offered": crit["offered"],
        "late_share": round(sum(p["late"] for p in pooled.values()) / max(1, offered), 4),
        "pair_seeds": f"{sum(pair(r) for r in runs)} of {len(runs)}",
        # runs (seeds) in which at least 99% of the critical requests were within the SLO: issue
        # 10's 3 x item, judged per run
        "critical_seeds_99": f"{sum(critical_99(r) for r in runs)} of {len(runs)}",
        "shed": {c: round(p["refused"] / max(1, p["offered"]), 3) for c, p in pooled.items()},
        # of the requests the door admitted, per class, the share that finished past the SLO (or
        # were dropped before the engine started them: ``dropped``)
        "admitted_late": {c: round(p["late"] / max(1, p["late"] + p["on_time"]), 4) for c, p in pooled.items()},
        "dropped": sum(p["dropped"] for p in pooled.values()),
        "refused": sum(p["refused"] for p in pooled.values()),
        # runs in which the door refused anything: on the service one refusal raises the level
        "refusal_seeds": f"{sum(any(c['refused'] for c in r['counts'].values()) for r in runs)} of {len(runs)}",
        "in_flight_median": statistics.median(r["in_flight_median"] for r in runs),
        **slowed,
    }


# Issue 10's benchmark phases on four days of this machine: (name, rate req/s, engine scale,
# shape or None for ``--shape``), the scale set so that one request alone takes what that day's
# runs measured (0.78 s at 1).
DAYS = {
    "12-01": ("C0 5.89 req/s, one request alone 0.76 s", 5.89, 1.0, None),
    "12-02": ("C0 4.31 req/s, one request alone 0.75 s", 4.31, 0.95, None),
    "12-02-slow": ("C0 2.34 req/s, one request alone 0.85-1.02 s", 2.34, 1.15, None),
    "12-03-epyc": ("2-core EPYC: C0 1.04 req/s, one request alone 0.65-0.80 s, a knee at 9 in flight",
                   1.04, 1.0, "knee"),
}
PRESETS = {
    day: [(f"{day} {x:g} x C0", round(x * c0, 2), scale, shape) for x in (1.0, 1.5, 3.0)]
    for day, (_, c0, scale, shape) in DAYS.items()
}
PRESETS["issue10"] = [row for day in DAYS for row in PRESETS[day] if not row[0].endswith(" 1 x C0")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="scenarios instead of --rate/--scale")
    ap.add_argument("--rate", type=float, action="append", default=None,
                    help="arrivals per second (repeat for several; default 12.93)")
    ap.add_argument("--scale", type=float, default=0.95, help="engine latency multiplier")
    ap.add_argument("--shape", default="concave", choices=SHAPES, help="where a preset day sets none")
    ap.add_argument("--shares", action="append", default=None,
                    help="class_share critical,standard,sheddable (repeat to compare; default: the "
                         "policy's, " + ",".join(f"{s:g}" for s in DEFAULT_SHARES) + ")")
    ap.add_argument("--reserve-quantile", type=float, action="append", default=None)
    ap.add_argument("--critical-wait", type=float, action="append", default=None,
                    help="admission.critical_wait_share (repeat to compare; default: the policy's)")
    ap.add_argument("--wait-rule", action="append", default=None, choices=("in_time", "first"),
                    help="in_time: a freed slot goes to a waiting critical request only while it is still "
                         "predicted to finish in time (the service's rule); first: to the first in line "
                         "(before 12-07 evening); repeat to compare")
    ap.add_argument("--critical-cap", action="append", default=None, choices=CRITICAL_CAPS,
                    help="critical's own cap: its share's (the service's), or also held to the tail "
                         "limit or the ramp's limit (repeatable)")
    ap.add_argument("--slo-ms", type=float, default=2000.0, help="slo.e2e_p99_ms (default 2000)")
    ap.add_argument("--ramp-step", type=int, action="append", default=None,
                    help="admission.ramp_step (repeat to compare; 0: no ramp; default: a fifth of the batch, 3)")
    ap.add_argument("--calm-s", type=float, default=30.0, help="one request at a time before the load")
    ap.add_argument("--slow", default=None, metavar="FROM,TO,FACTOR",
                    help="the engine FACTOR times slower from FROM to TO seconds into the load")
    ap.add_argument("--speed-lag", type=float, action="append", default=None, metavar="S",
                    help="tell the door the slow phase's factor S seconds late (repeat to compare; "
                    "a negative S: not told, the default)")
    ap.add_argument("--engine", default="ps", choices=ENGINES,
                    help="ps: processor sharing past the batch (the results stored before 12-07); "
                         "priority: the batch runs, the rest wait in (class, arrival) order, as vLLM's priority scheduler")
    ap.add_argument("--overtaken", action="append", default=None, choices=("on", "off"),
                    help="whether the door's caps count the more important work that overtakes a waiting "
                         "request (`AdmissionController.overtaken_caps`; repeat to compare; default on)")
    ap.add_argument("--overtake-sigmas", type=float, action="append", default=None,
                    help="standard deviations of the overtaking arrivals the caps count (repeat to compare; "
                         "default: the policy's admission.overtake_sigmas)")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--mix", default="20/50/30", metavar="C/S/D",
                    help="critical/standard/sheddable weights of the arrivals, as overload.py's --mix "
                         "(default 20/50/30)")
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--drift", type=float, default=0.03)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    default_ramp = Setting().ramp_step
    settings = [Setting(shares=tuple(float(x) for x in s.split(",")), reserve_quantile=q,  # type: ignore[arg-type]
                        ramp_step=g, speed_lag_s=None if lag < 0 else lag, overtaken=o == "on",
                        overtake_sigmas=z, critical_wait_share=w,
                        wait_in_time=it == "in_time", critical_cap=cc)
                for cc in (args.critical_cap or ["share"])
                for w in (args.critical_wait or [Setting().critical_wait_share])
                for it in (args.wait_rule or ["in_time"])
                for o in (args.overtaken or ["on"])
                # the sigmas apply only where overtaking is counted: one row without it
                for z in ((args.overtake_sigmas or [None]) if o == "on" else [None])
                for s in (args.shares or [",".join(map(str, DEFAULT_SHARES))])
                for q in (args.reserve_quantile or [0.99])
                for g in (args.ramp_step or [default_ramp]) for lag in (args.speed_lag or [-1.0])]
    for s in settings:
        if len(s.shares) != 3:
            ap.error(f"--shares: need three values critical,standard,sheddable, got {s.shares}")
    try:
        mix = tuple(w for _, w in parse_mix(args.mix))
    except ValueError:
        ap.error(f"--mix: need three weights critical/standard/sheddable, >= 0 and not all 0, got {args.mix!r}")
    scenarios = (PRESETS[args.preset] if args.preset else
                 [(f"{rate:g} req/s", rate, args.scale, None) for rate in (args.rate or [12.93])])
    slow = None
    if args.slow:
        try:
            slow = tuple(float(x) for x in args.slow.split(","))
        except ValueError:
            slow = ()
        if len(slow) != 3 or not (0 <= slow[0] < slow[1] and slow[2] > 0):
            ap.error(f"--slow: need FROM,TO,FACTOR with 0 <= FROM < TO and FACTOR > 0, got {args.slow!r}")
    results = []
    for name, rate, scale, shape in scenarios:
        shape = shape or args.shape
        for s in settings:
            runs = [simulate(s, rate, seed, scale=scale, shape=shape, noise=args.noise, drift=args.drift,
                             calm_s=args.calm_s, seconds=args.seconds, slow=slow, mix=mix, engine=args.engine,
                             slo_ms=args.slo_ms)
                    for seed in range(1, args.seeds + 1)]
            row = {"scenario": name, "rate": rate, "scale": scale, "shape": shape, "engine": args.engine,
                   "setting": s.label,
                   **summarize(runs)}
            results.append(row)
            print(f"{name:>18}  {s.label:42}  goodput {row['goodput_rps']:5.2f}  within {row['within_slo']:.3f}  "
                  f"critical {row['critical_within_slo']:.3f} ({row['critical_refused']} refused, "
                  f"{row['critical_late']} late of {row['critical_offered']}; >= 99% in {row['critical_seeds_99']} "
                  f"seeds)  late {row['late_share']:.3f}  "
                  f"pair {row['pair_seeds']}  "
                  f"shed {row['shed']}  refused {row['refused']} (in {row['refusal_seeds']} seeds)  "
                  f"in flight {row['in_flight_median']:g}  admitted late {row['admitted_late']} "
                  f"(dropped {row['dropped']})"
                  + (f"  after the slow phase {row['after_slow_within']:.3f}, during it refused "
                     f"{row['during_slow_refused']:.3f} late {row['during_slow_late']:.3f}" if slow else ""))
    if args.json:
        meta = {"command": "bench/door_sim.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "seeds": args.seeds, "noise": args.noise, "drift": args.drift, "calm_s": args.calm_s,
                "seconds": args.seconds, "slo_ms": args.slo_ms, "slow": args.slow, "mix": args.mix, "engine": args.engine,
                "model": "see bench/door_sim.py",
                "days": {day: note for day, (note, _, _, _) in DAYS.items()}}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
