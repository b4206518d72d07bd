"""What a catalogue entry is: `MetricSpec`, and the histogram buckets entries share.

It imports nothing of the catalogue's modules, so they form no import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass

# Seconds.  The readiness thresholds (0.38, 0.85, 2.1) are bucket edges, so alert
# expressions compare against exact edges.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.38, 0.5, 0.85, 1.0,
                       2.1, 2.5, 5.0, 10.0, 30.0)
# Seconds; a large model loads for minutes.
STAGE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                 300.0, 600.0, 1800.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str            # full exposition name (counters include _total)
    type: str            # gauge | counter | histogram | info
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    unit: str = ""       # Grafana unit for dashboards ("s", "bytes", "percentunit", "short")
    source: str = "agent"
    requires: str | None = None
    doc: str = ""        # longer explanation for docs/metrics.md
    seed_name: bool = False  # name kept verbatim from the seed articles

    @property
    def family(self) -> str:
        """Name as prometheus_client registers it (without _total / _info)."""
        if self.type == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        if self.type == "info" and self.name.endswith("_info"):
            return self.name[: -len("_info")]
        return self.name
