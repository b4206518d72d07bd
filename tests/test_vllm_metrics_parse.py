"""exporter/engine_metrics.py on a recorded vLLM 0.32 exposition (CPU build), read
through vLLM's names in server/kinds.py.

The live path is covered in test_openai_engine.py; this pins the parsing of
each field and the collector's behaviour on a bad or missing engine.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from exporter.engine_metrics import EngineMetricsCollector, EngineStats, parse_engine_metrics
from warmup_agent.server.kinds import BY_NAME
from warmup_agent.server.signals import engine_metric_names

VLLM = engine_metric_names(BY_NAME["vllm"])

# Recorded from `vllm.entrypoints.launchers.api_server.entry` serving the embedded
# model with --kv-cache-memory-bytes 67108864 after 3 requests (trimmed).
RECORDED = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.125
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.1
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",kv_cache_memory_bytes="67108864",num_cpu_blocks="None",num_gpu_blocks="256"} 1.0
"""


def test_parses_every_field():
    s = parse_engine_metrics(RECORDED, VLLM)
    assert s == EngineStats(requests_running=1.0, requests_waiting=2.0, kv_cache_usage_ratio=0.125,
                            kv_cache_blocks=256, kv_block_size=128, kv_cache_memory_bytes=67108864,
                            requests_finished=4.0, first_token_seconds_sum=0.1, first_token_seconds_count=4.0)


def test_missing_fields_stay_none():
    s = parse_engine_metrics("# TYPE other gauge\nother 1\n", VLLM)
    assert s == EngineStats()


def test_collector_exports_at_scrape_time():
    calls = []

    def fetch(url, timeout):
        calls.append(url)
        return parse_engine_metrics(RECORDED, VLLM)

    reg = CollectorRegistry()
    reg.register(EngineMetricsCollector("http://engine/metrics", fetch=fetch))
    assert calls == []                              # nothing read at registration
    assert reg.get_sample_value("warmup_engine_up") == 1.0
    assert reg.get_sample_value("warmup_engine_requests_waiting") == 2.0
    assert reg.get_sample_value("warmup_engine_kv_cache_usage_ratio") == 0.125
    assert reg.get_sample_value("warmup_engine_kv_cache_blocks") == 256
    assert reg.get_sample_value("warmup_engine_requests_finished_total") == 4.0
    assert len(calls) == 5                          # one engine read per scrape


def test_garbage_or_no_engine_is_up_zero_and_nothing_else():
    def bad(url, timeout):
        return parse_engine_metrics("this is { not an exposition", VLLM)

    reg = CollectorRegistry()
    reg.register(EngineMetricsCollector("http://engine/metrics", fetch=bad))
    assert reg.get_sample_value("warmup_engine_up") == 0.0
    assert reg.get_sample_value("warmup_engine_requests_running") is None

    none = CollectorRegistry()
    none.register(EngineMetricsCollector(lambda: None))   # no engine URL yet: no series at all
    assert none.get_sample_value("warmup_engine_up") is None
