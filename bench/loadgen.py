"""Open-loop load generator for an OpenAI-compatible chat endpoint (streamed, loopback only).

Open loop, so that a slow server cannot slow the load down (no coordinated omission):

- the whole arrival schedule is drawn before the run, a Poisson process whose rate follows a
  `Profile` (constant, a step, a sine wave), by thinning;
- each request is sent at its scheduled time whether or not earlier ones have answered;
- every latency is measured from the scheduled time, not from when the request got out.

A run is bounded in count (the schedule) and time: after the last arrival it waits at most
``drain_timeout_s`` for the requests still running, then cuts them off (closing the connection,
which aborts them server-side); a cut-off request is recorded as status ``CUT_OFF``. A ``stop``
predicate may end the run early (calibration stops a probe as soon as it has certainly failed).

Each request is a streamed chat completion with ``ignore_eos`` (exactly ``max_tokens`` tokens) and
a prompt drawn from the run's own random generator: prompts differ between runs (the semantic
cache must not answer for the model) unless a seed is fixed. With a criticality mix, each request
carries its class in ``X-Brownout-Criticality``. Per request it records the scheduled, sent,
first-token and done times, the status, the class, every ``X-Brownout-*`` response header and
``Retry-After``.

The pure parts (profiles, schedule, prompts, the calibration search and its pass rule) are
separate from the I/O (`run_load`), so they are tested without a server.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import string
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

CRITICALITY_HEADER = "X-Brownout-Criticality"
CLASSES = ("critical", "standard", "sheddable")
DEFAULT_MIX: tuple[tuple[str, float], ...] = (("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3))

CUT_OFF = -1  # still running when the run ended: the client closed the connection
CONN_ERROR = 0  # no HTTP status: the connection failed

# Prompts: real words mixed with random letters. Measured with the real embedding model (the
# integration tests' prompts, same recipe): distinct prompts stay well under the semantic cache's
# 0.92 cosine threshold, so the cache never answers for the model.
WORDS = ("river stone market violin orbit garden thunder pixel harbor lantern copper meadow rocket velvet "
         "glacier circus falcon tunnel prism saddle anchor comet desert ember forest galaxy hammer island "
         "jungle kettle ladder magnet needle oyster pepper quartz ribbon satellite tractor umbrella volcano").split()


# -- profiles and the schedule ---------------------------------------------------------------------

@dataclass(frozen=True)
class Phase:
    """``duration_s`` at ``rate_rps``, plus a sine swing of ``amplitude_rps`` over ``period_s``."""

    duration_s: float
    rate_rps: float
    amplitude_rps: float = 0.0
    period_s: float = 0.0

    def rate_at(self, t_s: float) -> float:
        if self.amplitude_rps and self.period_s:
            return max(0.0, self.rate_rps + self.amplitude_rps * math.sin(2 * math.pi * t_s / self.period_s))
        return self.rate_rps

    @property
    def peak_rps(self) -> float:
        return self.rate_rps + abs(self.amplitude_rps)


@dataclass(frozen=True)
class Profile:
    """An offered load over time: phases one after the other."""

    name: str
    phases: tuple[Phase, ...]

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    @property
    def peak_rps(self) -> float:
        return max(p.peak_rps for p in self.phases)

    @property
    def change_points_s(self) -> list[float]:
        """When each phase after the first starts (a load step)."""
        out, t = [], 0.0
        for p in self.phases[:-1]:
            t += p.duration_s
            out.append(t)
        return out

    def rate_at(self, t_s: float) -> float:
        start = 0.0
        for p in self.phases:
            if t_s < start + p.duration_s:
                return p.rate_at(t_s - start)
            start += p.duration_s
        return 0.0

    def mean_rps(self, t0_s: float, t1_s: float, steps: int = 200) -> float:
        """The mean offered rate over [t0, t1) (midpoint rule)."""
        if t1_s <= t0_s:
            return 0.0
        dt = (t1_s - t0_s) / steps
        return sum(self.rate_at(t0_s + (i + 0.5) * dt) for i in range(steps)) / steps


def constant(rate_rps: float, duration_s: float) -> Profile:
    return Profile(f"fixed {rate_rps:.2f}/s", (Phase(duration_s, rate_rps),))


def step(capacity_rps: float, low_s: float, high_s: float, low: float = 0.5, high: float = 3.0) -> Profile:
    """``low`` x capacity for ``low_s``, ``high`` x for ``high_s``, ``low`` x for ``low_s`` again."""
    return Profile(f"step {low:g}x-{high:g}x-{low:g}x of {capacity_rps:.2f}/s",
                   (Phase(low_s, low * capacity_rps), Phase(high_s, high * capacity_rps),
                    Phase(low_s, low * capacity_rps)))


def oscillate(center_rps: float, amplitude_rps: float, period_s: float, duration_s: float) -> Profile:
    """A sine wave around ``center_rps`` (put it near the level-1 threshold to test flapping)."""
    return Profile(f"oscillate {center_rps:.2f}+-{amplitude_rps:.2f}/s every {period_s:g}s",
                   (Phase(duration_s, center_rps, amplitude_rps, period_s),))


@dataclass(frozen=True)
class Arrival:
    at_s: float  # scheduled time, from the start of the run
    criticality: str | None = None


def schedule(profile: Profile, rng: random.Random, max_requests: int | None = None,
             mix: Sequence[tuple[str, float]] | None = None) -> list[Arrival]:
    """Poisson arrivals with the profile's rate (Lewis-Shedler thinning), at most ``max_requests``.

    Drawn entirely before the run, from ``rng`` only: the same seed gives the same schedule.
    With a ``mix``, each arrival gets a class drawn with the mix's weights.
    """
    peak = profile.peak_rps
    out: list[Arrival] = []
    if peak <= 0:
        return out
    classes = [c for c, _ in mix] if mix else None
    weights = [w for _, w in mix] if mix else None
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= profile.duration_s or (max_requests is not None and len(out) >= max_requests):
            return out
        if rng.random() * peak <= profile.rate_at(t):
            crit = rng.choices(classes, weights)[0] if classes else None
            out.append(Arrival(t, crit))


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """``"20/50/30"`` (critical/standard/sheddable percentages) -> the mix."""
    parts = [float(x) for x in text.split("/")]
    if len(parts) != len(CLASSES) or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"mix must be three non-negative weights critical/standard/sheddable, got {text!r}")
    total = sum(parts)
    return tuple((c, p / total) for c, p in zip(CLASSES, parts, strict=True))


def make_prompt(rng: random.Random, words: int = 6, noise: int = 6) -> str:
    """``words`` real words and ``noise`` random 6-letter strings, shuffled."""
    parts = rng.sample(WORDS, words) + ["".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(noise)]
    rng.shuffle(parts)
    return " ".join(parts)


def run_seed() -> int:
    """A fresh seed per run (time and a random UUID): prompts never repeat across runs."""
    return (time.time_ns() ^ uuid.uuid4().int) & 0xFFFFFFFF


# -- per-request record ----------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """One request; times in seconds from the start of the run (``None``: did not happen)."""

    index: int
    scheduled_s: float
    criticality: str | None = None
    sent_s: float | None = None
    first_token_s: float | None = None
    done_s: float | None = None
    status: int | None = None
    error: str | None = None
    completion_tokens: int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """A whole completion: HTTP 200 and the stream ended with ``[DONE]``, no in-band error."""
        return self.status == 200 and self.error is None and self.done_s is not None

    @property
    def e2e_ms(self) -> float | None:
        return None if self.done_s is None else (self.done_s - self.scheduled_s) * 1000.0

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else (self.first_token_s - self.scheduled_s) * 1000.0

    @property
    def level(self) -> int | None:
        value = self.headers.get("x-brownout-level")
        return int(value) if value is not None and value.isdigit() else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the calibration search (pure) -----------------------------------------------------------------

@dataclass(frozen=True)
class SloRule:
    """A probe passes when at most ``max_error_ratio`` of its requests failed and at most
    ``1 - quantile`` of them were slower than ``slo_ms`` end to end (so the p99 is within the SLO).

    Counted over every request sent; a request still running at the end counts as an error. A
    probe with no request at all does not pass.
    """

    slo_ms: float = 2000.0
    quantile: float = 0.99
    max_error_ratio: float = 0.01

    def allowed(self, n: int) -> tuple[int, int]:
        """(errors, late) a probe of ``n`` requests may have and still pass."""
        return math.floor(self.max_error_ratio * n + 1e-9), math.floor((1 - self.quantile) * n + 1e-9)

    def passed(self, records: Sequence[RequestRecord]) -> bool:
        errors = sum(1 for r in records if not r.ok)
        late = sum(1 for r in records if r.ok and (r.e2e_ms or 0.0) > self.slo_ms)
        max_errors, max_late = self.allowed(len(records))
        return bool(records) and errors <= max_errors and late <= max_late

    def certainly_failed(self, records: Sequence[RequestRecord], now_s: float, n_planned: int) -> bool:
        """Whether the probe can no longer pass, whatever the rest does.

        Errors and late completions so far are final; a request still running past the SLO will
        be either late or an error. The probe fails for sure when errors alone or late ones alone
        exceed what is allowed, or when together with the overdue ones they exceed both allowances.
        """
        max_errors, max_late = self.allowed(n_planned)
        errors = late = overdue = 0
        for r in records:
            if r.done_s is not None:
                if not r.ok:
                    errors += 1
                elif (r.e2e_ms or 0.0) > self.slo_ms:
                    late += 1
            elif (now_s - r.scheduled_s) * 1000.0 > self.slo_ms:
                overdue += 1
        return errors > max_errors or late > max_late or errors + late + overdue > max_errors + max_late


@dataclass(frozen=True)
class Probe:
    rate_rps: float
    passed: bool
    requests: int
    errors: int
    p99_e2e_ms: float | None
    stopped_early: bool = False
    stage: str = ""  # "coarse" (a short prefix of the trace) or "fine" (the whole trace)
    late: int = 0  # judged requests that completed after the SLO
    max_e2e_ms: float | None = None  # the slowest judged completion
    other_cpu_cores: float | None = None  # CPU used meanwhile by other processes
    repeated: bool = False  # this is the second try of a probe disturbed by other processes
    p99_fit_ms: float | None = None  # fine probes: `fit_p99` of the judged latencies (None: failed outright)


@dataclass(frozen=True)
class Calibration:
    """The highest rate that passed (``capacity_rps``), and every probe in order."""

    capacity_rps: float
    probes: tuple[Probe, ...]
    bracketed: bool  # a failing rate above the capacity was found (else it is a lower bound)
    upper_rps: float | None = None  # the lowest failing rate above the capacity (the resolution)


def calibrate(measure: Callable[[float], Probe], start_rps: float, *, growth: float = 2.0,
              bisect_steps: int = 3, max_rps: float = 64.0, min_rps: float = 0.1,
              rel_tol: float = 0.0) -> Calibration:
    """The highest rate that passes, by a geometric ramp and then a bisection.

    From ``start_rps``, multiply by ``growth`` while probes pass (down, dividing, while they
    fail) until a passing and a failing rate bracket the capacity; then bisect that bracket
    at most ``bisect_steps`` times, stopping early once ``(hi - lo) / lo <= rel_tol``. Each probe
    is one call of ``measure(rate)``; a good ``start_rps`` (a guess near the capacity) saves
    probes. Capacity 0 when even ``min_rps`` fails.
    """
    probes: list[Probe] = []

    def probe(rate: float) -> bool:
        result = measure(rate)
        probes.append(result)
        return result.passed

    lo: float | None = None
    hi: float | None = None
    rate = start_rps
    if probe(rate):
        lo = rate
        while rate * growth <= max_rps:
            rate *= growth
            if probe(rate):
                lo = rate
            else:
                hi = rate
                break
    else:
        hi = rate
        while rate / growth >= min_rps:
            rate /= growth
            if probe(rate):
                lo = rate
                break
            hi = rate
    if lo is None:
        return Calibration(0.0, tuple(probes), True, hi)
    if hi is None:
        return Calibration(lo, tuple(probes), False)
    for _ in range(bisect_steps):
        if (hi - lo) / lo <= rel_tol:
            break
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return Calibration(lo, tuple(probes), True, hi)


Z99 = 2.3263  # the standard normal's 99th percentile


def fit_p99(values: Sequence[float]) -> float | None:
    """The 99th percentile of a normal fit of ``values``: mean + 2.33 x standard deviation.

    A p99 estimate from every value, not only the largest: of a few dozen values the empirical
    p99 is their maximum, one request, as noisy as that request. A normal fit understates a
    heavy right tail; under load the spread of latencies is what moves. None for fewer than 2.
    """
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean + Z99 * math.sqrt(var)


def crossing(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """Where the least-squares line through ``points`` (rate, value) reaches ``target``; None
    with fewer than 2 distinct rates or a line that does not rise with the rate."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    if slope <= 0:
        return None
    return mx + (target - my) / slope


