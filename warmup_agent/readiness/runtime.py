"""Readiness at run time: one object per agent joining the window, the dual
thresholds, the breaker and the water level to the state machine and metrics.

The Agent builds it once, in its `__init__` (the composition root), and hands it
what it works with: the config, the state machine, the metrics and the clock.
It owns the time-to-first-token window and is the only writer of the window and
threshold gauges (`warmup_first_token_window_seconds`,
`warmup_readiness_threshold_seconds`); `thresholds_in_force()` is what those
gauges show and what the run record stores, so the two always agree (with
readiness.adaptive, the re-fitted thresholds, not the configured ceiling).

Every time-to-first-token sample -- a probe or a user request through the
proxy -- goes through `observe()`; the watch loop calls `due_probe()` to know
whether to probe the main engine now.  Every breaker step is a state-machine
transition (SERVING -> DEGRADED on trip, DEGRADED -> SERVING on close), counted
in warmup_breaker_transitions_total and shown in warmup_breaker_state.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from warmup_agent.readiness.breaker import Breaker, BreakerState
from warmup_agent.readiness.thresholds import Thresholds
from warmup_agent.readiness.waterlevel import WaterLevel
from warmup_agent.readiness.window import SlidingWindow
from warmup_agent.states import State, StateMachine

if TYPE_CHECKING:
    from exporter.metrics import AgentMetrics
    from warmup_agent.config import Config

log = logging.getLogger("warmup_agent.readiness")


def percentile_label(q: float) -> str:
    """0.5 -> "p50", 0.99 -> "p99"."""
    return f"p{q * 100:g}"


class Readiness:
    def __init__(self, cfg: Config, sm: StateMachine, metrics: AgentMetrics,
                 clock: Callable[[], float] = time.monotonic):
        rc, bc = cfg.readiness, cfg.breaker
        self.sm = sm
        self.metrics = metrics
        # "the last N probes or the last T seconds" (window_seconds 0: the last N only)
        self.window = SlidingWindow(rc.window_size, rc.window_seconds, clock)
        self.thresholds = Thresholds(
            rc.p50_threshold_seconds, rc.p90_threshold_seconds,
            min_samples=rc.min_probes, adaptive=rc.adaptive,
            every=rc.adaptive_every_samples, margin=rc.adaptive_margin,
            floor=rc.adaptive_min_seconds)
        self.breaker_enabled = bc.enabled
        self.breaker = Breaker(bc.trip_after, bc.open_seconds, bc.half_open_probes,
                               clock=clock, on_change=self._breaker_moved)
        self.water = WaterLevel(rc.water_level_alpha, rc.water_level_window_seconds,
                                rc.water_level_period_seconds, rc.water_level_headroom, clock=clock)
        self._lock = threading.RLock()
        self._user_answers: list[tuple[float, float]] = []
        self._publish_breaker()
        self._publish_thresholds()
        self.metrics.warmup_fallback_active.set(0)
        # Zero series for every breaker step and validation outcome, so rate() and
        # increase() work from the first event (and the series exist before one).
        for frm, to in (("closed", "open"), ("open", "half_open"), ("half_open", "open"), ("half_open", "closed")):
            self.metrics.warmup_breaker_transitions_total.labels(**{"from": frm, "to": to})
        for check in ("structure", "numerics", "performance"):
            for result in ("passed", "failed", "skipped", "recorded"):
                self.metrics.warmup_validation_checks_total.labels(check=check, result=result)
        self.metrics.warmup_water_level_requests_per_second.set_function(self.water.read)

    # -- samples ---------------------------------------------------------------------
    def observe(self, ttft: float) -> None:
        """One time-to-first-token sample of the main engine (probe or user request)."""
        with self._lock:
            try:
                self._observe(ttft)
            finally:
                self._publish_window()

    def _observe(self, ttft: float) -> None:
        if self.breaker.state == BreakerState.HALF_OPEN:
            self.window.add(ttft)
            self.breaker.half_open_probe(ttft > self.thresholds.p90)
            return
        if self.breaker.state == BreakerState.OPEN:
            return  # a request that started before the trip: the main path is frozen
        self.window.add(ttft)
        if self.thresholds.sample_added(self.window):
            self.metrics.warmup_readiness_threshold_refits_total.inc()
            self._publish_thresholds()
        if self.breaker_enabled and self.sm.state == State.SERVING:
            p90 = self.window.quantile(0.9)
            self.breaker.closed_sample(p90 is not None and p90 > self.thresholds.p90)

    def thresholds_in_force(self) -> dict[str, float]:
        """{"p50": s, "p90": s}: the thresholds the gate and the breaker use now (the
        adaptive re-fit where readiness.adaptive is on); what /metrics and the run
        record both show."""
        with self._lock:
            return {percentile_label(q): v for q, v in sorted(self.thresholds.current.items())}

    def thresholds_configured(self) -> dict[str, float]:
        """{"p50": s, "p90": s}: the configured thresholds (the adaptive ceiling)."""
        return {percentile_label(q): v for q, v in sorted(self.thresholds.ceiling.items())}

    def due_probe(self) -> bool:
        """Whether the watch loop should probe the main engine now."""
        with self._lock:
            if self.sm.state.terminal:
                return False          # draining or failed: leave the engine alone
            state = self.breaker.tick()
            if state == BreakerState.HALF_OPEN:
                return True
            return state == BreakerState.CLOSED and self.sm.state == State.SERVING

    def main_open(self) -> bool:
        """Whether user traffic may go to the main engine: SERVING and breaker closed."""
        return self.sm.state == State.SERVING and self.breaker.state == BreakerState.CLOSED

    def retry_after(self, default: float) -> float:
        remaining = self.breaker.frozen_remaining()
        return remaining if remaining > 0 else default

    @property
    def state_name(self) -> str:
        """The state machine's state (the proxy's 503 message and its DRAINING/DEGRADED cases)."""
        return self.sm.state.name

    def user_request(self) -> None:
        """A user request arrived (the proxy): counted in the water level's QPS."""
        self.water.request()

    def user_answer(self, ttft: float, total: float) -> None:
        """A user request answered by the main engine with status 200 (the proxy):
        `ttft` from sending the request to the first body chunk, `total` to the end of
        the body, both in seconds.  The first one after the gate opened is the users'
        real first request."""
        with self._lock:
            self._user_answers.append((ttft, total))

    # -- breaker -> state machine ---------------------------------------------------------
    def _breaker_moved(self, frm: BreakerState, to: BreakerState) -> None:
        sm = self.sm
        self.metrics.warmup_breaker_transitions_total.labels(**{"from": frm.value, "to": to.value}).inc()
        if to == BreakerState.OPEN and frm == BreakerState.CLOSED:
            self.metrics.warmup_breaker_trips_total.inc()
            log.warning("breaker tripped: window P90 over %.1f ms on %d consecutive samples; main path frozen for %g s",
                        self.thresholds.p90 * 1000, self.breaker.trip_after, self.breaker.open_seconds)
            if sm.state == State.SERVING:   # not if the pod started draining meanwhile
                sm.transition(State.DEGRADED)
        elif to == BreakerState.OPEN:
            log.warning("half-open probe over %.1f ms: breaker open again for %g s",
                        self.thresholds.p90 * 1000, self.breaker.open_seconds)
        elif to == BreakerState.HALF_OPEN:
            # The window still holds the samples that tripped the breaker: judge afresh.
            self.window.clear()
            log.info("breaker half-open: probing the main engine")
        elif to == BreakerState.CLOSED:
            log.info("breaker closed after %d good probes: back to SERVING", self.breaker.half_open_probes)
            if sm.state == State.DEGRADED:
                sm.transition(State.SERVING)
        self._publish_breaker()

    def _publish_breaker(self) -> None:
        for s in BreakerState:
            self.metrics.warmup_breaker_state.labels(state=s.value).set(1 if s == self.breaker.state else 0)
        self.metrics.warmup_fallback_active.set(1 if self.breaker.main_frozen else 0)

    def _publish_thresholds(self) -> None:
        for label, v in self.thresholds_in_force().items():
            self.metrics.warmup_readiness_threshold_seconds.labels(percentile=label).set(v)

    def _publish_window(self) -> None:
        for q, v in self.window.quantiles().items():
            self.metrics.warmup_first_token_window_seconds.labels(percentile=percentile_label(q)).set(v)
