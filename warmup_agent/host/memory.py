"""Resident-memory jitter of the agent process: (max - min) / mean RSS over a sliding window."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import psutil

from warmup_agent.periodic import Periodic


def jitter_ratio(samples: list[int]) -> float:
    if not samples:
        return 0.0
    mean = sum(samples) / len(samples)
    return (max(samples) - min(samples)) / mean if mean else 0.0


class MemorySampler:
    def __init__(self, interval: float = 0.1, window: float = 60.0, clock: Any = time.monotonic) -> None:
        self.interval, self.window, self._clock = interval, window, clock
        self._samples: deque[tuple[float, int]] = deque()
        self._proc = psutil.Process()
        self._lock = threading.Lock()
        self._loop = Periodic(interval, self.sample, name="memory-sampler")

    def sample(self) -> int:
        rss = self._proc.memory_info().rss
        now = self._clock()
        with self._lock:
            self._samples.append((now, rss))
            while self._samples and self._samples[0][0] < now - self.window:
                self._samples.popleft()
        return rss

    def samples(self) -> list[int]:
        with self._lock:
            return [rss for _, rss in self._samples]

    def ratio(self) -> float:
        return jitter_ratio(self.samples())

    def start(self) -> None:
        self.sample()
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(timeout=1)
