"""Stats become metric updates in one place, exporter/recorder.py (issue 42): the
stages, the driver and readiness fill records, the Recorder writes the metrics."""
from __future__ import annotations

import ast
import glob
import os

from exporter import metric_handles
from exporter.metrics import AgentMetrics
from exporter.recorder import (
    BatchStats,
    CheckStats,
    GpuId,
    Recorder,
    SolidifyStats,
    TaxStats,
    ThresholdStats,
    WarmupStats,
    WindowStats,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Modules of a probe's road that write no metric of their own any more.
THROUGH_THE_RECORDER = sorted(glob.glob(os.path.join(ROOT, "warmup_agent", "stages", "*.py"))) + [
    os.path.join(ROOT, "warmup_agent", "driver.py")]
# readiness/runtime.py writes its breaker gauges and counters itself still; the
# gauges a probe's time to first token feeds are the recorder's.
PROBE_FED = {"warmup_first_token_window_seconds", "warmup_readiness_threshold_seconds",
             "warmup_readiness_threshold_refits_total", "warmup_first_user_request_tax_ratio",
             "warmup_first_user_request_total_tax_ratio"}


def handles_named(source: str, names: frozenset[str]) -> list[str]:
    """`line: name` of every attribute access to a metric handle (`x.warmup_state`)."""
    return sorted(f"{n.lineno}: {n.attr}" for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.Attribute) and n.attr in names)


def test_the_scan_sees_a_handle():
    names = frozenset(metric_handles.NAMES)
    assert handles_named("ctx.metrics.warmup_paths.labels(result='x').set(1)\nctx.recorder.warmup(s)\n",
                         names) == ["1: warmup_paths"]


def test_no_stage_and_not_the_driver_names_a_metric():
    names = frozenset(metric_handles.NAMES)
    found = []
    for path in THROUGH_THE_RECORDER:
        found += [f"{os.path.relpath(path, ROOT)}:{hit}" for hit in handles_named(open(path, encoding="utf-8").read(), names)]
    runtime = os.path.join(ROOT, "warmup_agent", "readiness", "runtime.py")
    found += [f"readiness/runtime.py:{hit}" for hit in handles_named(open(runtime, encoding="utf-8").read(), PROBE_FED)]
    assert found == []


def test_records_become_the_same_samples():
    m = AgentMetrics()
    r = Recorder(m)
    get = m.registry.get_sample_value
    r.batch(BatchStats("probe", 0.25, requests=2, first_token_seconds=0.1))
    r.batch(BatchStats("solidify", 1.5))
    assert get("warmup_requests_total", {"kind": "probe"}) == 2
    assert get("warmup_first_token_latency_seconds_count", {"kind": "probe"}) == 1
    assert get("warmup_engine_seconds_total", {"kind": "probe"}) == 0.25
    assert get("warmup_engine_seconds_total", {"kind": "solidify"}) == 1.5
    assert get("warmup_requests_total", {"kind": "solidify"}) is None      # a stage's own calls: no requests series
    r.first_token_window(WindowStats({0.5: 0.1, 0.9: 0.2}))
    r.decode_window(WindowStats({0.99: 0.01}))
    r.thresholds(ThresholdStats({"p50": 0.85}, refit=True))
    assert get("warmup_first_token_window_seconds", {"percentile": "p90"}) == 0.2
    assert get("warmup_time_per_output_token_window_seconds", {"percentile": "p99"}) == 0.01
    assert get("warmup_readiness_threshold_seconds", {"percentile": "p50"}) == 0.85
    assert get("warmup_readiness_threshold_refits_total") == 1
    r.first_request(TaxStats(1.5, None))
    r.first_user_request(TaxStats(None, None))
    assert get("warmup_first_request_tax_ratio") == 1.5 and get("warmup_first_request_total_tax_ratio") == 0
    assert get("warmup_first_user_request_tax_ratio") == 0
    gpu = GpuId(0, "GPU-x")
    r.solidify(SolidifyStats(fallback_reason="oom: out of memory", gpu=gpu, cuda_graphs=3))
    assert get("warmup_solidify_fallbacks_total", {"reason": "oom"}) == 1
    assert get("warmup_cuda_graphs", {"gpu": "0", "uuid": "GPU-x"}) == 3
    r.warmup(WarmupStats(per_length_ratios=[2.0, 1.6], paths={"converged": 4}))
    assert get("warmup_per_length_decode_ratio") == 1.6 and get("warmup_paths", {"result": "converged"}) == 4
    r.check(CheckStats("numerics", "passed"))
    assert get("warmup_validation_checks_total", {"check": "numerics", "result": "passed"}) == 1
