"""The agent's own metrics (direct instrumentation), built from the catalogue.

`AgentMetrics` owns a fresh registry per agent, so tests never share state.  Values
read at scrape time come from exporter/collectors.py on the same registry.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from exporter import metric_handles
from exporter.catalogue import CATALOGUE
from exporter.metric_handles import MetricHandles
from exporter.metric_spec import MetricSpec

_TYPES = {"counter": Counter, "gauge": Gauge, "histogram": Histogram, "info": Info}


class AgentMetrics(MetricHandles):
    """Each metric is a typed attribute declared in the generated metric_handles.py;
    `get(name)` and `[name]` serve code that has the name as data."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics: dict[str, object] = {}
        for spec in CATALOGUE:
            if spec.source == "scrape":
                continue
            self._metrics[spec.name] = self._create(spec)
        if tuple(self._metrics) != metric_handles.NAMES:
            raise RuntimeError("exporter/metric_handles.py does not match the catalogue: run `python -m exporter.docs`")
        for name, metric in self._metrics.items():
            setattr(self, name, metric)

    def _create(self, spec: MetricSpec) -> Any:
        kwargs = dict(name=spec.family, documentation=spec.help, labelnames=spec.labels,
                      registry=self.registry)
        if spec.type == "histogram":
            kwargs["buckets"] = spec.buckets
        if spec.type == "info":
            kwargs.pop("labelnames")
        return _TYPES[spec.type](**kwargs)

    def get(self, name: str) -> Any:
        """The prometheus_client object for a catalogue name (e.g. "warmup_requests_total")."""
        return self._metrics[name]

    def __getitem__(self, name: str) -> Any:
        return self._metrics[name]
