"""Dual readiness thresholds on time to first token, optionally adaptive.

Ready means P50 and P90 at or under their thresholds over at least `min_samples`.
Adaptive mode re-fits both every `every` samples to margin x the observed quantile,
clamped to [floor, configured]: it only tightens the gate towards what this pod has
shown, so a regression is caught before it reaches the SLO.
"""
from __future__ import annotations

import threading
from typing import Any


class Thresholds:
    def __init__(self, p50: float, p90: float, min_samples: int = 1, adaptive: bool = False,
                 every: int = 50, margin: float = 1.5, floor: float = 0.01):
        if p50 > p90:
            raise ValueError("p50 threshold must not exceed p90 threshold")
        self.ceiling = {0.5: p50, 0.9: p90}
        self.current = dict(self.ceiling)
        self.min_samples, self.adaptive = min_samples, adaptive
        self.every, self.margin, self.floor = every, margin, floor
        self.refits = 0
        self._since_refit = 0
        self._lock = threading.Lock()

    @property
    def p50(self) -> float:
        return self.current[0.5]

    @property
    def p90(self) -> float:
        return self.current[0.9]

    def tail_ok(self, p90: float) -> bool:
        """The tail test the gate and the breaker share."""
        return p90 <= self.p90

    def sample_added(self, window: Any) -> bool:
        """Count one sample and re-fit if due; returns whether it re-fitted."""
        if not self.adaptive:
            return False
        with self._lock:
            self._since_refit += 1
            if self._since_refit < self.every or len(window) < self.min_samples:
                return False
            self._since_refit = 0
            q = window.quantiles((0.5, 0.9))
            for p in (0.5, 0.9):
                self.current[p] = min(self.ceiling[p], max(self.floor, self.margin * q[p]))
            # Keep the pair ordered even if the floor lifted P50 above a tight P90.
            self.current[0.5] = min(self.current[0.5], self.current[0.9])
            self.refits += 1
            return True
