"""Stage 3, solidify (PRIME): freeze what the engine can for the warmed shapes.

torch engine on CPU: replay each warmed shape once more (allocator buckets and
kernel plans settle); torch.compile on request.  CUDA graphs and the shared
kernel cache come with the GPU and kernel-cache work.
"""
from __future__ import annotations

import time


def run(agent) -> None:
    detail = agent.stages[-1].detail
    t0 = time.perf_counter()
    with agent._engine_lock:
        report = agent.engine.solidify(getattr(agent, "warmed_shapes", []), mode=agent.cfg["solidify.mode"])
    agent.metrics["warmup_engine_seconds_total"].labels(kind="solidify").inc(time.perf_counter() - t0)
    detail.update(method=report.method, shapes=report.shapes, **report.detail)