def calibrate_fit(coarse: Callable[[float], Probe], fine: Callable[[float], Probe], start_rps: float, *,
                  target_ms: float, growth: float = 2.0, coarse_tol: float = 0.15, coarse_steps: int = 4,
                  spread: Sequence[float] = (0.75, 0.9, 1.05, 1.2), extra: int = 2, max_rps: float = 64.0,
                  min_rps: float = 0.1) -> Calibration:
    """The rate at which the p99 crosses ``target_ms``: a coarse search, then a fit.

    Meant for probes that replay one arrival trace scaled to the rate (`trace`): a coarse probe
    sends a short prefix of it and passes or fails (`SloRule`); a fine probe sends the whole of
    it and measures ``p99_fit_ms`` (`fit_p99`; None when it failed outright: an error, or a
    request far past the SLO).

    1. `calibrate` with ``coarse``: ramp, then bisect until the bracket is within ``coarse_tol``;
       its capacity ``c`` is a first guess;
    2. fine probes at ``c`` times each of ``spread``; while none failed, one more above the
       highest (x 1.2), while none passed, one below the lowest (/ 1.25), ``extra`` at most;
    3. the capacity is where the least-squares line through the fine probes' (rate, p99) reaches
       ``target_ms`` (`crossing`): every fine probe's requests count, so one slow request moves
       it little. It stays below any rate whose fine probe failed outright and within 0.8 x the
       lowest and 1.2 x the highest rate probed; with no rising line, the highest rate whose
       fine probe passed.
    """
    first = calibrate(coarse, start_rps, growth=growth, bisect_steps=coarse_steps, max_rps=max_rps,
                      min_rps=min_rps, rel_tol=coarse_tol)
    probes = list(first.probes)
    if first.capacity_rps <= 0:
        return Calibration(0.0, tuple(probes), True, first.upper_rps)
    guess = first.capacity_rps
    fines = [fine(guess * k) for k in spread]
    for _ in range(extra):
        if not any(not p.passed for p in fines):
            fines.append(fine(max(p.rate_rps for p in fines) * 1.2))
        elif not any(p.passed for p in fines):
            fines.append(fine(min(p.rate_rps for p in fines) / 1.25))
        else:
            break
    probes += fines
    points = [(p.rate_rps, p.p99_fit_ms) for p in fines if p.p99_fit_ms is not None]
    est = crossing(points, target_ms)
    if est is None:
        est = max((p.rate_rps for p in fines if p.passed), default=0.0)
    rates = [p.rate_rps for p in fines]
    est = min(max(est, 0.8 * min(rates)), 1.2 * max(rates))
    broken = [p.rate_rps for p in fines if p.p99_fit_ms is None]
    if broken and est >= min(broken):
        below = [p.rate_rps for p in fines if p.passed and p.rate_rps < min(broken)]
        est = max(below, default=min(broken) / 1.25)
    failing = [p.rate_rps for p in fines if not p.passed and p.rate_rps > est]
    return Calibration(max(0.0, est), tuple(probes), bool(failing), min(failing, default=None))


