"""The warmup pipeline: reserve, prewarm, solidify, ready.

`Agent.run()` reads as the four stages.  Each stage is timed on one clock with
contiguous boundaries (a stage starts where the previous one ended), so the
stage durations add up exactly to the time from start to SERVING; each is
reported to the state machine, the metrics, the `[COLDSTART]` log and the
progress display.
"""
from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Literal

from exporter.metrics import AgentMetrics
from exporter.recorder import BuildInfo, FailureStats, Known, LifeStats, LiveGauges, Recorder, ServingStats, StageStats
from warmup_agent import __version__
from warmup_agent.config import Config
from warmup_agent.driver import EngineDriver
from warmup_agent.engines.base import Engine
from warmup_agent.errors import AgentFailure, EngineError
from warmup_agent.host.memory import MemorySampler
from warmup_agent.periodic import Periodic
from warmup_agent.readiness.breaker import BreakerState
from warmup_agent.readiness.golden import GoldenAnswers
from warmup_agent.readiness.life import Action, ServerLife
from warmup_agent.readiness.probes import ProbeLog
from warmup_agent.readiness.runtime import Readiness, failure_cause
from warmup_agent.run import tracing
from warmup_agent.run.progress import Progress, coldstart
from warmup_agent.stages import prewarm, ready, reserve, solidify
from warmup_agent.stages.context import StageContext, StageSettings
from warmup_agent.stages.record import RunRecord, StageTiming
from warmup_agent.states import State, StateMachine

if TYPE_CHECKING:  # types only
    from warmup_agent.config_sections import DeadlinesSection, OpenaiSection
    from warmup_agent.readiness.traffic_memory import TrafficMemory

__all__ = ["STAGES", "Agent", "AgentFailure", "StageTiming", "preload_deadline"]

log = logging.getLogger("warmup_agent.pipeline")
# The warm-up behind the users waits this long after another client's request began.
QUIET_SECONDS = 0.5
# ... looking again every QUIET_POLL_SECONDS (10 ms was 42% of the agent's CPU under load).
QUIET_POLL_SECONDS = 0.05
# Users let in before SERVING: the warm-up's next request waits for them, at most this long.
LET_IN_WAIT_SECONDS = 2.0
LET_IN_POLL_SECONDS = 0.005
EACH_LENGTH_PAYS = "each new prompt length pays once on this server, whatever the warm-up sends"
COMEBACK_POLL_SECONDS = 0.05   # /health of a server that is down, between two watch ticks

STAGES = ("reserve", "prewarm", "solidify", "ready")


