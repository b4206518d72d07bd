"""Sliding window of time-to-first-token samples with exact quantiles.

Exact (nearest-rank) quantiles over the last N samples: no sketch error.  N is
bounded (readiness.window_size, default 100), so memory is constant and a
quantile costs one sort of at most N floats.
"""
from __future__ import annotations

import math
import threading
from collections import deque


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least q of the samples at or
    below it.  Same definition numpy calls method="inverted_cdf"."""
    if not sorted_values:
        raise ValueError("no samples")
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


class SlidingWindow:
    def __init__(self, size: int):
        if size <= 0:
            raise ValueError("window size must be > 0")
        self._samples: deque[float] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(seconds)

    def __len__(self) -> int:
        return len(self._samples)

    def values(self) -> list[float]:
        with self._lock:
            return list(self._samples)

    def quantile(self, q: float) -> float | None:
        vals = sorted(self.values())
        return nearest_rank(vals, q) if vals else None

    def quantiles(self, qs=(0.5, 0.9, 0.99)) -> dict[float, float]:
        vals = sorted(self.values())
        return {q: nearest_rank(vals, q) for q in qs} if vals else {}
