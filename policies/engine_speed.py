"""How much slower the engine steps now than it did lately: a starved engine, seen at its steps.

Pure: no clock, no vLLM. The model replica feeds `EngineSpeed.observe` with each engine step's
inter-token latencies (vLLM's iteration stats, stamped by the engine core) and reads
`EngineSpeed.slowdown`; the ingress's admission scales its latency model by it
(`policies.admission.AdmissionController.set_speed`).

The rule, and why:

- **Why a second signal.** Admission predicts latency from a model fitted to completed requests
  (`policies.admission.ServiceModel`). When the engine is starved (a noisy neighbour on its
  CPUs, a throttled GPU), completions stop coming for as long as the slowed requests run, so
  the door goes on admitting up to caps that the engine no longer meets: measured (12-05, 2-core
  AVX-512 EPYC, 2 s SLO, busy processes beside the server for 30 s) the door admitted 9-15
  requests during the starvation, which took 10-30 s. And once the completions of the slow
  phase arrive, they teach the model a slowness that is already over. The engine's steps show
  the starvation at once and say nothing about request size: a step of ``b`` sequences takes
  about the same time whatever their prompts and lengths, so one long request beside short ones
  does not read as a slower engine, where a count of completions would.
- **What is measured.** A step's time is the median inter-token latency of the sequences that
  decoded in it (the engine core's timestamps; a prefill or a preemption in between lengthens
  one sequence's, not the median). Steps are compared only with steps like them: the key is the
  batch (sequences that produced a token) and the step's prompt tokens in quarter powers of two
  (a step that also prefilled costs more, about in proportion to the tokens it prefilled; a kind
  spans at most 2 ** 0.25 = 1.19 x of them, under the door's margin of 1.25). Whole powers of two
  left up to 2 x within a kind, and prefill steps are long, so a few of them outweigh a second of
  decodes in the reading: measured (12-06, 2-core AVX-512 Xeon, 3 x C0, `bench/onset.py` with
  `window`), readings of 1.3-1.4 in the middle of a run rested on prefills of 64-255 tokens alone,
  reading 1.3-2.1 against references of steps that mostly prefilled fewer, while every kind of
  decode beside them read 0.95-1.06. Per key a reference step time is kept, the mean of the log
  over its latest `REF_STEPS` steps; a step's ratio is its time over its key's reference.
- **The slowdown** is ``exp`` of the median log ratio of the steps that ended within the last
  ``window_s`` (1 s), each weighted by its time: the ratio the engine spent at least half of
  that second at or above. So it turns half a window after the engine slows, whatever the
  steps' lengths (a count of steps would wait for the many fast steps before the change to
  leave the window, ten times more of them than slow ones after it at ten times slower), and
  one outlying step (a garbage collection) moves nothing. Where fewer than `MIN_STEPS` steps
  ended in the window (a starved engine's steps are long), the latest `MIN_STEPS` count, if
  the last of them ended within ``stale_s`` (10 s). Otherwise (an idle engine) the last value
  holds and fades towards 1 with time constant ``idle_tau_s`` (10 s): an idle engine says
  nothing about its speed, and a pessimistic value must not outlive what it measured.
- **Two steps at less than the reading end it** (`settle`). Weighting by time lets one long
  step outweigh the many short ones after it until it leaves the window: a prefill beside the
  decodes that took 0.9 s where 0.5 s is usual read 1.9 x for about a second, and readings of
  2 x and 5-7 x held the same way, each value unchanged over two or three of the ingress's
  probes 0.5 s apart, as one step's ratio is (measured 12-05, 2-core AVX2 EPYC, the overload
  benchmark at 1.5 and 3 x C0 and under its oscillating load). Each cut every cap for as long
  as its step outweighed the steps after it, 0.5-1.5 s, where the runs tell while the requests
  in flight finished within the SLO; at 3 x C0 three critical requests were refused in a row
  under one of them. Since, the largest reading in a run on the same schedules was 1.39. So
  once the latest two steps are both `SETTLE_RATIO` (1.25, the door's margin) times less slow
  than the weighted reading, the engine is stepping at their speed now: the reading is the
  slower of the two (never past 1 the other way); nearer than that, the window decides. A
  slow step just seen still reads at once, and so does every step of a starvation (each is as
  slow as the reading); one usual step after a slow one is not enough (it may fall in a
  starvation's gaps). The same holds the other way for a reading below 1.
- **The reference follows slow drift, not starvation.** It learns a step only while the
  slowdown, and that step's own ratio, are within ``hold_ratio`` (2) of 1 either way. A
  machine a fifth slower for an hour is absorbed within a few hundred steps (the admission
  model then learns it from completions), while during a starvation the reference keeps the
  engine's normal speed, and the slowdown falls back to 1 the moment the starvation ends. A
  key first seen during a slowdown starts from its step divided by the slowdown in force, so it
  agrees with the other keys.
- **No step at all while the engine has work** is a stall, and reads as at least the time since
  its last step over `STALL_MARGIN` (10) times the longest step it usually takes (the largest
  reference of any kind of step, prefills beside decodes included), counted from its last
  step, or from when the engine last got work after being idle where it has not stepped since
  (``slowdown(now, busy_since)``), once it has stepped `STALL_STEPS` (100) times. A request
  that finds the engine idle is prefilled alone, a step with no inter-token latency (no
  reference), which takes several decode steps' time: a first version of the bound, at one
  times the longest step, read those prefills as stalls (3-7 x for a few hundred
  milliseconds, several times a minute at 0.93 req/s after `make serve`), so for a while the
  bound counted only from a step made in the busy time; at ten times the longest step such a
  prefill reads under 1. But a starvation that begins as the engine gets work after a lull
  then never read at all: measured (12-05 night, the neighbour below, seed 402) no step for
  35 s with 4-10 requests in flight, the slowdown at 1 throughout, and the door admitting
  until its caps were full (8 of the 26 requests sent during it admitted; the requests sent
  after it 58% within the SLO, against 96% where the bound read it). Measured (12-05, 2-core
  AVX2 EPYC, two busy processes started beside `make serve`'s app under load): the engine core
  made no step at all for the first 13 s of the neighbour, then steps 20-35 times slower; without the
  bound the slowdown read 1 for those 13 s (no step, no reading) and the door admitted as if
  nothing had happened. The longest usual step, not the step of the batch in force, and ten
  times it: a hiccup of a second is no starvation. With twice it, under the benchmark's
  oscillating load a gap of about a second at a level change (the requests in flight then
  finished within the SLO, a second later than usual) read 6 x, held every cap at 1 for
  2 s and refused a critical request; ten times the longest step (about 0.1 s there) reads that
  gap as 1. The price: beside the neighbour, where the longest usual step was a prefill beside
  decodes of about 0.5 s, the stall read past the door's margin 3-7 s into it (1.6 s with
  twice). A prefill longer than ten times any step seen reads as slower for as long as it runs
  beyond that (then it is a kind with a reference of its own).
  A dead engine is the health check's to find.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence

REF_STEPS = 200  # steps a key's reference averages over (then an exponential average of that reach)
MIN_STEPS = 3  # steps a reading rests on, at least
KEEP_STEPS = 512  # steps kept for the window (more than a second of steps on any engine measured)
STALL_MARGIN = 10.0  # a time without a step reads as a stall past this many times the longest usual step
STALL_STEPS = 100  # steps observed before a time without one can read as a stall
SETTLE_RATIO = 1.25  # two steps this many times nearer 1 than the reading end it (`settle`)
PROMPT_KINDS_PER_DOUBLING = 4  # kinds of prefill per doubling of its prompt tokens (`step_key`)


def weighted_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The value at or above which at least half the total weight lies, of ``(value, weight)``
    pairs (weights > 0; not empty): the lower weighted median."""
    ordered = sorted(pairs)
    half = sum(w for _, w in ordered) / 2.0
    acc = 0.0
    for value, w in ordered:
        acc += w
        if acc >= half:
            return value
    return ordered[-1][0]