class Agent:
    """The run: the four stages in order, their timing, re-warms, the watch loop
    after SERVING.  Its collaborators do the rest (issue 24): the engine driver
    (driver.py) sends every request, the probe log (readiness/probes.py) keeps the probes,
    the run record (stages/record.py) builds status() and record(), and the stages
    see only the StageContext (stages/context.py)."""

    def __init__(self, cfg: Config, engine: Engine, metrics: AgentMetrics | None = None,
                 progress: Progress | None = None, clock: Callable[[], float] = time.perf_counter,
                 process_started: float | None = None):
        self.cfg = cfg
        self.engine = engine
        self.metrics = metrics or AgentMetrics()
        #: The one writer of the agent's metrics (exporter/recorder.py).
        self.recorder = Recorder(self.metrics)
        self.progress = progress or Progress(enabled=False)
        self.clock = clock
        self.sm = StateMachine(self.recorder, clock=clock, deadlines={
            State.INIT: cfg.deadlines.init_seconds,
            State.PRELOAD: preload_deadline(cfg.deadlines, cfg.openai, cfg.engine,
                                            preload_set=cfg.sources.get("deadlines.preload_seconds") != "default"),
            State.PRIME: cfg.deadlines.prime_seconds,
        })
        # Readiness owns the time-to-first-token window, the thresholds, the breaker
        # and the water level, and alone sets their gauges (zero series from the start).
        self.readiness = Readiness(cfg.readiness, cfg.breaker, self.sm, self.recorder, clock=clock)
        # Every probe, the decode window beside the first token (issue 19), and the
        # first-request figures computed once from them (readiness/probes.py).
        self.probe_log = ProbeLog(cfg.readiness.window_size)
        self.driver = EngineDriver(engine, self.recorder, cfg.readiness.probe_prompt_length)
        self.memory = MemorySampler()
        # What the stages see and share (stages/context.py); lives as long as the agent.
        settings = StageSettings(prewarm=cfg.prewarm, readiness=cfg.readiness, validation=cfg.validation,
                                 model=cfg.model, solidify=cfg.solidify, reserve=cfg.reserve, gpu=cfg.gpu,
                                 kernel_cache=cfg.kernel_cache, data_dir=cfg.data_dir, engine=cfg.engine)
        self.context = StageContext(settings, engine, self.driver, self.sm, self.readiness, self.probe_log,
                                    self.recorder, self.progress)
        self.tracing = tracing.active()   # start-up traces (run/tracing.py); NOOP unless the CLI set one up
        self.run_record = RunRecord(self.context, clock, lambda: self.tracing.trace_id)
        self._boundary = self.started
        # When the process started, on `clock` (procstart.process_started()); the CLI
        # passes it so that a first run's imports and model creation are counted.
        self.process_started = process_started
        self._watch: Periodic | None = None   # watch() starts it after SERVING
        self._watch_interval = 0.0
        self._watch_skipping = False
        self._watch_turn = 0                 # which learned length the next watch probe sends
        self._probe_thread: threading.Thread | None = None   # the watch loop's probe in flight
        self._engine_crashed = False
        self.life: ServerLife | None = None   # watch() builds it for an engine with a server
        self.golden: GoldenAnswers | None = None   # ... and records the warmed model's answers
        self._golden_checked = False
        self._stopped = False
        self._init_metrics()
        self.sm.before_change(self._on_serving)
        if cfg.proxy.listen:     # what users send through the proxy, learned (shapes, never text)
            self.readiness.traffic = self._traffic_memory()

    # -- the timeline (kept by the run record) and what tests and tools read ----------------
    @property
    def started(self) -> float:
        """The zero of every timestamp we record (see run())."""
        return self.run_record.started

    @property
    def startup(self) -> StageTiming | None:
        return self.run_record.startup

    @property
    def stages(self) -> list[StageTiming]:
        return self.run_record.stages

    @property
    def serving_at(self) -> float | None:
        return self.run_record.serving_at

    @property
    def probes(self) -> list[float]:
        """Time to first token of every probe so far, in order."""
        return self.probe_log.ttfts

    @property
    def probe_totals(self) -> list[float]:
        """Whole-answer time of every probe so far, in order."""
        return self.probe_log.totals

    # -- the pipeline ----------------------------------------------------------------------
    def run(self) -> State:
        """Run the four stages; return the final state (SERVING or FAILED)."""
        # The zero of every recorded time is the start of the process when it is
        # known (the CLI), else the call to run().  The time before run() is the
        # "startup" stage (phase 0): interpreter, torch/transformers imports, the
        # embedded model's creation, engine set-up.  Startup plus the four stage
        # durations add up to the time from that zero to SERVING.
        run_at = self.run_record.started = self._boundary = self.clock()
        self.tracing.run_started(self)
        if self.process_started is not None and self.process_started < run_at:
            self.run_record.started = self.process_started
            startup = run_at - self.started
            self.run_record.startup = StageTiming("startup", 0, start=0.0, end=startup, status="ok")
            self.progress.startup_finished(startup)
            coldstart("completed", "startup", 0, duration=round(startup, 6), state=self.sm.state.name)
        if self.cfg.proxy.listen and not self.cfg.proxy.fallback_url:
            self.context.let_users_in = self.let_users_in
        self.sm.begin(run_at)  # INIT's deadline covers the agent's own work only
        self.sm.start_watchdog()
        self.memory.start()
        try:
            self.reserve()
            self.prewarm()
            self.solidify()
            self.ready()
        except AgentFailure as e:
            if self.sm.state == State.DRAINING:
                log.info("warmup stopped: draining")
            else:
                log.error("warmup failed: %s: %s", e.reason, e.message)
        finally:
            self.sm.stop_watchdog()
        self.tracing.run_finished(self)
        return self.sm.state

    def reserve(self) -> None:
        with self._stage("reserve", 1) as timing:
            reserve.run(self.context, timing.detail)

    def prewarm(self) -> None:
        with self._stage("prewarm", 2) as timing:
            prewarm.run(self.context, timing.detail)

    def solidify(self) -> None:
        with self._stage("solidify", 3) as timing:
            solidify.run(self.context, timing.detail)

    def ready(self) -> None:
        with self._stage("ready", 4) as timing:
            ready.run(self.context, timing.detail)

    def _on_serving(self, frm: State, to: State) -> None:
        # Before readers see SERVING, so a /readyz 200 is never followed by a /metrics without it.
        if to == State.SERVING and frm == State.PRIME:
            self.run_record.serving_at = serving_at = self.clock()
            self.recorder.serving(ServingStats(serving_at - self.started))

    @contextlib.contextmanager
    def _stage(self, name: str, phase: int) -> Iterator[StageTiming]:
        timing = StageTiming(name, phase, start=self._boundary - self.started)
        self.stages.append(timing)
        self.progress.stage_started(phase, len(STAGES), name)
        coldstart("started", name, phase, state=self.sm.state.name)
        try:
            self.context.checkpoint()
            yield timing
            self.context.checkpoint()
            timing.status = "ok"
        except EngineError as e:
            timing.status = "failed"
            if self.sm.state == State.DRAINING:  # the engine stopped waiting because we drain
                raise AgentFailure("draining", "stopped by a signal") from None
            self.sm.fail(e.reason, e.message)
            raise AgentFailure(e.reason, e.message) from None
        except AgentFailure:
            timing.status = "failed"
            raise
        finally:
            served = self.serving_at
            end = served if name == "ready" and served is not None and served >= self.started + timing.start \
                else self.clock()
            timing.end = end - self.started
            duration = timing.end - timing.start   # timing.duration, now that it has ended
            self._boundary = end
            self.recorder.stage(StageStats(name, duration))
            self.progress.stage_finished(name, duration, ok=timing.status == "ok")
            coldstart("completed" if timing.status == "ok" else "failed", name, phase,
                      duration=round(duration, 6), state=self.sm.state.name)
            self.tracing.stage_finished(self, timing)

    # -- engine restarts (supervised servers) -------------------------------------------------
    def on_engine_exit(self, returncode: int) -> None:
        """The supervised server died: readiness goes false at once (PRELOAD)."""
        log.warning("engine server exited with code %s: back to PRELOAD until it is warm again", returncode)
        self.recorder.failure(FailureStats("server_crashed"))
        self.readiness.users_let_in = False    # also where PRELOAD -> PRELOAD is no transition
        if not self.sm.state.terminal:
            self._engine_crashed = True
            self.sm.transition(State.PRELOAD)

    def on_engine_ready(self) -> None:
        """The server answers: after a crash, warm it again through the same stages.
        (The supervisor also calls this at the first start, which run() handles.)"""
        if self._engine_crashed:
            self._engine_crashed = False
            self.recorder.life(LifeStats(restart="supervisor"))
            self._start_rewarm()

    def request_rewarm(self) -> bool:
        """Warm the engine again (POST /admin/rewarm): SERVING or DEGRADED -> PRELOAD,
        then the stages in a thread.  False when the state does not allow it."""
        if self.sm.state not in (State.SERVING, State.DEGRADED) or not self.sm.transition(State.PRELOAD):
            return False
        self._start_rewarm()
        return True

    def request_wake(self) -> tuple[bool, float | None]:
        """Wake a sleeping server and warm it (POST /admin/wake): whether a wake started,
        and the seconds the latest wake took to be warm (None before the first)."""
        if self.life is None:
            return False, None
        return self.life.request_wake(), self.life.warm_in_seconds()

    def ready_now(self) -> bool:
        """What /readyz answers (Readiness.ready)."""
        return self.readiness.ready()

    def _start_warm_behind(self) -> None:
        """After SERVING, once the agent stays (watch(), or a re-warm meanwhile): what prewarm
        left for later (prewarm.behind_users), in a thread, each request only while no user
        request is in flight.  A run that ends at SERVING (--once) leaves it unwarmed."""
        behind, self.context.warm_behind = self.context.warm_behind, None
        golden = self.golden if self.golden is not None and self.golden.answers is None else None
        if (behind is None and golden is None) or self.sm.state != State.SERVING:
            return

        t0 = time.perf_counter()
        self.recorder.behind_users(pending=True)

        def run() -> None:
            try:
                time.sleep(QUIET_SECONDS)      # a user who arrives with SERVING goes first
                if golden is not None:         # the warmed model's answers, asked again after a wake or restart
                    self._users_quiet()
                    golden.record()
                if behind is None:
                    return
                done = behind(self._users_quiet, lambda: self.readiness.users_in_flight > 0)
            except AgentFailure as e:      # draining, stopped, or no longer SERVING: nothing more to warm
                log.info("warm-up behind the users stopped: %s", e.message or e.reason)
                return
            except EngineError as e:         # the pod serves on; the watch judges the server
                log.warning("warm-up behind the users stopped: %s: %s", e.reason, e.message)
                return
            except Exception:  # noqa: BLE001 - the pod serves; a bug in the background warm-up is logged
                log.exception("warm-up behind the users failed; the pod serves on")
                return
            finally:
                self.recorder.behind_users(pending=False, seconds=time.perf_counter() - t0)
            log.info("warmed behind the users in %.2f s after SERVING: %d path(s), %d prompt length(s), "
                     "%d batch(es) stopped for a user's request and sent again", done.get("seconds", 0.0),
                     len(done.get("paths", ())), len(done.get("lengths", ())), done.get("stopped_for_users", 0))
        threading.Thread(target=run, name="warm-behind", daemon=True).start()

    def let_users_in(self, why: str = f"{EACH_LENGTH_PAYS}; discovery's request paid the start's one-time cost"
                     ) -> Callable[[], None]:
        """Users held at a start or a wake go to the server now; returns the warm-up's wait for them
        (until SERVING: then the watch's own rule decides)."""
        log.info("%d user request(s) held: let in before SERVING (%s)", self.readiness.users_in_flight, why)
        self.readiness.users_let_in = True
        return self._users_done

    def _users_first_on_rewarm(self, wake: bool) -> None:
        """A restart or a wake is a start: held users are let in as at the first start, after the
        golden answers.  Where a server reloads on a request (llama.cpp) and warming a prompt length
        spares nothing, the golden answers' requests pay a wake's reload, then users go in, before
        the warm-up."""
        if not (self.cfg.proxy.listen and not self.cfg.proxy.fallback_url):
            return
        paid = "the wake" if wake else "the restart's one-time cost"

        def after_golden(why: str = f"{EACH_LENGTH_PAYS}; discovery's request paid {paid}") -> Callable[[], None]:
            self._check_golden()
            self.context.let_users_in = None
            return self.let_users_in(why)
        self.context.let_users_in = after_golden
        kind = self.life.signals.kind if self.life is not None else None
        if (wake and kind is not None and kind.wakes_on_request and not self.context.length_warmup_pays
                and self.golden is not None and self.golden.answers is not None):
            self.context.users_first = after_golden("warming a prompt length spares a user nothing on this server; "
                                                    "the golden answers' requests paid the wake's reload")

    def _users_done(self) -> None:
        deadline = time.monotonic() + LET_IN_WAIT_SECONDS
        while self.readiness.users_let_in and self.readiness.users_in_flight > 0 and time.monotonic() < deadline:
            self.context.checkpoint()
            time.sleep(LET_IN_POLL_SECONDS)

    def _users_quiet(self) -> None:
        """Wait until no user request is in flight: the proxy's, the server log's, the server's own."""
        while True:
            self.context.checkpoint()
            if self._stopped:
                raise AgentFailure("stopped", "the agent stops")
            if self.sm.state != State.SERVING:   # asleep, degraded or re-warming: that warm-up decides
                raise AgentFailure("left_serving", f"the pod is {self.sm.state.name}")
            if (self.readiness.users_in_flight == 0 and self.engine.others_served_within(QUIET_SECONDS) is None
                    and not self._server_busy()):
                return
            time.sleep(QUIET_POLL_SECONDS)

    def _server_busy(self) -> bool:
        """Whether the server's /metrics count a request running or waiting (read within 0.25 s)."""
        signals = self.engine.server_signals()
        stats = signals.water_level(timeout=0.25) if signals is not None else None
        if stats is None:
            return False
        return (stats.requests_running or 0) + (stats.requests_waiting or 0) > 0

    def _check_golden(self) -> None:
        """Before a re-warm: the server must answer as the model the pod warmed did (once)."""
        if self.golden is None or self._golden_checked:
            return
        self._golden_checked = True
        t0 = time.perf_counter()
        problem = self.golden.check()
        log.info("golden answers checked in %.0f ms: %s", (time.perf_counter() - t0) * 1000,
                 "they differ" if problem else "as warmed")
        if problem is not None:
            cause = "wake" if self.life is not None and self.life.wake is not None else "restart"
            self.context.fail(f"wrong_answer_after_{cause}", problem)

    def _rewarm_cold(self, why: str) -> None:
        """The server is cold again (a restart, a wake): PRELOAD, then the stages again."""
        if self.sm.transition(State.PRELOAD):
            log.info("re-warm (%s)", why)
            self._start_rewarm()

    def request_drain(self) -> Literal["started", "already", "refused"]:
        """Stop taking traffic (POST /admin/drain): "started" when the agent moved to
        DRAINING now, "already" when it was draining, "refused" when the state
        machine does not allow it from the current state."""
        if self.sm.state == State.DRAINING:
            return "already"
        return "started" if self.sm.transition(State.DRAINING) else "refused"

    @property
    def state_name(self) -> str:
        return self.sm.state.name

    def _start_rewarm(self) -> None:
        threading.Thread(target=self.rewarm, name="rewarm", daemon=True).start()

    def rewarm(self) -> State:
        if self.sm.state != State.PRELOAD:
            return self.sm.state
        self._boundary = self.clock()  # the re-warm's stages start now, not where the first run ended
        self.context.let_users_in = self.context.users_first = None
        self.readiness.users_let_in = False
        self.sm.start_watchdog()       # PRELOAD and PRIME deadlines hold for a re-warm too
        self._golden_checked = False
        try:
            wake = self.life is not None and self.life.wake is not None
            if self.life is not None and wake:
                self.life.wake_server()    # a server woken ahead by its own wake call (vLLM)
            self._users_first_on_rewarm(wake)
            self.prewarm()
            self._check_golden()       # the server is up again here, whatever restarted it
            self.solidify()
            self.ready()
            if self.life is not None and self.sm.state == State.SERVING:
                self.life.remember_identity()   # the process just warmed: a restart from now on is news
            self._start_warm_behind()
        except AgentFailure as e:
            log.error("re-warm failed: %s: %s", e.reason, e.message)
        finally:
            self.sm.stop_watchdog()
        return self.sm.state

    # -- after SERVING -----------------------------------------------------------------------
    def watch(self, interval: float) -> None:
        """Keep probing after SERVING so the window (and its gauges) stays current.
        The breaker runs here: while it is open the main engine is not probed
        (frozen); once the freeze is over, probes are its half-open probes."""
        signals = self.engine.server_signals()
        if signals is not None and self.life is None:
            signals.timeout = self.readiness.probe_timeout   # a read waits as long as a probe would
            sleeps = self.cfg.openai.server_sleeps
            self.life = ServerLife(signals, self.sm, self.readiness, self.context.recorder,
                                   sleeps_when_idle=sleeps == "yes" or (sleeps == "auto" and self.engine.sleeps_when_idle()),
                                   ready_while_asleep=self.cfg.readiness.ready_while_asleep,
                                   has_fallback=bool(self.cfg.proxy.fallback_url), clock=self.clock,
                                   # the proxy holds users while a wake is warmed (proxy.hold_seconds)
                                   holds_users=bool(self.cfg.proxy.listen) and self.cfg.proxy.hold_seconds > 0)
            self.life.start_rewarm = self._rewarm_cold
            self.readiness.life = self.life
            self.life.remember_identity()
            self.golden = GoldenAnswers(signals.url)   # recorded behind the users (_start_warm_behind)
        if interval > 0:
            self._watch_interval = interval
            self._watch = Periodic(interval, self._watch_probe, "readiness-watch")
            self._watch.start()
        self._start_warm_behind()      # the agent stays: what prewarm left for later goes on now

    def _watch_probe(self) -> None:
        rd = self.readiness
        if self.life is not None:
            action = self.life.watch()    # reads that give the server no task
            if action == "wait" and self.life.unhealthy:
                action = self._await_comeback()
            if action == "rewarm":
                self._rewarm_cold("the server is cold")
            if action != "probe":
                return
        late = self._probe_thread
        if late is not None and late.is_alive():
            return     # a probe that timed out still waits for its answer: never two at once
        if not rd.due_probe() or self._server_busy_with_others():
            return
        # Half-open: the probes back to back, so a server that answers again is back
        # in its Service as soon as they pass, not one watch interval per probe.
        for _ in range(rd.breaker.half_open_probes if rd.breaker.state == BreakerState.HALF_OPEN else 1):
            if not self._one_watch_probe() or rd.breaker.state != BreakerState.HALF_OPEN:
                return

    def _await_comeback(self) -> Action:
        """Until the next watch tick, poll the down server's /health: a server back (a sidecar
        restarted) is warmed again now, not a watch interval later.  The watch's action then."""
        assert self.life is not None
        deadline = time.monotonic() + self._watch_interval - COMEBACK_POLL_SECONDS
        while time.monotonic() < deadline and not self._stopped and not self.sm.state.terminal:
            time.sleep(COMEBACK_POLL_SECONDS)
            if self.life.signals.health() is None:
                return self.life.watch()
        return "wait"

    def _one_watch_probe(self) -> bool:
        """One probe after SERVING; a failure other than a timeout is confirmed at once
        by a second probe, whose outcome counts: a server killed while it answered a
        probe cuts that answer short (a "bad answer") and refuses the next connection
        (unreachable, the cause that matters), and a single error a retry does not
        repeat leaves the pod in its Service.  True when the (last) probe answered."""
        error = self._send_watch_probe()
        if error is None:
            return True
        cause = failure_cause(error)[0] if isinstance(error, BaseException) else "timeout"
        if cause not in ("timeout", "unreachable"):
            self.readiness.count_probe_failure(cause)
            log.debug("probe after SERVING failed (%s): %s; probing again at once", cause, error)
            error = self._send_watch_probe()
            if error is None:
                return True
        if isinstance(error, BaseException):
            self.readiness.probe_failed(error)
        else:
            self.readiness.probe_failure("timeout", error)
        return False

    def _send_watch_probe(self) -> BaseException | str | None:
        """One probe on a thread of its own, so that a server that stops answering is
        judged after readiness.watch_probe_timeout_seconds, not after the engine's
        request timeout.  None when it answered, its exception when it failed, a
        message when it timed out.  The failure goes to the breaker with its reason
        (Readiness.probe_failed), which logs one line per change, never a traceback."""
        done = threading.Event()
        failed: list[BaseException] = []
        timed_out = threading.Event()

        length = self._watch_length()

        def send() -> None:
            try:
                self.context.probe(decode=False, still_wanted=lambda: not timed_out.is_set(), length=length)
            except Exception as e:  # noqa: BLE001 - a failed probe must not end the agent
                failed.append(e)
            finally:
                done.set()
        thread = self._probe_thread = threading.Thread(target=send, name="readiness-probe", daemon=True)
        thread.start()
        timeout = self.readiness.probe_timeout
        if not done.wait(timeout):
            timed_out.set()
            return f"no answer to a probe within {timeout:g} s"
        return failed[0] if failed else None

    def _watch_length(self) -> int | None:
        """The prompt length of the next watch probe: in turn each length users send (the
        learned profile), so that a quiet spell does not let their paths go cold; None
        (the probe length) before any user was seen."""
        traffic = self.readiness.traffic
        learned = traffic.profile.traffic_profile(prewarm.USERS_COVERAGE) if traffic is not None else None
        if learned is None or not learned.prompt_lengths:
            return None
        self._watch_turn += 1
        return learned.prompt_lengths[self._watch_turn % len(learned.prompt_lengths)]

    def _server_busy_with_others(self) -> bool:
        """Whether the supervised server took another client's request in the last two
        intervals, or twice the longest whole answer a probe measured if that is longer
        (engines/openai/server_traffic.py): the server logs a request when it starts, and a user's
        answer lasts about as long as the answers the agent timed. A probe then may wait
        behind a user's whole answer on a server that answers one at a time, and its
        figure would be that wait, which no user met. The breaker's half-open probes are
        always sent."""
        if self.readiness.breaker.state == BreakerState.HALF_OPEN:
            return False
        pause = 2 * max([self._watch_interval, *self.probe_log.totals])
        age = self.engine.others_served_within(pause)
        if age is None and (self.readiness.users_in_flight > 0 or self._server_busy()):
            age = 0.0    # a user's request in flight (the proxy's count, the server's own figures): it goes first
        if age is None:
            if self._watch_skipping:
                log.info("probes after SERVING resume: no other client's request in the server's log for %.1fs", pause)
                self._watch_skipping = False
            return False
        if not self._watch_skipping:
            log.info("probes after SERVING pause while the server serves other clients (a request %.1fs ago, or "
                     "one in flight): a probe would time the wait behind their answers", age)
            self._watch_skipping = True
        self.context.watch_skipped += 1
        return True

    def stop(self) -> None:
        self._stopped = True       # the warm-up behind the users sends nothing more
        # Wait for a probe in flight: a daemon thread still inside a forward pass when
        # the interpreter finalises aborts the process ("terminate called without an
        # active exception", exit -6) instead of the drain's exit 0.
        if self._watch is not None:
            self._watch.stop(timeout=30)
        probe = self._probe_thread
        if probe is not None:
            probe.join(30)
        self.memory.stop()
        if self.readiness.traffic is not None:
            self.readiness.traffic.stop()      # saved, and shared
        self.sm.stop_watchdog()
        cache = self.context.kernel_cache
        if cache is not None:
            cache.close()  # its Redis connection and invalidation listener

    def _traffic_memory(self) -> TrafficMemory:
        """The learned traffic profile of this model: kept in data_dir/traffic, shared
        through the kernel cache's Redis where it has one and a secret."""
        from warmup_agent.kernel_cache.shared_findings import SharedFindings
        from warmup_agent.readiness.traffic_memory import TrafficMemory
        name = os.path.basename((self.engine.model_path or self.cfg.engine).rstrip("/")) or self.cfg.engine
        key = re.sub(r"[^A-Za-z0-9._-]", "_", name)
        return TrafficMemory(os.path.join(self.cfg.data_dir, "traffic", key), self.recorder,
                             SharedFindings.from_config(self.cfg.kernel_cache), shared_key=key).start()

    # -- reporting ---------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        self.recorder.build(BuildInfo(__version__, platform.python_version(), _module_version("torch"),
                                      self.cfg.engine))
        # The state machine and readiness declare their own series; the server's life here.
        self.recorder.declare_series(Known(life=True))
        self.recorder.live(LiveGauges(memory_jitter=self.memory.ratio, cost=self.cost_ratio))

    def cost_ratio(self) -> float:
        up = self.clock() - self.started
        return self.driver.engine_seconds() / up if up > 0 else 0.0

    def status(self) -> dict:
        """What /startupz shows (stages/record.py), with what /readyz answers."""
        status = {**self.run_record.status(), "ready": self.readiness.ready()}
        if self.life is not None:
            status["server"] = {"sleeps_when_idle": self.life.sleeps_when_idle,
                                "last_wake_seconds": self.life.last_wake_seconds}
        return status

    def record(self) -> dict:
        """The run as JSON (`--record`; stages/record.py)."""
        return self.run_record.record()


def preload_deadline(deadlines: DeadlinesSection, openai: OpenaiSection, engine: str, preload_set: bool) -> float:
    """deadlines.preload_seconds; left at its default (`preload_set` False) with a
    server engine (`engine`: the engine key, anything but torch), PRELOAD also covers
    the server's own start-up, so openai.ready_timeout_seconds is added."""
    seconds = deadlines.preload_seconds
    if engine != "torch" and not preload_set and seconds:
        seconds += openai.ready_timeout_seconds
    return seconds


def _module_version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return "none"