# -- calibration traces (pure) ---------------------------------------------------------------------

def unit_trace(seed: int, n: int) -> list[float]:
    """The first ``n`` arrival times of a rate-1 Poisson process drawn from ``Random(seed)``."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append(t)
    return out


def reference_capacity(unit: Sequence[float], limit: float = 2.5, warmup: int = 0) -> float:
    """How bursty a unit trace is, independently of any server: the highest rate (in services
    per unit of time) at which a FIFO single server with service time 1 keeps the sojourn of
    every request after the first ``warmup`` within ``limit`` services."""

    def worst(rate: float) -> float:
        wait, prev, out = 0.0, None, 0.0
        for i, a in enumerate(unit):
            at = a / rate
            if prev is not None:
                wait = max(0.0, wait + 1.0 - (at - prev))
            prev = at
            if i >= warmup:
                out = max(out, wait + 1.0)
        return out

    lo, hi = 0.0, 64.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if worst(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo


def median_trace_seed(n: int, candidates: int = 41, warmup: int = 2, limit: float = 2.5) -> int:
    """The seed, among ``range(candidates)``, whose first ``n`` arrivals are of median burstiness
    (`reference_capacity`): a fixed trace that is neither a lucky nor an unlucky draw. It depends
    on ``n`` only, never on a server."""
    ranked = sorted(range(candidates), key=lambda s: (reference_capacity(unit_trace(s, n), limit, warmup), s))
    return ranked[len(ranked) // 2]


def decisive_prefix(unit: Sequence[float], warmup: int = 2, limit: float = 2.5, tol: float = 0.05,
                    min_n: int = 8) -> int:
    """The shortest prefix (at least ``min_n``) of a unit trace whose `reference_capacity` is
    within ``tol`` of the whole trace's: it already holds the trace's worst burst, so a probe
    that sends only this prefix fails about where the whole trace fails, in a fraction of the time."""
    whole = reference_capacity(unit, limit, warmup)
    for k in range(min(min_n, len(unit)), len(unit)):
        if reference_capacity(unit[:k], limit, warmup) <= whole * (1 + tol):
            return k
    return len(unit)


def trace(rate_rps: float, n: int, seed: int) -> list[Arrival]:
    """The first ``n`` arrivals of the unit trace ``seed`` scaled to ``rate_rps``: probes at
    different rates replay the same pattern (common random numbers), and a shorter probe is a
    prefix of a longer one."""
    if rate_rps <= 0:
        raise ValueError(f"rate must be positive, got {rate_rps}")
    return [Arrival(t / rate_rps) for t in unit_trace(seed, n)]


# -- the run (I/O) ---------------------------------------------------------------------------------

@dataclass
class RunResult:
    """A run's records and the level timeline polled from the admin API meanwhile."""

    profile: Profile
    records: list[RequestRecord]
    levels: list[dict[str, Any]]  # {"t_s", "level", "policy_level", "queue_length"}
    started_at: float  # wall clock (epoch s) of t = 0
    seed: int
    stopped_early: bool = False

    @property
    def span_s(self) -> float:
        return self.profile.duration_s