def settle(reading: float, newest: float, before: float) -> float:
    """The log slowdown ``reading`` (the window's weighted median), ended by the latest two
    steps' log ratios (``newest``, ``before``) where both are at least `SETTLE_RATIO` times
    nearer 1 than it: then the farther of the two on the reading's side, never past 0;
    otherwise ``reading``."""
    if max(abs(newest), abs(before)) > abs(reading) - math.log(SETTLE_RATIO):
        return reading
    if reading > 0:
        return max(0.0, newest, before)
    return min(0.0, newest, before)


def step_key(batch: int, prompt_tokens: int) -> tuple[int, int]:
    """The steps a step is compared with: its batch and its prompt tokens in quarter powers of two
    (0: none; kind ``k`` >= 1 holds ``[2 ** ((k - 1) / 4), 2 ** (k / 4))`` tokens)."""
    if prompt_tokens <= 0:
        return int(batch), 0
    return int(batch), int(math.floor(PROMPT_KINDS_PER_DOUBLING * math.log2(prompt_tokens) + 1e-9)) + 1


def prompt_from(kind: int) -> int:
    """The fewest prompt tokens of a step of prompt kind ``kind`` (`step_key`; 0: none)."""
    return 0 if kind <= 0 else math.ceil(2 ** ((kind - 1) / PROMPT_KINDS_PER_DOUBLING) - 1e-9)


