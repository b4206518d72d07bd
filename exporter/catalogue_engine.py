"""Metrics read from the engine's own /metrics at scrape time (exporter/engine_metrics.py).

Present only with the openai engine; each server kind's names are in warmup_agent/server/kinds.py,
and a figure its server does not export is absent, never 0.  `warmup_engine_up`: the last read worked.
"""
from exporter.metric_spec import MetricSpec

SPECS = (
    MetricSpec("warmup_engine_up", "gauge",
               "1 when the engine's /metrics answered at this scrape, else 0.",
               unit="short", source="scrape", requires="engine_metrics"),
    MetricSpec("warmup_engine_requests_running", "gauge",
               "Requests the engine is running now (its kind's running_metric in warmup_agent/server/kinds.py, "
               "e.g. vllm:num_requests_running, llamacpp:requests_processing).",
               unit="short", source="scrape", requires="engine_metrics"),
    MetricSpec("warmup_engine_requests_waiting", "gauge",
               "Requests queued in the engine (its kind's waiting_metric in warmup_agent/server/kinds.py, "
               "e.g. vllm:num_requests_waiting, llamacpp:requests_deferred).",
               unit="short", source="scrape", requires="engine_metrics"),
    MetricSpec("warmup_engine_kv_cache_usage_ratio", "gauge",
               "Fraction of the engine's KV cache in use, 0..1 (its kind's kv_use_metrics in "
               "warmup_agent/server/kinds.py, e.g. vllm:kv_cache_usage_perc).",
               unit="percentunit", source="scrape", requires="engine_metrics"),
    MetricSpec("warmup_engine_kv_cache_blocks", "gauge",
               "KV cache blocks the engine allocated (vllm:cache_config_info num_gpu_blocks).",
               unit="short", source="scrape", requires="engine_metrics"),
    MetricSpec("warmup_engine_kv_cache_memory_bytes", "gauge",
               "KV cache size handed to the engine, in bytes (vllm:cache_config_info kv_cache_memory_bytes).",
               unit="bytes", source="scrape", requires="engine_metrics"),
    MetricSpec("warmup_engine_requests_finished_total", "counter",
               "Requests the engine finished, agent traffic included (vllm:request_success_total over all reasons).",
               unit="short", source="scrape", requires="engine_metrics"),
)