def _wanted_headers(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()
            if k.lower().startswith("x-brownout-") or k.lower() == "retry-after"}


async def stream_one(client: Any, url: str, body: dict[str, Any], headers: dict[str, str], rec: RequestRecord,
                     clock: Callable[[], float]) -> None:
    """Send one streamed request and fill ``rec`` (times from ``clock``: sent, first token, done;
    status, the Brownout headers, completion tokens, an error)."""
    import httpx

    rec.sent_s = clock()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            rec.status = resp.status_code
            rec.headers = _wanted_headers(resp.headers)
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.error = raw[:300].decode("utf-8", "replace")
                rec.done_s = clock()
                return
            finished = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                doc = json.loads(data)
                if "error" in doc:
                    rec.error = json.dumps(doc["error"])[:300]
                    break
                for choice in doc.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if text and rec.first_token_s is None:
                        rec.first_token_s = clock()
                if doc.get("usage"):
                    rec.completion_tokens = doc["usage"].get("completion_tokens")
            rec.done_s = clock()
            if not finished and rec.error is None:
                rec.error = "stream ended without [DONE]"
    except httpx.HTTPError as err:
        rec.status = rec.status if rec.status is not None else CONN_ERROR
        rec.error = f"{type(err).__name__}: {err}"[:300]
        rec.done_s = clock()


