"""Stage 4, ready (PRIME -> SERVING): probe time to first token until it is stable.

Probes go into the sliding window; the gate opens when at least
readiness.min_probes are in and the window's P50 and P90 are at or under their
thresholds (seed 000 §4.4: 850 ms and 2100 ms).  Then the weight fingerprint
taken at PRELOAD must still match, or the agent fails instead of serving.
"""
from __future__ import annotations

import statistics
import time


def gate_open(window, min_probes: int, p50_max: float, p90_max: float) -> bool:
    if len(window) < min_probes:
        return False
    q = window.quantiles((0.5, 0.9))
    return q[0.5] <= p50_max and q[0.9] <= p90_max


def run(agent) -> None:
    cfg = agent.cfg
    detail = agent.stages[-1].detail
    prompt = agent.prompts.prompt(cfg["readiness.probe_prompt_length"])
    max_probes = cfg["readiness.max_probes"]
    for i in range(max_probes):
        agent.checkpoint()
        ttft = agent.send([prompt], "probe")
        if agent.first_request_seconds is None:
            agent.first_request_seconds = ttft
        agent.record_probe(ttft)
        agent.progress.step(i + 1, max_probes, f"ttft={ttft * 1000:.1f}ms")
        if gate_open(agent.window, cfg["readiness.min_probes"], cfg["readiness.p50_threshold_seconds"],
                     cfg["readiness.p90_threshold_seconds"]):
            break
        if cfg["readiness.probe_interval_seconds"]:
            time.sleep(cfg["readiness.probe_interval_seconds"])
    else:
        q = agent.window.quantiles((0.5, 0.9))
        agent.fail("readiness_thresholds_not_met",
                   f"after {max_probes} probes the time to first token is P50 {q[0.5] * 1000:.1f} ms / P90 {q[0.9] * 1000:.1f} ms; "
                   f"thresholds {cfg['readiness.p50_threshold_seconds'] * 1000:.0f} ms / {cfg['readiness.p90_threshold_seconds'] * 1000:.0f} ms")
    steady = statistics.median(agent.probes[1:]) if len(agent.probes) > 1 else agent.probes[0]
    agent.metrics["warmup_first_request_tax_ratio"].set(agent.first_request_seconds / steady)
    detail.update(probes=len(agent.probes))
    with agent._engine_lock:
        fingerprint = agent.engine.weight_fingerprint()
    if not agent.sm.serve(fingerprint):
        agent.checkpoint()