class EngineSpeed:
    """The engine's step time now over its step time lately. See the module docstring."""

    __slots__ = ("window_s", "stale_s", "hold_ratio", "idle_tau_s", "min_slowdown", "max_slowdown", "_ref",
                 "_recent", "_held", "steps", "_last_step_at")

    def __init__(self, window_s: float = 1.0, hold_ratio: float = 2.0, idle_tau_s: float = 10.0,
                 min_slowdown: float = 0.25, max_slowdown: float = 100.0, stale_s: float = 10.0) -> None:
        if not (0 < window_s <= stale_s and hold_ratio > 1 and idle_tau_s > 0
                and 0 < min_slowdown <= 1 <= max_slowdown):
            raise ValueError(
                f"need 0 < window_s <= stale_s, hold_ratio > 1, idle_tau_s > 0, 0 < min_slowdown <= 1 <= "
                f"max_slowdown; got window_s={window_s!r}, stale_s={stale_s!r}, hold_ratio={hold_ratio!r}, "
                f"idle_tau_s={idle_tau_s!r}, min_slowdown={min_slowdown!r}, max_slowdown={max_slowdown!r}")
        self.window_s, self.stale_s = float(window_s), float(stale_s)
        self.hold_ratio = float(hold_ratio)
        self.idle_tau_s = float(idle_tau_s)
        self.min_slowdown, self.max_slowdown = float(min_slowdown), float(max_slowdown)
        self._ref: dict[tuple[int, int], list[float]] = {}  # key -> [mean log step time, steps]
        # the latest steps: (when it ended, log ratio, its time in seconds, its key)
        self._recent: collections.deque[tuple[float, float, float, tuple[int, int]]] = collections.deque(
            maxlen=KEEP_STEPS)
        self._held = (0.0, None)  # (log slowdown, when measured): what an idle window falls back on
        self.steps = 0  # steps observed
        self._last_step_at: float | None = None  # the latest engine output of any kind (`observe`)

    def observe(self, now: float, itls_s: Sequence[float], prompt_tokens: int = 0) -> None:
        """One engine step at ``now``: the inter-token latencies (seconds) of the sequences that
        decoded in it, and the prompt tokens it prefilled. A step where nothing decoded says
        nothing about the speed (no inter-token latency), but it is progress: it ends a stall."""
        self._last_step_at = now if self._last_step_at is None else max(self._last_step_at, now)
        times = [x for x in itls_s if x > 0 and math.isfinite(x)]
        if not times:
            return
        batch = len(itls_s)
        step_s = statistics.median(times)
        x = math.log(step_s)
        key = step_key(batch, prompt_tokens)
        ref = self._ref.get(key)
        if ref is None:  # agree with the other keys: this step at the slowdown in force
            self._ref[key] = ref = [x - self._log_slowdown(now), 0.0]
        r = x - ref[0]
        self._recent.append((now, r, step_s, key))
        self.steps += 1
        log_now = self._log_slowdown(now)
        band = math.log(self.hold_ratio)
        if abs(log_now) <= band and abs(r) <= band:  # slow drift: follow it; starvation: keep the usual speed
            ref[1] = min(ref[1] + 1.0, REF_STEPS)
            ref[0] += (x - ref[0]) / ref[1]

    def slowdown(self, now: float, busy_since: float | None = None) -> float:
        """The step time now over the reference (1: as lately; 10: ten times slower), within
        ``[min_slowdown, max_slowdown]``. ``busy_since``: when the engine, idle before, got the
        requests it has now (None: it has none); then a stall (no step for longer than
        `STALL_MARGIN` times its longest usual step, since its last step or, where it has not
        stepped since, since ``busy_since``) reads as at least its length over that, once it has
        stepped `STALL_STEPS` times."""
        value = self._log_slowdown(now)
        last = self._last_step_at
        if busy_since is not None and last is not None and self.steps >= STALL_STEPS:
            longest = max(ref[0] for ref in self._ref.values()) + math.log(STALL_MARGIN)
            gap = now - max(last, busy_since)  # no step since it got work: from then
            if gap > 0:
                value = max(value, min(math.log(self.max_slowdown), math.log(gap) - longest))
        return math.exp(value)

    def _reading(self, now: float) -> list[tuple[float, float, float, tuple[int, int]]]:
        """The steps the slowdown rests on now: those that ended within ``window_s``, or, where
        fewer than `MIN_STEPS` did, the latest `MIN_STEPS` if the last of them ended within
        ``stale_s``; [] otherwise."""
        recent = self._recent
        if not recent or now - recent[-1][0] > self.stale_s:
            return []
        steps = []
        for step in reversed(recent):  # newest first: only the window's are read
            if now - step[0] > self.window_s and len(steps) >= MIN_STEPS:
                break
            steps.append(step)
        return steps if len(steps) >= MIN_STEPS else []

    def _log_slowdown(self, now: float) -> float:
        steps = self._reading(now)
        if steps:
            value = settle(weighted_median([(r, w) for _, r, w, _ in steps]), steps[0][1], steps[1][1])
            self._held = (value, now)
        else:
            held, at = self._held
            value = 0.0 if at is None else held * math.exp(-max(0.0, now - at) / self.idle_tau_s)
        return min(math.log(self.max_slowdown), max(math.log(self.min_slowdown), value))

    def state(self, now: float, busy_since: float | None = None) -> dict[str, float | int | None]:
        """What an operator reads: the slowdown, the steps it rests on, the steps observed, the
        kinds of step with a reference, and the seconds since the engine's last output."""
        return {"slowdown": round(self.slowdown(now, busy_since), 3), "window_steps": len(self._reading(now)),
                "steps": self.steps, "keys": len(self._ref),
                "since_step_s": None if self._last_step_at is None else round(now - self._last_step_at, 3)}

    def window(self, now: float) -> list[dict[str, float | int]]:
        """The kinds of step the reading rests on now, the most time first: each kind's batch, the
        fewest prompt tokens of its kind (`step_key`, `prompt_from`; 0: no prefill), how many of its steps are in the
        window and their time, their ratio to its reference as the reading weighs them (the median
        by time: one long step among short ones reads long), and that reference in ms. Says which
        steps a reading comes from: a slow kind against the usual rest, or every kind alike."""
        kinds: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for _, r, step_s, key in self._reading(now):
            kinds.setdefault(key, []).append((r, step_s))
        out = [{"batch": key[0], "prompt_from": prompt_from(key[1]), "steps": len(v),
                "time_s": round(sum(t for _, t in v), 4),
                "ratio": round(math.exp(weighted_median(v)), 3),
                "ref_ms": round(1000 * math.exp(self._ref[key][0]), 2)} for key, v in kinds.items()]
        return sorted(out, key=lambda k: -k["time_s"])


__all__ = ["EngineSpeed", "KEEP_STEPS", "MIN_STEPS", "PROMPT_KINDS_PER_DOUBLING", "REF_STEPS", "SETTLE_RATIO",
           "STALL_MARGIN", "STALL_STEPS", "prompt_from", "settle", "step_key", "weighted_median"]