# what each poll keeps of the ingress's admission state (``/admin/brownout``'s ``ingress.admission``)
ADMISSION_POLLED = ("in_flight", "waiting", "queued", "class_cap", "reserved", "rate_per_s", "base_latency_s",
                    "per_request_s", "latency_alone_s", "latency_floor_s", "wait_smoothing_s", "caps_held_s", "level_models_replaced",
                    "speed_shifts", "engine_slowdown", "slowdown_applied", "latency_tail", "tail_limit", "tail_holds",
                    "measured_reach", "ramp_limit", "ramp_pressed", "arrival_rate_per_s", "refused")


async def _poll_levels(client: Any, admin_url: str, clock: Callable[[], float], out: list[dict[str, Any]],
                       interval_s: float) -> None:
    """The effective level every ``interval_s`` from ``GET /admin/brownout``; stops at a 404
    (a server without the admin API)."""
    while True:
        try:
            resp = await client.get(admin_url, timeout=5.0)
            if resp.status_code == 404:
                return
            if resp.status_code == 200:
                state = resp.json()
                adm = (state.get("ingress") or {}).get("admission") or {}
                out.append({"t_s": round(clock(), 3), "level": state.get("level"),
                            "policy_level": state.get("policy_level"),
                            "queue_length": (state.get("signals") or {}).get("values", {}).get("queue_length"),
                            # the door as the polled ingress replica saw it (absent without admission)
                            **({"admission": {k: adm.get(k) for k in ADMISSION_POLLED}} if adm.get("enabled") else {})})
        except Exception:  # noqa: BLE001 - a missed poll is a gap in the timeline, nothing more
            pass
        await asyncio.sleep(interval_s)


