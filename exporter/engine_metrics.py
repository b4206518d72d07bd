"""The engine's own /metrics, read at scrape time.

A model server already measures its queue, KV cache and latencies, so the collector
re-exports the few numbers the agent needs as `warmup_engine_*`, under the names the
agent passes from its table (warmup_agent/server/kinds.py).  An engine that does not answer yields `warmup_engine_up 0` and never blanks the rest
of the scrape.
"""
from __future__ import annotations

import urllib.request
from dataclasses import asdict, astuple, dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from exporter.catalogue import spec


@dataclass
class EngineStats:
    """Engine facts from one /metrics read.  None: the engine does not export it."""
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage_ratio: float | None = None      # 0..1
    kv_cache_blocks: int | None = None             # KV blocks allocated (vLLM num_gpu_blocks)
    kv_block_size: int | None = None               # tokens per block
    kv_cache_memory_bytes: int | None = None
    requests_finished: float | None = None         # all finish reasons
    first_token_seconds_sum: float | None = None
    first_token_seconds_count: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EngineMetricNames:
    """Which of a server's series give each EngineStats figure: summed, but `kv_use` (0..1) its
    largest; `kv_info` an info gauge with vLLM's labels; `first_token` histograms (_sum, _count)."""
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_use: tuple[str, ...] = ()
    kv_info: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    first_token: tuple[str, ...] = ()

    def __add__(self, other: EngineMetricNames) -> EngineMetricNames:
        return EngineMetricNames(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def roles(self) -> dict[str, str]:
        """Sample name -> the EngineStats field it gives."""
        roles = {n: "requests_running" for n in self.running}
        roles.update({n: "requests_waiting" for n in self.waiting})
        roles.update({n: "kv_cache_usage_ratio" for n in self.kv_use})
        roles.update({n: "kv_info" for n in self.kv_info})
        roles.update({n: "requests_finished" for n in self.finished})
        roles.update({n + "_sum": "first_token_seconds_sum" for n in self.first_token})
        roles.update({n + "_count": "first_token_seconds_count" for n in self.first_token})
        return roles


def _int(v: Any) -> int | None:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return None


def parse_engine_metrics(text: str, names: EngineMetricNames) -> EngineStats:
    """EngineStats from a server's exposition, read through `names` (values summed over engines/models)."""
    s = EngineStats()
    roles = names.roles()

    def add(attr: str, value: float) -> None:
        setattr(s, attr, (getattr(s, attr) or 0.0) + value)

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            role = roles.get(sample.name)
            if role is None:
                continue
            if role == "kv_cache_usage_ratio":
                s.kv_cache_usage_ratio = max(s.kv_cache_usage_ratio or 0.0, sample.value)
            elif role == "kv_info":
                s.kv_cache_blocks = _int(sample.labels.get("num_gpu_blocks"))
                s.kv_block_size = _int(sample.labels.get("block_size"))
                s.kv_cache_memory_bytes = _int(sample.labels.get("kv_cache_memory_bytes"))
            else:
                add(role, sample.value)
    return s


def fetch_engine_stats(url: str, names: EngineMetricNames, timeout: float = 2.0) -> EngineStats:
    """GET the engine's /metrics and parse it.  Raises OSError/ValueError on failure."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_engine_metrics(r.read().decode("utf-8", "replace"), names)


class EngineMetricsCollector:
    """`url` may be a callable returning the current URL (None: no engine yet).  `names`
    say which series to read; `fetch(url, timeout)` replaces the read."""

    def __init__(self, url: Any, names: EngineMetricNames = EngineMetricNames(), timeout: float = 2.0,
                 fetch: Any = None) -> None:
        self._url = url
        self._names = names
        self._timeout = timeout
        self._fetch = fetch or self._read

    def _read(self, url: str, timeout: float) -> EngineStats:
        return fetch_engine_stats(url, self._names, timeout)

    def describe(self) -> Any:
        return []  # collected lazily: never hit the engine at registration time

    def collect(self) -> Any:
        url = self._url() if callable(self._url) else self._url
        if not url:
            return
        up = GaugeMetricFamily("warmup_engine_up", spec("warmup_engine_up").help)
        try:
            stats = self._fetch(url, self._timeout)
        except Exception:  # noqa: BLE001 - an engine that is down or restarting
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        gauges = (("warmup_engine_requests_running", stats.requests_running),
                  ("warmup_engine_requests_waiting", stats.requests_waiting),
                  ("warmup_engine_kv_cache_usage_ratio", stats.kv_cache_usage_ratio),
                  ("warmup_engine_kv_cache_blocks", stats.kv_cache_blocks),
                  ("warmup_engine_kv_cache_memory_bytes", stats.kv_cache_memory_bytes))
        for name, value in gauges:
            if value is not None:
                g = GaugeMetricFamily(name, spec(name).help)
                g.add_metric([], float(value))
                yield g
        if stats.requests_finished is not None:
            c = CounterMetricFamily("warmup_engine_requests_finished", spec("warmup_engine_requests_finished_total").help)
            c.add_metric([], stats.requests_finished)
            yield c
