"""Sliding window of time-to-first-token samples with exact quantiles.

Exact (nearest-rank) quantiles over the last N samples: no sketch error (the
stated error bound is 0).  N is bounded (readiness.window_size, default 100),
so memory is constant and a quantile costs one sort of at most N floats.

Optionally the window is also bounded in time (`max_age_seconds`,
readiness.window_seconds): samples older than that are dropped before every
read, so "the last N probes or the last T seconds", whichever is fewer.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least q of the samples at or
    below it.  Same definition numpy calls method="inverted_cdf"."""
    if not sorted_values:
        raise ValueError("no samples")
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


class SlidingWindow:
    def __init__(self, size: int, max_age_seconds: float = 0.0, clock: Any = time.monotonic) -> None:
        if size <= 0:
            raise ValueError("window size must be > 0")
        if max_age_seconds < 0:
            raise ValueError("max_age_seconds must be >= 0")
        # (timestamp, seconds) pairs; the timestamp only matters with a max age.
        self._samples: deque[tuple[float, float]] = deque(maxlen=size)
        self._max_age = max_age_seconds
        self._clock = clock
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self._samples.append((self._clock(), seconds))

    def clear(self) -> None:
        with self._lock:
            self._samples.clear()

    def _expire(self) -> None:
        if self._max_age:
            oldest = self._clock() - self._max_age
            while self._samples and self._samples[0][0] < oldest:
                self._samples.popleft()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._samples)

    def values(self) -> list[float]:
        with self._lock:
            self._expire()
            return [v for _, v in self._samples]

    def quantile(self, q: float) -> float | None:
        vals = sorted(self.values())
        return nearest_rank(vals, q) if vals else None

    def quantiles(self, qs: Any = (0.5, 0.9, 0.99)) -> dict[float, float]:
        vals = sorted(self.values())
        return {q: nearest_rank(vals, q) for q in qs} if vals else {}
