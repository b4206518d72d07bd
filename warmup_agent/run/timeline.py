"""One stage of the run on the run's clock; its own module so the tracer imports neither record nor stages."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StageTiming:
    name: str
    phase: int
    start: float                 # seconds since the clock origin (process start from the CLI)
    end: float | None = None
    status: str = "running"      # running | ok | failed
    detail: dict = field(default_factory=dict)

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start
