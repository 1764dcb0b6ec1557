"""Per-feature cost accounting: what each optional feature costs and how often it is off, ranked.

An operator deciding which feature to give up first needs two things per feature: what it costs
when it runs, and how often the policy (or an operator) already turns it off. `FeatureCost`
accumulates the first; the policy actor's `policies.service.FeatureClock` the second; `merge`
puts them side by side and `rank` orders them, so the first line is the feature most worth
looking at.

What is measured, per feature (`FeatureCost.record`, one call per stage call):

- ``calls``, ``failures`` (errors and time-outs: the stage was bypassed for that request);
- ``latency_ms``: the stage's wall time as the ingress saw it (send to answer, one handle call:
  features sent together in one call share its time, since none of them is done before it);
- ``cpu_ms``: CPU time the worker spent on the feature's own work (`time.thread_time` in the
  enrichment worker, on the event loop and in its worker threads), when the worker reported it
  (``cpu_calls`` counts the calls that did; a failed or timed-out call reports none).

Each figure is kept since start and over the last ``window_s`` (5 minutes), the window as
fixed-size time buckets (``bucket_s``, 10 s) so memory is bounded whatever the request rate;
the window's figures are exact to one bucket. Per call averages are ``latency_ms_per_call``
(over ``calls``) and ``cpu_ms_per_call`` (over ``cpu_calls``).

Ranking (`rank`): cost first, degradation second. A feature's cost is
``(latency_ms_per_call + cpu_ms_per_call) x calls`` (milliseconds per request times how many
requests, i.e. what it took in all); its degradation is how often it was turned off, then how
long it was off. The window's figures decide; ties fall to the since-start figures, then the
name. Pure: time passed in, no I/O; table-tested in ``tests/unit/test_feature_cost.py``.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FeatureCost", "Totals", "cost_ms", "merge", "rank"]

FIELDS = ("calls", "failures", "latency_ms", "cpu_ms", "cpu_calls")


@dataclass
class Totals:
    """Sums for one feature over some span: calls, failures, wall and CPU milliseconds."""

    calls: int = 0
    failures: int = 0
    latency_ms: float = 0.0
    cpu_ms: float = 0.0
    cpu_calls: int = 0

    def add(self, other: Totals) -> None:
        self.calls += other.calls
        self.failures += other.failures
        self.latency_ms += other.latency_ms
        self.cpu_ms += other.cpu_ms
        self.cpu_calls += other.cpu_calls

    def to_dict(self) -> dict[str, Any]:
        per_call = self.latency_ms / self.calls if self.calls else 0.0
        cpu_per_call = self.cpu_ms / self.cpu_calls if self.cpu_calls else 0.0
        return {"calls": self.calls, "failures": self.failures,
                "latency_ms_per_call": round(per_call, 3), "cpu_ms_per_call": round(cpu_per_call, 3),
                "latency_ms": round(self.latency_ms, 3), "cpu_ms": round(self.cpu_ms, 3),
                "cpu_calls": self.cpu_calls, "cost_ms": round(cost_ms(self), 3)}


def cost_ms(t: Totals) -> float:
    """``(latency per call + CPU per call) x calls``, in milliseconds (0 without calls)."""
    if not t.calls:
        return 0.0
    cpu_per_call = t.cpu_ms / t.cpu_calls if t.cpu_calls else 0.0
    return (t.latency_ms / t.calls + cpu_per_call) * t.calls


@dataclass
class _Bucket:
    start: float
    by_feature: dict[str, Totals] = field(default_factory=dict)


class FeatureCost:
    """Per-feature calls, failures, wall and CPU time, since start and over the last ``window_s``.

    ``record(feature, now, latency_s, cpu_s, ok)`` once per stage call; ``snapshot(now)`` gives
    ``{feature: {<since start>, "window": {<last window_s>}}}`` (see `Totals.to_dict`).
    ``now`` is any monotonic clock in seconds (the pipeline's).
    """

    def __init__(self, window_s: float = 300.0, bucket_s: float = 10.0) -> None:
        if not (0 < bucket_s <= window_s < math.inf):
            raise ValueError(f"need 0 < bucket_s <= window_s < inf, got bucket_s={bucket_s!r}, window_s={window_s!r}")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.total: dict[str, Totals] = {}
        self._buckets: collections.deque[_Bucket] = collections.deque()

    def record(self, feature: str, now: float, latency_s: float, cpu_s: float | None = None,
               ok: bool = True) -> None:
        """One call of ``feature``: its wall time, the worker's CPU time (None: not reported),
        and whether it succeeded. Negative or non-finite times are taken as not measured."""
        one = Totals(calls=1, failures=0 if ok else 1)
        if math.isfinite(latency_s) and latency_s > 0:
            one.latency_ms = latency_s * 1000.0
        if cpu_s is not None and math.isfinite(cpu_s) and cpu_s >= 0:
            one.cpu_ms, one.cpu_calls = cpu_s * 1000.0, 1
        self.total.setdefault(feature, Totals()).add(one)
        self._bucket(now).by_feature.setdefault(feature, Totals()).add(one)

    def _bucket(self, now: float) -> _Bucket:
        start = math.floor(now / self.bucket_s) * self.bucket_s
        if not self._buckets or self._buckets[-1].start < start:
            self._buckets.append(_Bucket(start))
        bucket = self._buckets[-1]  # a clock that stepped back adds to the newest bucket
        self._trim(now)
        return bucket

    def _trim(self, now: float) -> None:
        # a bucket counts while any of it lies within the window (exact to one bucket)
        while self._buckets and self._buckets[0].start + self.bucket_s <= now - self.window_s:
            self._buckets.popleft()

    def window(self, now: float) -> dict[str, Totals]:
        self._trim(now)
        out: dict[str, Totals] = {}
        for bucket in self._buckets:
            for feature, t in bucket.by_feature.items():
                out.setdefault(feature, Totals()).add(t)
        return out

    def snapshot(self, now: float, features: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
        """Per feature (those recorded, and ``features`` even if never called): the since-start
        figures, and the same over the window under ``"window"``."""
        recent = self.window(now)
        names = list(dict.fromkeys([*features, *self.total]))
        return {f: {**self.total.get(f, Totals()).to_dict(), "window": recent.get(f, Totals()).to_dict()}
                for f in names}


def merge(costs: Mapping[str, Mapping[str, Any]], clock: Mapping[str, Mapping[str, Any]],
          bypassed: Mapping[str, Mapping[str, int]] | None = None) -> list[dict[str, Any]]:
    """One row per feature: ``costs`` (`FeatureCost.snapshot`, this replica), the policy actor's
    ``clock`` (`FeatureClock.snapshot`: off now and why, seconds off, times turned off by cause)
    and, if given, this replica's per-request ``bypassed`` counts by cause. Unranked."""
    rows = []
    for feature in dict.fromkeys([*clock, *costs]):
        c = costs.get(feature) or {}
        k = clock.get(feature) or {}
        since = {key: c.get(key, 0) for key in ("calls", "failures", "latency_ms_per_call", "cpu_ms_per_call",
                                                "cost_ms", "cpu_calls")}
        win = c.get("window") or {}
        turned = k.get("turned_off") or {}
        turned_w = k.get("turned_off_window") or {}
        rows.append({
            "feature": feature,
            "off": bool(k.get("off", False)),
            "cause": k.get("cause"),
            **since,
            "disabled_s": float(k.get("disabled_s", 0.0)),
            "turned_off": int(sum(turned.values())),
            "turned_off_by_cause": dict(turned),
            "window": {
                **{key: win.get(key, 0) for key in since},
                "disabled_s": float(k.get("disabled_s_window", 0.0)),
                "turned_off": int(sum(turned_w.values())),
                "turned_off_by_cause": dict(turned_w),
            },
            **({"bypassed": dict(bypassed.get(feature) or {})} if bypassed is not None else {}),
        })
    return rows


def _key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    w = row.get("window") or {}
    return (-float(w.get("cost_ms", 0.0)), -int(w.get("turned_off", 0)), -float(w.get("disabled_s", 0.0)),
            -float(row.get("cost_ms", 0.0)), -int(row.get("turned_off", 0)), -float(row.get("disabled_s", 0.0)),
            str(row.get("feature")))


def rank(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (`merge`) most expensive first, then most often off (see the module docstring),
    each with its 1-based ``rank``."""
    ordered = sorted((dict(r) for r in rows), key=_key)
    for i, row in enumerate(ordered, 1):
        row["rank"] = i
    return ordered
