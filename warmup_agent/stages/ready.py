"""Stage 4, ready (PRIME -> SERVING): probe time to first token until it is stable,
then validate, then serve.

Probes go into the sliding window; the gate opens when at least
readiness.min_probes are in and the window's P50 and P90 are at or under their
thresholds (seed 000 §4.4: 850 ms and 2100 ms; see readiness/thresholds.py).
Then the three-dimensional validation (structure, numerics, performance;
readiness/validation.py) must pass, each failure a named reason.  Last, the
weight fingerprint taken at PRELOAD must still match, or the agent fails
instead of serving.
"""
from __future__ import annotations

import os
import statistics
import time

from warmup_agent.readiness import validation
from warmup_agent.readiness.runtime import attach


def gate_open(window, min_probes: int, p50_max: float, p90_max: float) -> bool:
    if len(window) < min_probes:
        return False
    q = window.quantiles((0.5, 0.9))
    return q[0.5] <= p50_max and q[0.9] <= p90_max


def run(agent) -> None:
    cfg = agent.cfg
    rd = attach(agent)
    detail = agent.stages[-1].detail
    max_probes = cfg["readiness.max_probes"]
    for i in range(max_probes):
        agent.checkpoint()
        ttft = agent.send([agent.probe_prompt()], "probe")
        if agent.first_request_seconds is None:
            agent.first_request_seconds = ttft
        agent.record_probe(ttft)
        agent.progress.step(i + 1, max_probes, f"ttft={ttft * 1000:.1f}ms")
        if rd.thresholds.met(agent.window):
            break
        if cfg["readiness.probe_interval_seconds"]:
            time.sleep(cfg["readiness.probe_interval_seconds"])
    else:
        q = agent.window.quantiles((0.5, 0.9))
        agent.fail("readiness_thresholds_not_met",
                   f"after {max_probes} probes the time to first token is P50 {q[0.5] * 1000:.1f} ms / P90 {q[0.9] * 1000:.1f} ms; "
                   f"thresholds {rd.thresholds.p50 * 1000:.0f} ms / {rd.thresholds.p90 * 1000:.0f} ms")
    steady = statistics.median(agent.probes[1:]) if len(agent.probes) > 1 else agent.probes[0]
    agent.metrics["warmup_first_request_tax_ratio"].set(agent.first_request_seconds / steady)
    detail.update(probes=len(agent.probes))
    if cfg["validation.enabled"]:
        validate(agent, detail)
    with agent._engine_lock:
        fingerprint = agent.engine.weight_fingerprint()
    if not agent.sm.serve(fingerprint):
        agent.checkpoint()


def export_fp8_ranges(metrics, check) -> None:
    for name, r in check.detail.get("ranges", {}).items():
        metrics["warmup_fp8_range_checked_values"].labels(range=name).set(r["checked"])
        metrics["warmup_fp8_range_saturated_values"].labels(range=name).set(r["saturated"])
        metrics["warmup_fp8_range_roundtrip_error_ratio"].labels(range=name).set(r["max_error"])


def validate(agent, detail: dict) -> None:
    """Structure, numerics, performance; the first failure fails the agent with its reason."""
    cfg = agent.cfg
    prompts = [agent.prompts.prompt(n) for n in sorted({8, cfg["readiness.probe_prompt_length"]})]
    checks: list[validation.Check] = []

    def record(c: validation.Check) -> None:
        checks.append(c)
        detail.setdefault("validation", {})[c.name] = {"result": c.result, "message": c.message, **c.detail}
        agent.metrics["warmup_validation_checks_total"].labels(check=c.name, result=c.result).inc()
        if not c.ok:
            agent.fail(c.reason, c.message)

    with agent._engine_lock:
        record(validation.check_structure(agent.engine))
        record(validation.check_numerics(agent.engine, prompts, cfg["validation.logits_mean_min"],
                                         cfg["validation.logits_mean_max"], cfg["validation.logits_abs_max"]))
        if cfg["validation.fp8_ranges"]:   # numerics of an FP8 model (seed 003 §3)
            fp8 = validation.check_fp8_ranges(agent.engine, cfg["validation.fp8_max_saturated_ratio"],
                                              cfg["validation.fp8_max_roundtrip_error"])
            export_fp8_ranges(agent.metrics, fp8)
            record(fp8)
    # Last: a baseline is recorded only for a model that passed the other two.
    path = cfg["validation.baseline_file"]
    if path:
        record(validation.check_performance(agent.window.quantile(0.5), os.path.expanduser(path),
                                            validation.baseline_key(agent.engine, agent.sm.fingerprint),
                                            cfg["validation.performance_factor"]))
    else:
        record(validation.Check("performance", "skipped", "no validation.baseline_file"))
