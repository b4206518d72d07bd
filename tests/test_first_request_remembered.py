"""The exported first-request figures say whether this start measured them or remembered
them from an earlier start's measurement of the server (issue 72: never a remembered
figure exported as if measured now)."""
from __future__ import annotations

from types import SimpleNamespace

from exporter.metrics import AgentMetrics
from exporter.recorder import Recorder
from warmup_agent.readiness.probes import ProbeLog
from warmup_agent.stages.ready import freeze_first_request
from warmup_agent.warmup.benefit import Call


def _frozen(remembered: dict | None) -> AgentMetrics:
    metrics = AgentMetrics()
    log = ProbeLog()
    for ttft in (0.030, 0.010, 0.011, 0.012):   # the first probe, then steady ones
        log.add(Call(ttft, ttft + 0.05, 4, 16))
    if remembered is not None:
        log.remembered_new_length(remembered)
    ctx = SimpleNamespace(probe_log=log, recorder=Recorder(metrics), warmup_summary={}, profile=None, probe_length=None)
    freeze_first_request(ctx)    # type: ignore[arg-type]
    return metrics


def _value(metrics: AgentMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


def test_a_measured_first_probe_reads_measured():
    m = _frozen(None)
    assert _value(m, "warmup_first_request_tax_ratio") == 0.030 / 0.011
    assert _value(m, "warmup_first_request_tax_remembered") == 0


def test_a_remembered_excess_reads_remembered():
    m = _frozen({"ttft": 0.25, "total": 0.5, "measured_at": "2026-12-07T10:00:00+00:00"})
    assert _value(m, "warmup_first_request_tax_ratio") == 1.25
    assert _value(m, "warmup_first_request_total_tax_ratio") == 1.5
    assert _value(m, "warmup_first_request_tax_remembered") == 1
