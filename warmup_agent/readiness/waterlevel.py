"""Water-level signal: an adaptive capacity threshold from QPS.

    T_k = alpha * T_(k-1) + (1 - alpha) * (Q_k * headroom)

sampled every `period` seconds, Q_k being the mean requests per second over the
last `window` seconds.  An autoscaler compares live QPS with T (docs/readiness.md).

One counter per second of the window, in a ring.  The value advances lazily, on
every request and read; since every arrival advances first, the ring still holds
the counts each missed boundary needs.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any


class WaterLevel:
    def __init__(self, alpha: float = 0.85, window_seconds: int = 60, period_seconds: float = 5.0,
                 headroom: float = 1.2, clock: Any = time.monotonic) -> None:
        if not 0 <= alpha < 1:
            raise ValueError("alpha must be in [0, 1)")
        self.alpha, self.window, self.period, self.headroom = alpha, int(window_seconds), period_seconds, headroom
        self.clock = clock
        self._counts = [0] * self.window      # requests in second s, at index s % window
        self._second = [None] * self.window   # which second each slot holds
        self._start = clock()
        self._boundaries = 0                  # period boundaries applied so far
        self._last_second = -10**9            # second of the latest request
        self.value = 0.0                      # T, requests per second
        self.last_qps = 0.0                   # Q at the latest boundary
        self._lock = threading.Lock()

    def _qps_at(self, t: float) -> float:
        """Mean requests/s over the `window` whole seconds ending at t."""
        end = math.floor(t - self._start)
        n = 0
        for s in range(end - self.window, end):
            i = s % self.window
            if self._second[i] == s:
                n += self._counts[i]
        return n / self.window

    def _advance(self, now: float) -> None:
        due = int((now - self._start) // self.period)
        while self._boundaries < due:
            t = self._start + (self._boundaries + 1) * self.period
            if t - self._start >= self._last_second + 1 + self.window:
                # Idle past a whole window: Q = 0 from here, so decay in closed form.
                steps = due - self._boundaries
                self.value *= self.alpha ** steps
                self.last_qps = 0.0
                self._boundaries = due
                break
            self._boundaries += 1
            q = self._qps_at(t)
            self.last_qps = q
            self.value = self.alpha * self.value + (1 - self.alpha) * q * self.headroom

    def request(self) -> None:
        """Count one user request now."""
        with self._lock:
            now = self.clock()
            self._advance(now)
            s = math.floor(now - self._start)
            i = s % self.window
            if self._second[i] != s:
                self._second[i], self._counts[i] = s, 0
            self._counts[i] += 1
            self._last_second = s

    def read(self) -> float:
        """T now (advancing through any period boundaries passed)."""
        with self._lock:
            self._advance(self.clock())
            return self.value
