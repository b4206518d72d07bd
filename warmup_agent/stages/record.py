"""The run's timeline and its two views: `status()` for /startupz and `record()` for `--record`.

The Agent writes only the timeline; every other figure is read from the StageContext.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from exporter.recorder import percentile_label
from warmup_agent import __version__
from warmup_agent.run.timeline import StageTiming

__all__ = ["RunRecord", "StageTiming"]

if TYPE_CHECKING:  # types only
    from warmup_agent.stages.context import StageContext


class RunRecord:
    def __init__(self, ctx: StageContext, clock: Callable[[], float], trace_id: Callable[[], str | None]):
        self.ctx = ctx
        self.clock = clock
        self._trace_id = trace_id
        self.started = clock()        # the zero of every timestamp we record (Agent.run)
        self.startup: StageTiming | None = None
        self.stages: list[StageTiming] = []
        self.serving_at: float | None = None

    @property
    def time_to_ready(self) -> float | None:
        return None if self.serving_at is None else self.serving_at - self.started

    @property
    def startup_seconds(self) -> float | None:
        return None if self.startup is None else self.startup.duration

    def status(self) -> dict[str, Any]:
        """What /startupz shows: state, current stage, elapsed and per-stage durations."""
        ctx, sm = self.ctx, self.ctx.sm
        now = self.clock()
        current = next((s.name for s in reversed(self.stages) if s.status == "running"), None)
        remaining = sm.deadline_remaining()
        return {
            "state": sm.state.name,
            "stage": current,
            "elapsed_seconds": now - self.started,
            "startup_seconds": self.startup_seconds,
            "deadline_remaining_seconds": None if remaining is None else max(0.0, remaining),
            "stages": {s.name: {"phase": s.phase, "status": s.status, "start_seconds": s.start,
                                "duration_seconds": s.duration} for s in self.stages},
            "time_to_ready_seconds": self.time_to_ready,
            "first_token_window_seconds": {percentile_label(q): v for q, v in ctx.readiness.window.quantiles().items()},
            "probes": len(ctx.probe_log.probes),
            "engine": ctx.engine_facts,
            "breaker": ctx.readiness.breaker.state.value,
            "warmup": ctx.warmup_summary,
            "failure_reason": sm.failure_reason,
            "failure_message": sm.failure_message,
        }

    def record(self) -> dict[str, Any]:
        """The run as JSON (`--record`): stages with start/end, probes, final state."""
        ctx, sm, log = self.ctx, self.ctx.sm, self.ctx.probe_log
        fr = log.figures
        return {
            "version": __version__,
            "engine": ctx.cfg.engine,
            "model": ctx.engine.model_path,
            "host": ctx.host_facts,
            "engine_facts": ctx.engine_facts,
            "quantization": q.as_dict() if (q := ctx.engine.quantization) is not None else None,
            "started_unix": time.time() - (self.clock() - self.started),
            "startup_seconds": self.startup_seconds,
            "stages": [{"name": s.name, "phase": s.phase, "start_seconds": s.start, "end_seconds": s.end,
                        "duration_seconds": s.duration, "status": s.status, **s.detail} for s in self.stages],
            "time_to_ready_seconds": self.time_to_ready,
            "warmup_requests": ctx.driver.warmup_requests,
            "probes_seconds": log.ttfts,
            "probe_count": len(log.probes),
            "watch_probes_skipped": ctx.watch_skipped,
            # The first-request figures, frozen when the gate opened.
            "first_request_seconds": None if fr is None else fr.ttft_seconds,
            "steady_first_token_seconds": None if fr is None else fr.steady_ttft_seconds,
            "first_request_tax_ratio": None if fr is None else fr.ttft_tax,
            "probe_total_seconds": log.totals,
            "first_request_total_seconds": None if fr is None else fr.total_seconds,
            "steady_total_seconds": None if fr is None else fr.steady_total_seconds,
            "first_request_total_tax_ratio": None if fr is None else fr.total_tax,
            "first_probe_total_tax_ratio": None if fr is None else fr.measured_total_tax,
            "first_request_cold_decode": None if fr is None else fr.cold_decode,
            "first_request_new_length_remembered": None if fr is None else fr.new_length,
            "first_request_prompt_tokens": None if fr is None else fr.prompt_tokens,
            "first_request_output_tokens": None if fr is None else fr.output_tokens,
            "time_per_output_token_window_seconds": {percentile_label(q): v for q, v in log.decode.quantiles().items()},
            "traffic_profile": ctx.profile_summary,
            # In force (adaptive: the last re-fit), and the configured ceiling.
            "readiness_thresholds_seconds": ctx.readiness.thresholds_in_force(),
            "readiness_thresholds_configured_seconds": ctx.readiness.thresholds_configured(),
            "final_state": sm.state.name,
            "failure_reason": sm.failure_reason,
            "failure_message": sm.failure_message,
            "transitions": [{"state": s.name, "at_seconds": t - self.started} for s, t in sm.history],
            "trace_id": self._trace_id(),   # null when tracing is off
        }
