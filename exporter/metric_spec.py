"""What a catalogue entry is: `MetricSpec`, and the histogram buckets entries share.

The ground floor of the metric catalogue: exporter/catalogue.py and every
exporter/catalogue_<feature>.py import from here, and it imports nothing of
theirs, so the catalogue's modules form no import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass

# Buckets for first-token latency: 5 ms .. 30 s.  The readiness thresholds of the
# seed (0.85 s and 2.1 s) and the SOTA line (0.38 s) fall on bucket edges so that
# `histogram_quantile` and alert expressions compare against exact edges.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.38, 0.5, 0.85, 1.0,
                       2.1, 2.5, 5.0, 10.0, 30.0)
# Buckets for stage durations: 10 ms .. 30 min (a 70B model loads for minutes).
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
