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
#: The proxy's two metrics are written where the proxy runs (its own process or thread,
#: proxy/routing.py) and replayed from its reports (proxy/process.py); nothing else
#: writes a metric outside the recorder.
OWN_WRITERS = ("exporter/recorder.py", "warmup_agent/proxy/")


def metric_writers() -> list[str]:
    """Every file of warmup_agent/ and exporter/ that may not name a metric handle."""
    out = []
    for pkg in ("warmup_agent", "exporter"):
        for path in sorted(glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True)):
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if not rel.startswith(OWN_WRITERS):
                out.append(rel)
    return out


def handles_named(source: str, names: frozenset[str]) -> list[str]:
    """`line: name` of every attribute access to a metric handle (`x.warmup_state`)."""
    return sorted(f"{n.lineno}: {n.attr}" for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.Attribute) and n.attr in names)


def test_the_scan_sees_a_handle():
    names = frozenset(metric_handles.NAMES)
    assert handles_named("ctx.metrics.warmup_paths.labels(result='x').set(1)\nctx.recorder.warmup(s)\n",
                         names) == ["1: warmup_paths"]


def test_only_the_recorder_names_a_metric():
    names = frozenset(metric_handles.NAMES)
    found = []
    for rel in metric_writers():
        found += [f"{rel}:{hit}" for hit in handles_named(open(os.path.join(ROOT, rel), encoding="utf-8").read(), names)]
    assert found == []


def test_the_fence_covers_the_agent():
    writers = metric_writers()
    for rel in ("warmup_agent/pipeline.py", "warmup_agent/states.py", "warmup_agent/readiness/runtime.py",
                "warmup_agent/kernel_cache/cache.py", "warmup_agent/cli.py", "exporter/server.py"):
        assert rel in writers
    assert not any(w.startswith("warmup_agent/proxy/") or w == "exporter/recorder.py" for w in writers)


def test_no_metric_is_read_back_as_state():
    """Program state lives in the program (the driver counts its own engine-seconds);
    the recorder only writes, and nothing outside the exporter reads the registry."""
    def reads(rel: str, attrs: tuple[str, ...]) -> list[str]:
        src = open(os.path.join(ROOT, rel), encoding="utf-8").read()
        return [f"{rel}:{n.lineno}" for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Attribute) and n.attr in attrs]
    found = reads("exporter/recorder.py", ("collect", "get_sample_value", "_value", "samples"))
    for rel in metric_writers():
        if rel.startswith("warmup_agent/"):
            found += reads(rel, ("get_sample_value",))
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


def test_state_breaker_and_cache_records_become_samples():
    from exporter.recorder import (
        BreakerStats,
        CacheStats,
        FailureStats,
        Known,
        ProbeFailureStats,
        ServingStats,
        StageStats,
        StateStats,
    )
    m = AgentMetrics()
    r = Recorder(m)
    get = m.registry.get_sample_value
    r.declare_series(Known(states=("INIT", "PRELOAD"), initial_state="INIT", failure_reasons=("oom",),
                           illegal_transitions=[("INIT", "SERVING")], trip_causes=("slow",),
                           probe_failure_causes=("timeout",), kernel_cache=True))
    assert get("warmup_state", {"state": "INIT"}) == 1 and get("warmup_state", {"state": "PRELOAD"}) == 0
    assert get("model_loading_failures_total", {"reason": "oom"}) == 0
    assert get("warmup_illegal_transitions_total", {"from": "INIT", "to": "SERVING"}) == 0
    assert get("warmup_kernel_cache_requests_total", {"tier": "shared", "result": "rejected"}) == 0
    r.state(StateStats("PRELOAD", before="INIT"))
    r.state(StateStats("PRELOAD", rejected="INIT"))
    r.state(StateStats("PRELOAD", deadline_exceeded=True))
    r.failure(FailureStats("oom"))
    assert get("warmup_state", {"state": "INIT"}) == 0 and get("warmup_state", {"state": "PRELOAD"}) == 1
    assert get("warmup_state_transitions_total", {"from": "INIT", "to": "PRELOAD"}) == 1
    assert get("warmup_illegal_transitions_total", {"from": "PRELOAD", "to": "INIT"}) == 1
    assert get("warmup_state_deadline_exceeded_total", {"state": "PRELOAD"}) == 1
    assert get("model_loading_failures_total", {"reason": "oom"}) == 1
    states = ("closed", "open", "half_open")
    r.breaker(BreakerStats("open", states, True, before="closed", trip="slow"))
    r.probe_failure(ProbeFailureStats("timeout"))
    assert get("warmup_breaker_trips_total", {"reason": "slow"}) == 1
    assert get("warmup_breaker_transitions_total", {"from": "closed", "to": "open"}) == 1
    assert [get("warmup_breaker_state", {"state": s}) for s in states] == [0, 1, 0]
    assert get("warmup_fallback_active") == 1 and get("warmup_watch_probe_failures_total", {"reason": "timeout"}) == 1
    r.breaker(BreakerStats("closed", states, False))      # a reset: no transition counted
    assert [get("warmup_breaker_state", {"state": s}) for s in states] == [1, 0, 0]
    assert get("warmup_breaker_transitions_total", {"from": "open", "to": "closed"}) is None
    r.stage(StageStats("reserve", 0.5))
    r.serving(ServingStats(2.5))
    assert get("model_loading_phase_duration_seconds", {"phase": "reserve"}) == 0.5
    assert get("warmup_stage_duration_seconds_sum", {"stage": "reserve"}) == 0.5
    assert get("warmup_time_to_ready_seconds") == 2.5
    r.cache(CacheStats(lookups={("local", "hit"): 3}, published=2, evicted_local=1, bytes_by_tier={"local": 10},
                       degraded=True, lock_wait_seconds=0.25))
    assert get("warmup_kernel_cache_requests_total", {"tier": "local", "result": "hit"}) == 3
    assert get("warmup_kernel_cache_publishes_total") == 2
    assert get("warmup_kernel_cache_evictions_total", {"tier": "local"}) == 1
    assert get("warmup_kernel_cache_bytes", {"tier": "local"}) == 10 and get("warmup_kernel_cache_degraded") == 1
    assert get("warmup_kernel_cache_lock_wait_seconds_sum") == 0.25
