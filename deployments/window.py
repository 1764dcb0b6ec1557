"""A sliding time window of samples with percentiles; pure, with the clock injected."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["SlidingWindow", "percentile"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, linear between closest ranks.

    Same rule as ``numpy.percentile``'s default ("linear"); ``None`` for no values. The one
    percentile of the project: replicas' windows, the benchmark's reports and the tests use it.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q={q} must be within [0, 100]")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class SlidingWindow:
    """Keeps the samples added in the last ``window_s`` seconds, at most ``max_samples`` of them.

    Time comes from ``clock`` (seconds, monotonic), read on ``add`` and on every query, so a
    sample counts until ``window_s`` has passed since it was added. When more than
    ``max_samples`` samples are inside the window the oldest are dropped first, which bounds
    memory and the cost of a percentile (a sort of at most ``max_samples`` values).
    Queries on an empty window return ``None``. Not thread-safe: use from one event loop.
    """

    def __init__(
        self, clock: Callable[[], float], window_s: float = 30.0, max_samples: int = 2048
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s={window_s} must be > 0")
        if max_samples < 1:
            raise ValueError(f"max_samples={max_samples} must be >= 1")
        self._clock = clock
        self.window_s = window_s
        self.max_samples = max_samples
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value: float) -> None:
        """Record ``value`` at the clock's current time."""
        now = self._clock()
        self._evict(now)
        self._samples.append((now, value))

    def values(self) -> list[float]:
        """The samples inside the window, oldest first."""
        self._evict(self._clock())
        return [value for _, value in self._samples]

    def __len__(self) -> int:
        self._evict(self._clock())
        return len(self._samples)

    def mean(self) -> float | None:
        """Arithmetic mean of the samples in the window, or ``None`` if it is empty."""
        values = self.values()
        return sum(values) / len(values) if values else None

    def percentile(self, q: float) -> float | None:
        """`percentile` of the samples in the window; ``None`` if it is empty."""
        return percentile(self.values(), q)

    def _evict(self, now: float) -> None:
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] <= horizon:
            self._samples.popleft()
