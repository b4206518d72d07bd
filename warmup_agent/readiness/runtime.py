"""Readiness at run time: one object per agent joining the window, the dual
thresholds, the breaker and the water level to the state machine and metrics.

The Agent builds it once, in its `__init__` (the composition root), and hands it
what it works with: its two config sections (`readiness.*`, `breaker.*`), the state
machine, the metrics and the clock.
It owns the time-to-first-token window and is the only source of the window and
threshold gauges (`warmup_first_token_window_seconds`,
`warmup_readiness_threshold_seconds`, written by exporter/recorder.py from the
records it fills); `thresholds_in_force()` is what those
gauges show and what the run record stores, so the two always agree (with
readiness.adaptive, the re-fitted thresholds, not the configured ceiling).

Every time-to-first-token sample -- a probe or a user request through the
proxy -- goes through `observe()`; the watch loop calls `due_probe()` to know
whether to probe the main engine now.  Every breaker step is a state-machine
transition (SERVING -> DEGRADED on trip, DEGRADED -> SERVING on close), counted
in warmup_breaker_transitions_total and shown in warmup_breaker_state.

A probe that fails (the server unreachable, a timeout, HTTP 5xx, an answer
without a token) goes through `probe_failed()`: counted by reason in
warmup_watch_probe_failures_total, and breaker.fail_after of them in a row trip
the breaker with that reason (warmup_breaker_trips_total{reason}).  An
unreachable or hung (timeout) server is probed again at the next watch interval
(breaker.unreachable_open_seconds), every other cause waits breaker.open_seconds.
One log line per breaker change, never one per failed probe.

`user_answer()` is the proxy's report of each user request the main engine
answered: the first after the gate opened is the users' real first request, its
figures computed once, in first_user.py, against the users' answers after it.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

from exporter.recorder import (
    BreakerStats,
    Known,
    LiveGauges,
    ProbeFailureStats,
    TaxStats,
    ThresholdStats,
    WindowStats,
    percentile_label,
)
from warmup_agent.readiness.breaker import Breaker, BreakerState
from warmup_agent.readiness.first_user import FirstUserRequest, UserAnswer
from warmup_agent.readiness.thresholds import Thresholds
from warmup_agent.readiness.verdict import DecodeTest, Verdict, judge
from warmup_agent.readiness.waterlevel import WaterLevel
from warmup_agent.readiness.window import SlidingWindow
from warmup_agent.states import State, StateMachine

if TYPE_CHECKING:
    from exporter.recorder import Recorder
    from warmup_agent.config_sections import BreakerSection, ReadinessSection
    from warmup_agent.readiness.life import ServerLife
    from warmup_agent.readiness.traffic_memory import TrafficMemory
    from warmup_agent.warmup.learned import Shape

log = logging.getLogger("warmup_agent.readiness")


#: Why the breaker tripped (warmup_breaker_trips_total{reason}).
TRIP_CAUSES = ("slow", "unreachable", "timeout", "server_error", "bad_answer")
#: Why a probe failed (warmup_watch_probe_failures_total{reason}).
FAILURE_CAUSES = TRIP_CAUSES[1:]
BREAKER_STATES = tuple(s.value for s in BreakerState)
_HTTP_5XX = re.compile(r"\bHTTP 5\d\d\b")


def failure_cause(error: BaseException) -> tuple[str, str]:
    """(cause, one-line message) of a failed probe: "unreachable" (connection refused,
    reset, no route), "timeout" (no answer in time), "server_error" (HTTP 5xx) or
    "bad_answer" (anything else: another status, a stream without a token, an
    engine's own error)."""
    message = " ".join(str(error).split()) or type(error).__name__
    reason = getattr(error, "reason", None)
    if isinstance(error, TimeoutError) or (reason == "server_unreachable" and "timed out" in message):
        return "timeout", message
    if reason == "server_unreachable" or isinstance(error, ConnectionError):
        return "unreachable", message
    if _HTTP_5XX.search(message):
        return "server_error", message
    return "bad_answer", message


class Readiness:
    def __init__(self, rc: ReadinessSection, bc: BreakerSection, sm: StateMachine, recorder: Recorder,
                 clock: Callable[[], float] = time.monotonic):
        self.sm = sm
        #: Where the window, the thresholds, the breaker and the first user's figures
        #: become metrics (exporter/recorder.py).
        self.recorder = recorder
        # "the last N probes or the last T seconds" (window_seconds 0: the last N only)
        self.window = SlidingWindow(rc.window_size, rc.window_seconds, clock)
        self.thresholds = Thresholds(
            rc.p50_threshold_seconds, rc.p90_threshold_seconds,
            min_samples=rc.min_probes, adaptive=rc.adaptive,
            every=rc.adaptive_every_samples, margin=rc.adaptive_margin,
            floor=rc.adaptive_min_seconds)
        self._min_probes_server = rc.min_probes_server
        self.breaker_enabled = bc.enabled
        self.breaker = Breaker(bc.trip_after, bc.open_seconds, bc.half_open_probes,
                               clock=clock, on_change=self._breaker_moved, fail_after=bc.fail_after)
        self.unreachable_open_seconds = bc.unreachable_open_seconds
        self.watch_interval = rc.watch_interval_seconds
        # A probe slower than twice the tail threshold is slow whatever it answers.
        self.probe_timeout = rc.watch_probe_timeout_seconds or max(rc.watch_interval_seconds,
                                                                   2 * rc.p90_threshold_seconds)
        self._clock = clock
        self._tripped_at: float | None = None
        self._failure_message = ""
        self.water = WaterLevel(rc.water_level_alpha, rc.water_level_window_seconds,
                                rc.water_level_period_seconds, rc.water_level_headroom, clock=clock)
        self._lock = threading.RLock()
        # The users' real first request (user_answer): its own lock, since the state
        # machine's listener resets it while a stage thread may hold the machine.
        self._user_lock = threading.Lock()
        self._first_user = FirstUserRequest(rc.first_user_steady_requests)
        #: The server's restarts, sleep and wake (life.py); the agent sets it for a server engine.
        self.life: ServerLife | None = None
        self.traffic: TrafficMemory | None = None     # what users send, learned (the pipeline sets it)
        self._in_flight = 0                            # user requests the proxy holds or relays now
        self._users_let_in = False
        self._let_in_listeners: list[Callable[[], None]] = []
        sm.on_change(self._state_moved)
        recorder.declare_series(Known(
            trip_causes=TRIP_CAUSES,
            breaker_moves=(("closed", "open"), ("open", "half_open"), ("half_open", "open"), ("half_open", "closed")),
            probe_failure_causes=FAILURE_CAUSES,
            checks=("structure", "numerics", "performance"), check_results=("passed", "failed", "skipped", "recorded")))
        self._publish_breaker()
        self._publish_thresholds()
        self._publish_first_user(None)
        recorder.live(LiveGauges(water_level=self.water.read))

    @property
    def users_let_in(self) -> bool:
        """The warm-up can spare users nothing more (a start, a wake): they go to the server before SERVING."""
        return self._users_let_in

    @users_let_in.setter
    def users_let_in(self, value: bool) -> None:
        changed, self._users_let_in = value != self._users_let_in, value
        if changed:
            for listener in self._let_in_listeners:
                listener()

    def on_let_in(self, listener: Callable[[], None]) -> None:
        self._let_in_listeners.append(listener)

    def gate_min_probes(self, profile_probes: bool, alone: bool = False) -> int:
        """Probes the gate's window needs: readiness.min_probes, or, where probes speak the
        traffic profile and are judged in pairs, readiness.min_probes_server; one where
        the first probe went alone (this server was measured before)."""
        if not profile_probes:
            return self.thresholds.min_samples
        return 1 if alone else self._min_probes_server

    def verdict(self, min_probes: int, decode: DecodeTest | None = None) -> Verdict:
        """Whether the gate opens now, and why not."""
        with self._lock:
            return judge(self.window, self.thresholds, min_probes, decode)

    def probes_in_window(self) -> int:
        return len(self.window)

    def window_p50(self) -> float | None:
        """The window's P50 (the performance baseline), None when every sample aged out."""
        return self.window.quantile(0.5)

    # -- samples ---------------------------------------------------------------------
    def first_token(self, ttft: float) -> None:
        """One time-to-first-token sample of the main engine: a probe's."""
        self._samples((ttft,))

    def first_tokens(self, ttfts: Sequence[float]) -> None:
        """Users' samples (the proxy's, batched; the window published once).  Not those of
        users let in before the gate: it judges its own probes, and their wait was the hold's."""
        if self.users_let_in and self.sm.state != State.SERVING:
            return
        self._samples(ttfts)

    def _samples(self, ttfts: Sequence[float]) -> None:
        with self._lock:
            try:
                for ttft in ttfts:
                    self._observe(ttft)
            finally:
                self._publish_window()

    def _observe(self, ttft: float) -> None:
        if self.breaker.state == BreakerState.HALF_OPEN:
            self.window.add(ttft)
            self.breaker.half_open_probe(not self.thresholds.tail_ok(ttft))
            return
        if self.breaker.state == BreakerState.OPEN:
            return  # a request that started before the trip: the main path is frozen
        self.window.add(ttft)
        if self.thresholds.sample_added(self.window):
            self._publish_thresholds(refit=True)
        if self.breaker_enabled and self.sm.state == State.SERVING:
            p90 = self.window.quantile(0.9)
            self.breaker.closed_sample(p90 is not None and not self.thresholds.tail_ok(p90))

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
        """Whether user traffic may go to the main engine: SERVING and breaker closed,
        or asleep (and warming after a wake) where users' requests wake the server."""
        if self.sm.state == State.SERVING and self.breaker.state == BreakerState.CLOSED:
            return True
        if self.users_let_in and self.sm.state in (State.PRELOAD, State.PRIME):
            return True
        return self.life is not None and self.life.main_open()

    def ready(self) -> bool:
        """What /readyz answers: SERVING, or asleep where readiness.ready_while_asleep keeps the pod in."""
        return self.sm.state == State.SERVING or (self.life is not None and self.life.ready())

    def retry_after(self, default: float) -> float:
        remaining = self.breaker.frozen_remaining()
        return remaining if remaining > 0 else default

    @property
    def state_name(self) -> str:
        """The state machine's state (the proxy's 503 message and its DRAINING/DEGRADED cases)."""
        return self.sm.state.name

    def user_request(self) -> None:
        """A user request arrived (the proxy): counted in the water level's QPS and in
        flight until user_done; while the server sleeps, it starts a wake."""
        with self._user_lock:
            self._in_flight += 1
        self.water.request()
        if self.life is not None:
            self.life.user_request()

    def user_done(self) -> None:
        """A user request the proxy answered, refused or lost."""
        with self._user_lock:
            self._in_flight = max(0, self._in_flight - 1)

    @property
    def users_in_flight(self) -> int:
        """User requests the proxy holds or relays now (0 without a proxy)."""
        return self._in_flight

    def user_shape(self, shape: Shape, params: dict[str, Any]) -> None:
        """The shape of a user request the main engine answered (the proxy): learned."""
        if self.traffic is not None:
            self.traffic.observe(shape, params)

    def user_answer(self, ttft: float, total: float, output_tokens: int | None = None, held: float = 0.0) -> None:
        """A user's 200 from the main engine (the proxy): `ttft` to the first body chunk, `total`
        to its end, `output_tokens` where known.  The first one after a gate opened is the
        users' real first request, exported once the answers after it are in (first_user.py)."""
        if self.life is not None:
            self.life.user_answer(held + ttft)    # what the user met after the wake: its hold included
        with self._user_lock:
            tracker = self._first_user_now()
            if tracker is None:
                return      # before any gate opened (users let in): not after a warm-up
            figures = tracker.add(UserAnswer(ttft, total, output_tokens))
            if figures is None:
                return
            self._publish_first_user(figures)
        total_txt = f"{figures.total_tax:.2f}x" if figures.total_tax is not None else "not measured (no token counts)"
        log.info("the users' first request after SERVING: time to first token %.1f ms, %.2fx the median of the "
                 "%d answers after it (%.1f ms); whole answer %s", figures.first.ttft * 1000, figures.ttft_tax,
                 len(figures.later), figures.steady_ttft * 1000, total_txt)

    @property
    def first_user_request(self) -> FirstUserRequest:
        """The current gate's users' first request (its figures once complete)."""
        with self._user_lock:
            return self._first_user_now() or self._first_user

    def _first_user_now(self) -> FirstUserRequest | None:
        # By the gate's opening time, not the listener: an answer can come in before it runs.
        opened = gate_opened_at(self.sm)
        if opened is None:
            return None
        if self._first_user.opened_at != opened:
            self._first_user = FirstUserRequest(self._first_user.steady_requests, opened)
            self._publish_first_user(None)
        return self._first_user

    def _publish_first_user(self, figures: object) -> None:
        """0 means "not measured yet" (the alert then reads the predicted figure)."""
        from warmup_agent.readiness.first_user import FirstUserFigures
        if isinstance(figures, FirstUserFigures):
            self.recorder.first_user_request(TaxStats(figures.ttft_tax, figures.total_tax))
        else:
            self.recorder.first_user_request(TaxStats(None, None))

    def _state_moved(self, frm: State, to: State) -> None:
        """The state machine moved.  PRELOAD (a re-warm): the breaker judges afresh;
        PRIME -> SERVING (a gate opened): the next user answer is a first request again."""
        if to != State.PRIME:
            self.users_let_in = False
        if to == State.PRELOAD and self.breaker.reset():
            self._tripped_at = None
            log.info("breaker closed for the re-warm (it judges the engine afresh)")
            self._publish_breaker()
        if to == State.SERVING and frm == State.PRIME:
            with self._user_lock:
                self._first_user_now()

    # -- failed probes ---------------------------------------------------------------------
    def probe_failed(self, error: BaseException) -> str:
        """A probe of the main engine after SERVING (or a half-open one) failed:
        counted by reason, and the breaker decides.  Returns the reason."""
        cause, message = failure_cause(error)
        return self.probe_failure(cause, message)

    def count_probe_failure(self, cause: str) -> None:
        """A failed probe, counted by its cause; the one place that counts them."""
        self.recorder.probe_failure(ProbeFailureStats(cause))

    def probe_failure(self, cause: str, message: str) -> str:
        """A failed probe with its named cause (FAILURE_CAUSES) and one-line message."""
        self.count_probe_failure(cause)
        with self._lock:
            if not self.breaker_enabled or self.sm.state.terminal:
                log.debug("probe failed (%s): %s", cause, message)
                return cause
            if self.breaker.state == BreakerState.CLOSED and self.sm.state not in (State.SERVING, State.SLEEPING):
                return cause     # a re-warm is under way: its own stages judge the engine
            self._failure_message = message
            # A server that is gone or hung is looked at again every watch interval, so
            # the pod is back within one interval of it answering; a slow or erring one
            # waits the breaker's freeze.
            freeze = (self.unreachable_open_seconds if cause in ("unreachable", "timeout")
                      else self.breaker.open_seconds)
            self.breaker.failure(cause, freeze)
        return cause

    def health_answered(self) -> None:
        """The server's health endpoint answered again: a breaker opened because the
        server was gone or hung goes half-open now, not at the end of its freeze."""
        with self._lock:
            if self.breaker.cause in ("unreachable", "timeout"):
                self.breaker.half_open_now()

    def server_answered(self) -> None:
        """The server's health endpoint answered (a server watched by reads alone, one
        that sleeps when idle): half-open, that counts as the good probes."""
        with self._lock:
            self.health_answered()
            if self.breaker.tick() == BreakerState.HALF_OPEN:
                for _ in range(self.breaker.half_open_probes):
                    self.breaker.half_open_probe(False)

    # -- breaker -> state machine ---------------------------------------------------------
    def _breaker_moved(self, frm: BreakerState, to: BreakerState) -> None:
        sm = self.sm
        b = self.breaker
        cause = b.cause or "slow"
        # A dead server is probed again every watch interval: open -> half-open -> open
        # with the same cause is one condition going on, logged once (at the trip).
        quiet = cause in ("unreachable", "timeout")
        tripped = to == BreakerState.OPEN and frm == BreakerState.CLOSED
        self._publish_breaker(frm, cause if tripped else None)
        if tripped:
            self._tripped_at = self._clock()
            self._last_cause = cause
            log.warning("breaker tripped (%s): %s; %s", cause, self._why(cause), self._next_probe_words())
            if sm.state in (State.SERVING, State.SLEEPING):   # not if the pod started draining meanwhile
                sm.transition(State.DEGRADED)
        elif to == BreakerState.OPEN:
            if cause != self._last_cause or not quiet:
                log.warning("half-open probe failed (%s): %s; %s", cause, self._why(cause), self._next_probe_words())
            self._last_cause = cause
        elif to == BreakerState.HALF_OPEN:
            # The window still holds the samples that tripped the breaker: judge afresh.
            self.window.clear()
            (log.debug if quiet else log.info)("breaker half-open: probing the main engine")
        elif to == BreakerState.CLOSED:
            down = self._clock() - self._tripped_at if self._tripped_at is not None else 0.0
            log.info("breaker closed after %d good probes, %.1f s after it tripped (%s): back to SERVING",
                     b.half_open_probes, down, self._last_cause)
            self._tripped_at = None
            if sm.state == State.DEGRADED:
                sm.transition(State.SERVING)

    _last_cause = "slow"

    def _why(self, cause: str) -> str:
        if cause == "slow":
            return (f"window P90 over {self.thresholds.p90 * 1000:.1f} ms on {self.breaker.trip_after} "
                    f"consecutive samples")
        return self._failure_message or cause

    def _next_probe_words(self) -> str:
        freeze = self.breaker.freeze
        if freeze <= 0:
            return "the pod is out of its Service; the main engine is probed again every watch interval"
        return f"main path frozen for {freeze:g} s, then half-open probes"

    def _publish_breaker(self, before: BreakerState | None = None, trip: str | None = None) -> None:
        self.recorder.breaker(BreakerStats(self.breaker.state.value, BREAKER_STATES, self.breaker.main_frozen,
                                           before=before.value if before is not None else None, trip=trip))

    def _publish_thresholds(self, refit: bool = False) -> None:
        self.recorder.thresholds(ThresholdStats(self.thresholds_in_force(), refit=refit))

    def _publish_window(self) -> None:
        self.recorder.first_token_window(WindowStats(self.window.quantiles()))


def gate_opened_at(sm: StateMachine) -> float | None:
    """When the last PRIME -> SERVING happened, or None."""
    h = sm.history
    return next((h[i][1] for i in range(len(h) - 1, 0, -1)
                 if h[i][0] == State.SERVING and h[i - 1][0] == State.PRIME), None)
