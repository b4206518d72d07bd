"""GPU-utilisation ramp during warmup: the least-squares slope of NVML utilisation (0..1) over time, in 1/s."""
from __future__ import annotations

import time
from typing import Any

from warmup_agent.periodic import Periodic


def least_squares_slope(samples: list[tuple[float, float]]) -> float | None:
    """Slope of y over t; None with fewer than two distinct times."""
    n = len(samples)
    if n < 2:
        return None
    mt = sum(t for t, _ in samples) / n
    my = sum(y for _, y in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return sum((t - mt) * (y - my) for t, y in samples) / var


class RampSampler:
    def __init__(self, nvml: Any, handle: Any, interval: float = 0.05, clock: Any = time.perf_counter) -> None:
        self._nvml, self._handle, self.interval, self._clock = nvml, handle, interval, clock
        self.samples: list[tuple[float, float]] = []
        self._loop = Periodic(interval, self.sample, name="gpu-ramp-sampler")
        self.errors = 0

    @classmethod
    def for_gpu(cls, uuid: str, interval: float) -> "RampSampler | None":
        """A sampler for the GPU with this UUID; None where NVML is unavailable."""
        try:
            import pynvml
            pynvml.nvmlInit()
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid), interval)
        except Exception:  # noqa: BLE001 - no NVML: no ramp, the warmup goes on
            return None

    def sample(self) -> None:
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0
        except Exception:  # noqa: BLE001 - one failed read is skipped, not fatal
            self.errors += 1
            return
        self.samples.append((self._clock(), util))

    def start(self) -> "RampSampler":
        self.sample()
        self._loop.start()
        return self

    def stop(self) -> float | None:
        """Stop sampling; return the slope in 1/s over what was sampled."""
        self._loop.stop(timeout=2)
        return least_squares_slope(list(self.samples))
