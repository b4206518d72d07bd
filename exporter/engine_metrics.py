"""The engine's own /metrics, read at scrape time.

vLLM already measures its queue, KV cache and latencies, so the collector re-exports
the few numbers the agent needs as `warmup_engine_*`.  An engine that does not
answer yields `warmup_engine_up 0` and never blanks the rest of the scrape.
"""
from __future__ import annotations

import urllib.request
from dataclasses import asdict, dataclass
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


def _int(v: Any) -> int | None:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return None


def parse_engine_metrics(text: str) -> EngineStats:
    """EngineStats from a vLLM exposition (values summed over engines/models)."""
    s = EngineStats()

    def add(attr: str, value: float) -> None:
        setattr(s, attr, (getattr(s, attr) or 0.0) + value)

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "vllm:num_requests_running":
                add("requests_running", value)
            elif name == "vllm:num_requests_waiting":
                add("requests_waiting", value)
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                # vLLM calls it "perc" but exports a 0..1 fraction.
                s.kv_cache_usage_ratio = max(s.kv_cache_usage_ratio or 0.0, value)
            elif name == "vllm:cache_config_info":
                s.kv_cache_blocks = _int(labels.get("num_gpu_blocks"))
                s.kv_block_size = _int(labels.get("block_size"))
                s.kv_cache_memory_bytes = _int(labels.get("kv_cache_memory_bytes"))
            elif name == "vllm:request_success_total":
                add("requests_finished", value)
            elif name == "vllm:time_to_first_token_seconds_sum":
                add("first_token_seconds_sum", value)
            elif name == "vllm:time_to_first_token_seconds_count":
                add("first_token_seconds_count", value)
    return s


def fetch_engine_stats(url: str, timeout: float = 2.0) -> EngineStats:
    """GET the engine's /metrics and parse it.  Raises OSError/ValueError on failure."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_engine_metrics(r.read().decode("utf-8", "replace"))


class EngineMetricsCollector:
    """`url` may be a callable returning the current URL (None: no engine yet)."""

    def __init__(self, url: Any, timeout: float = 2.0, fetch: Any = fetch_engine_stats) -> None:
        self._url = url
        self._timeout = timeout
        self._fetch = fetch

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
