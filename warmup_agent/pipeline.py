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
import platform
import threading
import time
from dataclasses import dataclass, field
from typing import Literal, NoReturn

from exporter.metrics import AgentMetrics
from warmup_agent import __version__, tracing
from warmup_agent.engines.base import Engine
from warmup_agent.errors import EngineError, ReasonedError
from warmup_agent.memory import MemorySampler
from warmup_agent.probes import Probe, ProbeLog
from warmup_agent.progress import Progress, coldstart
from warmup_agent.readiness.runtime import Readiness, percentile_label
from warmup_agent.readiness.window import SlidingWindow
from warmup_agent.stages import prewarm, ready, reserve, solidify
from warmup_agent.stages.context import StageContext
from warmup_agent.states import State, StateMachine
from warmup_agent.traffic import PromptFactory, TrafficProfile

log = logging.getLogger("warmup_agent.pipeline")

STAGES = ("reserve", "prewarm", "solidify", "ready")


class AgentFailure(ReasonedError):
    """The warmup failed (or stopped: reason "draining") with a named reason; the
    state machine is FAILED or DRAINING."""


@dataclass
class StageTiming:
    name: str
    phase: int
    start: float                 # seconds since the clock origin (process start from the CLI)
    end: float | None = None
    status: str = "running"      # running | ok | failed
    detail: dict = field(default_factory=dict)

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start