async def run_load(base_url: str, model: str, profile: Profile, *, seed: int | None = None,
                   prompt_seed: int | None = None, arrivals: Sequence[Arrival] | None = None,
                   max_requests: int | None = None, mix: Sequence[tuple[str, float]] | None = None,
                   max_tokens: int = 16, drain_timeout_s: float = 30.0,
                   stop: Callable[[list[RequestRecord], float, int], bool] | None = None,
                   poll_levels_s: float | None = 0.5, progress: str | None = None,
                   extra_body: dict[str, Any] | None = None, transport: Any = None,
                   headers: dict[str, str] | None = None) -> RunResult:
    """Run ``profile`` open-loop against ``base_url`` (``http://127.0.0.1:PORT``).

    ``stop(records, now_s, n_planned)`` is checked four times a second; when it returns True no
    more requests are sent and those running are cut off. ``progress``: a label for a tqdm bar
    (None: no bar). ``transport``: an httpx transport (tests pass ``httpx.MockTransport``).
    ``arrivals``: send these instead of drawing a schedule from ``profile`` (a calibration
    trace); prompts still come from ``seed``, so they are new unless the seed is fixed.
    ``prompt_seed``: draw the prompts from this seed instead (runs that share a schedule, and so
    a ``seed``, must not share prompts: the semantic cache would answer the second run's from the
    first's).
    """
    import httpx

    host = httpx.URL(base_url).host
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the load generator sends to loopback only, got {base_url!r}")
    seed = run_seed() if seed is None else seed
    rng = random.Random(seed)
    arrivals = schedule(profile, rng, max_requests, mix) if arrivals is None else list(arrivals)
    prompt_rng = rng if prompt_seed is None else random.Random(prompt_seed)
    prompts = [make_prompt(prompt_rng) for _ in arrivals]
    url = base_url.rstrip("/") + "/v1/chat/completions"
    records = [RequestRecord(i, a.at_s, a.criticality) for i, a in enumerate(arrivals)]
    levels: list[dict[str, Any]] = []

    bar = None
    if progress is not None:
        from tqdm import tqdm

        bar = tqdm(total=len(arrivals), desc=progress, unit="req", leave=False, dynamic_ncols=True)

    # No client-side queueing: as many connections as requests in flight; the read timeout is
    # the run's own deadline (drain_timeout_s), enforced below.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(connect=10.0, read=None, write=10.0, pool=None)
    # ``headers``: sent with every request (the API key: `bench.credentials`)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport, headers=headers) as client:
        t0 = time.perf_counter()
        started_at = time.time()

        def clock() -> float:
            return time.perf_counter() - t0

        poller = (asyncio.create_task(_poll_levels(client, base_url.rstrip("/") + "/admin/brownout", clock,
                                                   levels, poll_levels_s)) if poll_levels_s else None)
        stopped = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []

        def tick(_: asyncio.Task[None]) -> None:
            if bar is not None:
                bar.update(1)

        async def watch() -> None:
            while not stopped.is_set():
                await asyncio.sleep(0.25)
                if stop is not None and stop(records[: len(tasks)], clock(), len(records)):
                    stopped.set()

        watcher = asyncio.create_task(watch())
        for rec, prompt in zip(records, prompts, strict=True):
            delay = rec.scheduled_s - clock()
            if delay > 0:
                try:
                    await asyncio.wait_for(stopped.wait(), timeout=delay)
                except TimeoutError:
                    pass
            if stopped.is_set():
                break
            body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, **(extra_body or {})}
            headers = {CRITICALITY_HEADER: rec.criticality} if rec.criticality else {}
            task = asyncio.create_task(stream_one(client, url, body, headers, rec, clock))
            task.add_done_callback(tick)
            tasks.append(task)

        pending = {t for t in tasks if not t.done()}
        if pending and not stopped.is_set():
            wait_s = max(0.0, profile.duration_s - clock()) + drain_timeout_s
            stop_wait = asyncio.create_task(stopped.wait())
            deadline = asyncio.get_running_loop().time() + wait_s
            while pending and not stopped.is_set():
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                _, pending = await asyncio.wait(pending | {stop_wait}, timeout=left,
                                                return_when=asyncio.FIRST_COMPLETED)
                pending.discard(stop_wait)
            stop_wait.cancel()
        early = stopped.is_set()
        stopped.set()
        for task, rec in zip(tasks, records, strict=False):
            if not task.done():
                task.cancel()
                rec.status, rec.error = CUT_OFF, "cut off at the end of the run"
        await asyncio.gather(*tasks, return_exceptions=True)
        await watcher
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
    if bar is not None:
        bar.close()
    return RunResult(profile, records[: len(tasks)], levels, started_at, seed, early)
