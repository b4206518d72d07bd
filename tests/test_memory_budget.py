"""Memory budget for prewarm: the grid backs off (largest batch sizes first)
instead of failing.  The runtime back-off is tested under a real address-space
limit in a child process, where allocations really fail."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from warmup_agent.warmup import memory_budget
from warmup_agent.warmup.memory_budget import BackOff, BudgetExceeded, plan


def test_plan_drops_the_largest_batches_that_exceed_the_budget():
    # 1 KiB per sequence-token at 128 tokens: batch b costs b x 128 KiB.
    p = plan([4, 1, 8, 2, 16], max_length=128, bytes_per_token=1024, budget_bytes=5 * 128 * 1024)
    assert p.batches == [1, 2, 4] and p.dropped == [8, 16]
    assert p.estimate_bytes[8] == 8 * 128 * 1024


def test_plan_without_budget_keeps_everything_and_edge_fits():
    assert plan([1, 2, 4], 64, 1e9, 0).batches == [1, 2, 4]
    assert plan([1, 2, 4], 10, 100, 4000).batches == [1, 2, 4]     # exactly at the budget fits
    assert plan([1, 2, 4], 10, 100, 3999).batches == [1, 2]


def test_plan_fails_with_a_named_reason_when_nothing_fits():
    with pytest.raises(BudgetExceeded) as e:
        plan([2, 4], 100, 1000, 1000)
    assert e.value.reason == "prewarm_memory_budget_exceeded"
    assert "prewarm.memory_budget_bytes" in str(e.value) and "200000" in str(e.value) and "\n" not in str(e.value)


def test_measure_peak_rss_sees_a_real_allocation(monkeypatch):
    """The sampler thread sees a real allocation: the allocation is held until the
    sampler has read the RSS twice after the pages were touched (the second read
    started after the touch), however slowly a loaded machine schedules it; a
    sampler that never samples fails the wait."""
    import threading
    import time

    import psutil
    size = 64 << 20
    sampler_reads: list[int] = []

    class Process(psutil.Process):
        def memory_info(self):
            info = super().memory_info()
            if threading.current_thread() is not threading.main_thread():
                sampler_reads.append(info.rss)
            return info
    monkeypatch.setattr(psutil, "Process", Process)

    def allocate():
        buf = bytearray(size)            # calloc: pages may stay unmapped until written
        buf[::4096] = b"\x01" * (size // 4096)   # touch every page so it is resident
        n, give_up = len(sampler_reads), time.monotonic() + 60
        while len(sampler_reads) < n + 2:      # hold it while the sampler (1 ms) looks
            assert time.monotonic() < give_up, "the sampler read no RSS in 60 s"
            time.sleep(0.001)
        return len(buf)                  # freed on return: only the peak shows it

    n, peak = memory_budget.measure_peak_rss(allocate)
    assert n == size
    assert 0.8 * size <= peak <= 1.5 * size, peak


def test_is_out_of_memory():
    assert memory_budget.is_out_of_memory(MemoryError())
    assert memory_budget.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried..."))
    assert memory_budget.is_out_of_memory(type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory"))
    assert not memory_budget.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not memory_budget.is_out_of_memory(ValueError("out of memory"))


CHILD = r"""
import json, resource, sys
from warmup_agent.warmup.memory_budget import BackOff
import psutil
# Real memory pressure: the address space is capped 256 MiB above what the process uses now.
used = psutil.Process().memory_info().vms
resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), used + (256 << 20)))
backoff, warmed = BackOff(), []
for length in (1, 2):
    for batch in (1, 2, 4, 8, 16):
        def shape():
            buf = bytearray(batch * length * (24 << 20))   # 24 MiB per sequence-token unit
            warmed.append((length, batch))
        backoff.run(batch, shape)
print(json.dumps({"warmed": warmed, "dropped": backoff.dropped_at, "limit": backoff.limit}))
"""


def test_backoff_under_a_real_memory_limit_drops_batches_and_goes_on():
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # length 1: 24, 48, 96, 192 MiB fit under 256; 384 MiB fails -> 16 dropped.
    # length 2: 48, 96, 192 fit; batch 8 (384 MiB) fails -> 8 dropped, 16 never tried.
    assert out["warmed"] == [[1, 1], [1, 2], [1, 4], [1, 8], [2, 1], [2, 2], [2, 4]]
    assert out["dropped"] == [[16, "MemoryError"], [8, "MemoryError"]]
    assert out["limit"] == 8


def test_backoff_fails_only_when_batch_one_does_not_fit_and_reraises_other_errors():
    b = BackOff()
    with pytest.raises(BudgetExceeded):
        b.run(1, lambda: bytearray(1 << 62))
    with pytest.raises(ValueError):
        BackOff().run(4, lambda: (_ for _ in ()).throw(ValueError("not memory")))


# --- the back-off inside a real warmup -----------------------------------------------
# The torch engine is real; only its out-of-memory is injected (a wrapper raising
# MemoryError for large batches), since a real OOM on a shared CI host would take
# the test runner down with it.

def _agent_with_oom_from(embedded_model, oom_batch: int):
    from exporter.metrics import AgentMetrics
    from warmup_agent import config
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.pipeline import Agent

    class OOMAbove(TorchEngine):
        def generate(self, prompts, max_new_tokens=1, warmup=False):
            if warmup and len(prompts) >= oom_batch:
                raise MemoryError(f"injected: batch {len(prompts)}")
            return super().generate(prompts, max_new_tokens, warmup)

    cfg = config.load(env={"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8, 16]",
                           "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1, 2, 4]", "WARMUP_AGENT_READINESS_MIN_PROBES": "3"})
    return Agent(cfg, OOMAbove(embedded_model), metrics=AgentMetrics())


def test_warmup_backs_off_from_a_batch_that_runs_out_of_memory(embedded_model):
    from warmup_agent.states import State
    agent = _agent_with_oom_from(embedded_model, 4)
    assert agent.run() == State.SERVING
    assert sorted({b for _, b in agent.context.warmed_shapes}) == [1, 2]
    prewarm = next(s for s in agent.stages if s.name == "prewarm")
    assert prewarm.detail["dropped_batches"] == [4]


def test_out_of_memory_at_batch_1_fails_with_the_named_reason(embedded_model):
    from warmup_agent.states import State
    agent = _agent_with_oom_from(embedded_model, 1)
    assert agent.run() == State.FAILED
    assert agent.sm.failure_reason == "prewarm_memory_budget_exceeded"
    assert agent.metrics.registry.get_sample_value("model_loading_failures_total",
                                                   {"reason": "prewarm_memory_budget_exceeded"}) == 1