class Agent:
    def __init__(self, cfg, engine: Engine, metrics: AgentMetrics | None = None,
                 progress: Progress | None = None, clock=time.perf_counter,
                 process_started: float | None = None):
        self.cfg = cfg
        self.engine = engine
        self.metrics = metrics or AgentMetrics()
        self.progress = progress or Progress(enabled=False)
        self.clock = clock
        self.sm = StateMachine(self.metrics, clock=clock, deadlines={
            State.INIT: cfg["deadlines.init_seconds"],
            State.PRELOAD: preload_deadline(cfg),
            State.PRIME: cfg["deadlines.prime_seconds"],
        })
        # Readiness owns the time-to-first-token window, the thresholds, the breaker
        # and the water level, and alone sets their gauges (zero series from the start).
        self.readiness = Readiness(cfg, self.sm, self.metrics, clock=clock)
        # Decode beside the first token (issue 19): time per output token of the
        # probes, and each probe's whole-answer time (the first-request tax on it).
        self.tpot_window = SlidingWindow(cfg["readiness.window_size"])
        # Every probe, and the first-request figures computed once from them (probes.py).
        self.probe_log = ProbeLog()
        self.profile: TrafficProfile | None = None   # prewarm, engines that speak the profile (openai)
        self.memory = MemorySampler()
        self.stages: list[StageTiming] = []
        self.context = StageContext()  # what the stages share (stages/context.py); lives as long as the agent
        self.started = clock()        # the zero of every timestamp we record (see run())
        self._boundary = self.started
        # When the process started, on `clock` (procstart.process_started()); the CLI
        # passes it so that a first run's imports and model creation are counted.
        self.process_started = process_started
        self.startup: StageTiming | None = None
        self.serving_at: float | None = None
        self.warmup_requests = 0
        self.host_facts: dict = {}
        self.engine_facts: dict = {}
        self.prompts: PromptFactory | None = None   # made by prewarm once the tokenizer is loaded
        # The last batch send() got back (probe() reads a 1-token probe's whole answer from it).
        self.last_results: list = []
        # The engine lock (public: stages take it around their own engine calls).  Held
        # around each call into the loaded engine: a warmup batch or probe (send,
        # send_requests), solidify, the validation checks and the fingerprint before
        # SERVING.  So those calls never overlap: the watch thread's probes after
        # SERVING and a re-warm's stages take turns at the engine.
        self.engine_lock = threading.Lock()
        self._watch_stop = threading.Event()
        self._watch_thread: threading.Thread | None = None   # watch() starts it after SERVING
        self._engine_crashed = False
        self._probe_seq = 0
        self.tracing = tracing.active()   # start-up traces (tracing.py); NOOP unless the CLI set one up
        self._init_metrics()

    @property
    def probes(self) -> list[float]:
        """Time to first token of every probe so far, in order."""
        return self.probe_log.ttfts

    @property
    def probe_totals(self) -> list[float]:
        """Whole-answer time of every probe so far, in order."""
        return self.probe_log.totals

    @property
    def first_request_seconds(self) -> float | None:
        figures = self.probe_log.figures
        return None if figures is None else figures.ttft_seconds

    @property
    def window(self) -> SlidingWindow:
        """The readiness window of time-to-first-token samples (owned by `readiness`)."""
        return self.readiness.window

    # -- the pipeline ----------------------------------------------------------------------
    def run(self) -> State:
        """Run the four stages; return the final state (SERVING or FAILED)."""
        # The zero of every recorded time is the start of the process when it is
        # known (the CLI), else the call to run().  The time before run() is the
        # "startup" stage (phase 0): interpreter, torch/transformers imports, the
        # embedded model's creation, engine set-up.  Startup plus the four stage
        # durations add up to the time from that zero to SERVING.
        run_at = self.started = self._boundary = self.clock()
        self.tracing.run_started(self)
        if self.process_started is not None and self.process_started < run_at:
            self.started = self.process_started
            startup = run_at - self.started
            self.startup = StageTiming("startup", 0, start=0.0, end=startup, status="ok")
            self.progress.startup_finished(startup)
            coldstart("completed", "startup", 0, duration=round(startup, 6), state=self.sm.state.name)
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
            reserve.run(self, self.context, timing.detail)

    def prewarm(self) -> None:
        with self._stage("prewarm", 2) as timing:
            prewarm.run(self, self.context, timing.detail)

    def solidify(self) -> None:
        with self._stage("solidify", 3) as timing:
            solidify.run(self, self.context, timing.detail)

    def ready(self) -> None:
        with self._stage("ready", 4) as timing:
            ready.run(self, self.context, timing.detail)
            if self.sm.state == State.SERVING:
                self.serving_at = self.clock()
                self.metrics.warmup_time_to_ready_seconds.set(self.serving_at - self.started)

    # -- helpers the stages use --------------------------------------------------------------
    @contextlib.contextmanager
    def _stage(self, name: str, phase: int):
        timing = StageTiming(name, phase, start=self._boundary - self.started)
        self.stages.append(timing)
        self.progress.stage_started(phase, len(STAGES), name)
        coldstart("started", name, phase, state=self.sm.state.name)
        try:
            self.checkpoint()
            yield timing
            self.checkpoint()
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
            end = self.clock()
            timing.end = end - self.started
            duration = timing.end - timing.start   # timing.duration, now that it has ended
            self._boundary = end
            self.metrics.model_loading_phase_duration_seconds.labels(phase=name).set(duration)
            self.metrics.warmup_stage_duration_seconds.labels(stage=name).observe(duration)
            self.progress.stage_finished(name, duration, ok=timing.status == "ok")
            coldstart("completed" if timing.status == "ok" else "failed", name, phase,
                      duration=round(duration, 6), state=self.sm.state.name)
            self.tracing.stage_finished(self, timing)

    def checkpoint(self) -> None:
        """Raise AgentFailure if the machine failed (a deadline, say) or started
        draining (a signal) while a stage was working."""
        if self.sm.state == State.FAILED:
            raise AgentFailure(self.sm.failure_reason or "failed", self.sm.failure_message or "")
        if self.sm.state == State.DRAINING:
            raise AgentFailure("draining", "stopped by a signal")

    def fail(self, reason: str, message: str) -> NoReturn:
        self.sm.fail(reason, message)
        raise AgentFailure(reason, message)

    def move(self, to: State) -> None:
        """Transition to `to`; already being there is fine (a re-warm after an
        engine restart starts in PRELOAD)."""
        if self.sm.state == to:
            return
        if not self.sm.transition(to):
            self.checkpoint()
            raise AgentFailure("illegal_transition", f"{self.sm.state.name} -> {to.name} is not allowed")

    def send(self, prompts: list[list[int]], kind: str, max_new_tokens: int = 1) -> float:
        """Send one batch to the engine as agent traffic; return its time to first token.
        Counted in warmup_requests_total{kind} and the engine-seconds behind warmup_cost_ratio."""
        with self.engine_lock:
            t0 = time.perf_counter()
            results = self.engine.generate(prompts, max_new_tokens=max_new_tokens, warmup=True)
            busy = time.perf_counter() - t0
        self.last_results = results
        ttft = max(r.first_token_seconds for r in results)
        self.metrics.warmup_requests_total.labels(kind=kind).inc(len(prompts))
        self.metrics.warmup_first_token_latency_seconds.labels(kind=kind).observe(ttft)
        self.metrics.warmup_engine_seconds_total.labels(kind=kind).inc(busy)
        if kind == "warmup":
            self.warmup_requests += len(prompts)
        return ttft

    def send_requests(self, requests: list, kind: str) -> list:
        """One batch of traffic-profile requests (traffic.WarmRequest) as agent
        traffic, for engines that speak the profile (openai); counted like send()."""
        with self.engine_lock:
            t0 = time.perf_counter()
            results = self.engine.generate_requests(requests, warmup=True)
            busy = time.perf_counter() - t0
        ttft = max(r.first_token_seconds for r in results)
        self.metrics.warmup_requests_total.labels(kind=kind).inc(len(requests))
        self.metrics.warmup_first_token_latency_seconds.labels(kind=kind).observe(ttft)
        self.metrics.warmup_engine_seconds_total.labels(kind=kind).inc(busy)
        if kind == "warmup":
            self.warmup_requests += len(requests)
        return results

    def probe(self, decode: bool = True, max_tokens: int | None = None) -> float:
        """One readiness probe, recorded; returns its time to first token.  With an
        engine that speaks the traffic profile the probe is a request as a user
        sends it: the profile's endpoint and sampling, a prompt of self.probe_length
        tokens that no earlier request began with, `max_tokens` output tokens
        (default readiness.probe_max_tokens); else a prompt of token ids.
        decode=False (the probes after SERVING): one output token.  The breaker
        judges time to first token only, and 16 decoded tokens every 5 s took 12.5 %
        of a transformers-serve H200 pod's engine time, which kept
        warmup_cost_ratio over its alert threshold on a healthy pod."""
        if self.engine.speaks_profile and self.profile is not None:
            from warmup_agent.traffic import probe_request
            tokens = (max_tokens or self.cfg["readiness.probe_max_tokens"]) if decode else 1
            length = self.context.probe_length or self.cfg["readiness.probe_prompt_length"]
            r = self.send_requests([probe_request(self.profile, length, tokens)], "probe")[0]
        else:
            self.send([self.probe_prompt()], "probe")
            r = self.last_results[0]     # a 1-token probe: whole answer only
        self.record_probe(r.first_token_seconds, probe=Probe(r.first_token_seconds, r.total_seconds,
                                                             r.output_tokens, r.prompt_tokens))
        self.record_decode(r)
        return r.first_token_seconds

    def record_decode(self, r) -> None:
        """Time per output token of one probe: (total - first token) / (output
        tokens - 1), the interval between streamed tokens."""
        if r.output_tokens > 1:
            self.tpot_window.add((r.total_seconds - r.first_token_seconds) / (r.output_tokens - 1))
            for q, v in self.tpot_window.quantiles().items():
                self.metrics.warmup_time_per_output_token_window_seconds.labels(percentile=percentile_label(q)).set(v)

    def probe_prompt(self) -> list[int]:
        """A different prompt for every probe: an engine with prefix caching (vLLM)
        would otherwise skip the prefill of a repeated probe and look faster than
        real traffic."""
        self._probe_seq += 1
        assert self.prompts is not None, "prewarm makes the prompt factory before any probe"
        return self.prompts.prompt(self.cfg["readiness.probe_prompt_length"], variant=self._probe_seq)

    def record_probe(self, ttft: float, kind: str = "probe", probe: Probe | None = None) -> None:
        """One time-to-first-token sample of the main engine: a probe, or (kind="user")
        a real request through the proxy.  It feeds the window, the adaptive
        thresholds and the breaker (readiness/runtime.py, which also sets the window
        gauges); only probes are kept in the probe log (user traffic would grow it
        without bound)."""
        if kind == "probe":
            self.probe_log.add(probe or Probe(ttft, ttft, 1))
        self.readiness.observe(ttft)

    # -- engine restarts (supervised servers) -------------------------------------------------
    def on_engine_exit(self, returncode: int) -> None:
        """The supervised server died: readiness goes false at once (PRELOAD)."""
        log.warning("engine server exited with code %s: back to PRELOAD until it is warm again", returncode)
        self.metrics.model_loading_failures_total.labels(reason="server_crashed").inc()
        if not self.sm.state.terminal:
            self._engine_crashed = True
            self.sm.transition(State.PRELOAD)

    def on_engine_ready(self) -> None:
        """The server answers: after a crash, warm it again through the same stages.
        (The supervisor also calls this at the first start, which run() handles.)"""
        if self._engine_crashed:
            self._engine_crashed = False
            self._start_rewarm()

    def request_rewarm(self) -> bool:
        """Warm the engine again (POST /admin/rewarm): SERVING or DEGRADED -> PRELOAD,
        then the stages in a thread.  False when the state does not allow it."""
        if self.sm.state not in (State.SERVING, State.DEGRADED) or not self.sm.transition(State.PRELOAD):
            return False
        self._start_rewarm()
        return True

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
        self.sm.start_watchdog()       # PRELOAD and PRIME deadlines hold for a re-warm too
        try:
            self.prewarm()
            self.solidify()
            self.ready()
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
        if interval <= 0:
            return
        readiness = self.readiness

        def loop():
            while not self._watch_stop.wait(interval):
                if not readiness.due_probe():
                    continue
                try:
                    self.probe(decode=False)
                except Exception:  # noqa: BLE001 - a failed probe must not end the agent
                    log.exception("probe after SERVING failed")
        self._watch_thread = threading.Thread(target=loop, name="readiness-watch", daemon=True)
        self._watch_thread.start()

    def stop(self) -> None:
        self._watch_stop.set()
        # Wait for a probe in flight: a daemon thread still inside a forward pass when
        # the interpreter finalises aborts the process ("terminate called without an
        # active exception", exit -6) instead of the drain's exit 0.
        watch = self._watch_thread
        if watch is not None and watch is not threading.current_thread():
            watch.join(timeout=30)
        self.memory.stop()
        self.sm.stop_watchdog()
        cache = self.context.kernel_cache
        if cache is not None:
            cache.close()  # its Redis connection and invalidation listener

    # -- reporting ---------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        torch_version = _module_version("torch")
        self.metrics.warmup_build_info.info({
            "version": __version__, "python": platform.python_version(), "torch": torch_version,
            "engine": self.cfg["engine"]})
        # Known label values at 0 from the start (Prometheus practice): on-call reads
        # these first, and increase() or an absent() alert needs the series before the
        # first event, not from it.
        from warmup_agent.failures import REASONS
        from warmup_agent.states import illegal_pairs
        for reason in REASONS:
            self.metrics.model_loading_failures_total.labels(reason=reason)
        for frm, to in illegal_pairs():
            self.metrics.warmup_illegal_transitions_total.labels(**{"from": frm.name, "to": to.name})
        self.metrics.warmup_memory_jitter_ratio.set_function(self.memory.ratio)
        self.metrics.warmup_cost_ratio.set_function(self.cost_ratio)

    def cost_ratio(self) -> float:
        busy = sum(s.value for m in self.metrics.warmup_engine_seconds_total.collect()
                   for s in m.samples if s.name.endswith("_total"))
        up = self.clock() - self.started
        return busy / up if up > 0 else 0.0

    def status(self) -> dict:
        """What /startupz shows: state, current stage, elapsed and per-stage durations."""
        now = self.clock()
        current = next((s.name for s in reversed(self.stages) if s.status == "running"), None)
        remaining = self.sm.deadline_remaining()
        return {
            "state": self.sm.state.name,
            "stage": current,
            "elapsed_seconds": now - self.started,
            "startup_seconds": None if self.startup is None else self.startup.duration,
            "deadline_remaining_seconds": None if remaining is None else max(0.0, remaining),
            "stages": {s.name: {"phase": s.phase, "status": s.status, "start_seconds": s.start,
                                "duration_seconds": s.duration} for s in self.stages},
            "time_to_ready_seconds": None if self.serving_at is None else self.serving_at - self.started,
            "first_token_window_seconds": {percentile_label(q): v for q, v in self.window.quantiles().items()},
            "probes": len(self.probes),
            "engine": self.engine_facts,
            "breaker": self.readiness.breaker.state.value,
            "warmup": self.context.warmup_summary,
            "failure_reason": self.sm.failure_reason,
            "failure_message": self.sm.failure_message,
        }

    def record(self) -> dict:
        """The run as JSON (`--record`): stages with start/end, probes, final state."""
        fr = self.probe_log.figures
        return {
            "version": __version__,
            "engine": self.cfg["engine"],
            "model": self.engine.model_path,
            "host": self.host_facts,
            "engine_facts": self.engine_facts,
            "quantization": q.as_dict() if (q := self.engine.quantization) is not None else None,
            "started_unix": time.time() - (self.clock() - self.started),
            # process start to run(), when known; the stages start where it ends
            "startup_seconds": None if self.startup is None else self.startup.duration,
            "stages": [{"name": s.name, "phase": s.phase, "start_seconds": s.start, "end_seconds": s.end,
                        "duration_seconds": s.duration, "status": s.status, **s.detail} for s in self.stages],
            "time_to_ready_seconds": None if self.serving_at is None else self.serving_at - self.started,
            "warmup_requests": self.warmup_requests,
            "probes_seconds": list(self.probes),
            "probe_count": len(self.probes),
            # The first-request figures, frozen when the gate opened (probes.py)
            "first_request_seconds": None if fr is None else fr.ttft_seconds,
            "steady_first_token_seconds": None if fr is None else fr.steady_ttft_seconds,
            "first_request_tax_ratio": None if fr is None else fr.ttft_tax,
            "probe_total_seconds": list(self.probe_totals),
            "first_request_total_seconds": None if fr is None else fr.total_seconds,
            "steady_total_seconds": None if fr is None else fr.steady_total_seconds,
            "first_request_total_tax_ratio": None if fr is None else fr.total_tax,
            "first_request_prompt_tokens": None if fr is None else fr.prompt_tokens,
            "first_request_output_tokens": None if fr is None else fr.output_tokens,
            "time_per_output_token_window_seconds": {percentile_label(q): v for q, v in self.tpot_window.quantiles().items()},
            "traffic_profile": self.context.profile_summary,
            # The thresholds in force, as warmup_readiness_threshold_seconds shows them
            # (adaptive: the last re-fit), and the configured ceiling they came from.
            "readiness_thresholds_seconds": self.readiness.thresholds_in_force(),
            "readiness_thresholds_configured_seconds": self.readiness.thresholds_configured(),
            "final_state": self.sm.state.name,
            "failure_reason": self.sm.failure_reason,
            "failure_message": self.sm.failure_message,
            "transitions": [{"state": s.name, "at_seconds": t - self.started} for s, t in self.sm.history],
            "trace_id": self.tracing.trace_id,   # the start-up trace (tracing.py); null when tracing is off
        }


def preload_deadline(cfg) -> float:
    """deadlines.preload_seconds; left at its default with a server engine, PRELOAD
    also covers the server's own start-up, so openai.ready_timeout_seconds is added."""
    seconds = cfg["deadlines.preload_seconds"]
    if cfg["engine"] != "torch" and cfg.sources.get("deadlines.preload_seconds") == "default" and seconds:
        seconds += cfg["openai.ready_timeout_seconds"]
    return seconds


def _module_version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return "none"
