"""What the four stages share, declared in one place (issues 17, 24).

The Agent (pipeline.py) creates one `StageContext` and owns it as
`agent.context`; every stage is called as `run(ctx, detail)` with it and sees
nothing else of the Agent.  It carries
  - the collaborators: the configuration (typed sections, `ctx.cfg.prewarm.x`),
    the engine, the engine driver (driver.py: the engine lock, `send`, probe
    prompts), the state machine, readiness, the probe log (readiness/probes.py), the
    recorder (exporter/recorder.py: the stages fill its stats records, it alone
    turns them into metrics; no stage sets a metric) and the progress display;
  - the run services the stages call: `checkpoint`, `fail`, `move` and `probe`;
  - the stage outputs: a stage hands later stages (and the run record) what it
    found through these fields and nothing else: no stage sets attributes of
    the Agent (tests/test_stage_seams.py checks it).
It lives as long as the Agent, so a re-warm (prewarm, solidify and ready again
after an engine restart) still sees what reserve found on the first run.

`detail` is the stage's own part of the run record (StageTiming.detail); the
stages fill it as they go rather than return it, so that a stage that fails
half-way still records what it had measured (the reservation that did not fit,
the validation check that failed).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

from exporter.recorder import WindowStats
from warmup_agent.errors import AgentFailure
from warmup_agent.readiness.probes import Probe
from warmup_agent.states import State
from warmup_agent.warmup.benefit import Controlled

if TYPE_CHECKING:  # types only: the sampler and the cache are imported where they are made
    from exporter.recorder import Recorder
    from warmup_agent.config_sections import (
        GpuSection,
        KernelCacheSection,
        ModelSection,
        PrewarmSection,
        ReadinessSection,
        ReserveSection,
        SolidifySection,
        ValidationSection,
    )
    from warmup_agent.driver import EngineDriver
    from warmup_agent.engines.base import Engine
    from warmup_agent.gpu.ramp import RampSampler
    from warmup_agent.host.hardware import GPUFacts
    from warmup_agent.kernel_cache import KernelCache
    from warmup_agent.readiness.probes import ProbeLog
    from warmup_agent.readiness.runtime import Readiness
    from warmup_agent.run.progress import Progress
    from warmup_agent.states import StateMachine
    from warmup_agent.warmup.traffic import TrafficProfile


@dataclass(frozen=True)
class StageSettings:
    """The configuration sections the stages read, and nothing else of the Config
    (issue 42: only the command line and the composition root see all of it; the Agent
    hands these over)."""
    prewarm: PrewarmSection
    readiness: ReadinessSection
    validation: ValidationSection
    model: ModelSection
    solidify: SolidifySection
    reserve: ReserveSection
    gpu: GpuSection
    kernel_cache: KernelCacheSection
    data_dir: str
    engine: str


@dataclass(eq=False)
class StageContext:
    # -- the collaborators (the Agent hands them over at construction) ----------------
    cfg: StageSettings
    engine: Engine
    driver: EngineDriver
    sm: StateMachine
    readiness: Readiness
    probe_log: ProbeLog
    recorder: Recorder
    progress: Progress

    # -- the stage outputs -----------------------------------------------------------
    #: reserve: the host's facts (hardware.HostFacts.as_dict()); the run record's `host`.
    host_facts: dict = field(default_factory=dict)
    #: prewarm: the engine's facts (EngineFacts as a dict); /startupz `engine`, the
    #: run record's `engine_facts`.
    engine_facts: dict = field(default_factory=dict)
    #: prewarm, engines that speak the traffic profile: the traffic it warmed; the
    #: readiness probes are requests of it.  None: token-id probes.
    profile: TrafficProfile | None = None
    #: reserve: the NVML GPU behind the engine's CUDA device; None on a CPU run (or
    #: when the device is not a visible GPU).  prewarm samples its utilisation ramp,
    #: solidify labels the CUDA-graph and ramp gauges with it.
    gpu: GPUFacts | None = None
    #: reserve: the GPU's free bytes once the reservation plan fit; prewarm derives
    #: batch sizes from it (prewarm.batch_sizes_from_memory).  None: not measured.
    gpu_free_bytes: int | None = None
    #: prewarm starts the NVML utilisation sampler on a GPU; solidify stops it and
    #: records the slope.  None: not sampling.
    ramp: RampSampler | None = None
    #: prewarm: the (prompt_length, batch) shapes it warmed; solidify freezes them.
    warmed_shapes: list[tuple[int, int]] = field(default_factory=list)
    #: solidify: the kernel cache it opened (a re-warm closes the previous one);
    #: Agent.stop() closes it.  None: not opened (solidify.mode none, or nothing to share).
    kernel_cache: KernelCache | None = None
    #: prewarm, engines that speak the traffic profile: what was warmed (source,
    #: endpoints, families, lengths); the run record's `traffic_profile`.
    profile_summary: dict | None = None
    #: prewarm, engines that speak the traffic profile: the measured-benefit warmup's
    #: summary (budget, per-length finding, paths warmed and skipped, with why);
    #: /startupz shows it.  None: not run.
    warmup_summary: dict | None = None
    #: prewarm: the prompt length of the readiness probes, a profile length no
    #: warmup request used (a user's first request meets an unwarmed length too).
    #: None: readiness.probe_prompt_length.
    probe_length: int | None = None
    #: prewarm, engines that speak the traffic profile: the (prompt, prompt + answer)
    #: tokens of every warmup request, and the profile's prompt lengths it warmed;
    #: ready predicts the first user's whole answer from them (readiness/cold_decode.py).
    decoded_ranges: list[tuple[int, int]] = field(default_factory=list)
    profile_lengths: list[int] = field(default_factory=list)
    #: prewarm: output tokens of the first readiness probe (the profile's longest
    #: answer).  None: readiness.probe_max_tokens like the others.
    first_probe_tokens: int | None = None
    #: prewarm: given a probe's prompt length and requests at once, what re-sends the
    #: last warmup requests before the first probe's control: with a server engine unless
    #: they were the probe's own shape (prewarm's replay_before_probe_control), with the
    #: in-process engines where they were a harder predecessor; None from it: no replay.
    replay_for: Callable[[int, int], Callable[[], None] | None] | None = None
    #: prewarm, engines that speak the traffic profile: sends the settle request (one
    #: short request, alone), after the warmup and again just before SERVING, so that the
    #: first probe and the users' first request follow the same.
    settle: Callable[[], None] | None = None
    #: the command line, where the torch engine answers users through --proxy-listen: one
    #: request through the users' own path (proxy/user_path.py), which ready sends just
    #: before SERVING; returns what it took.  None: no such path.
    user_path_request: Callable[[], dict] | None = None
    #: prewarm, engines that speak the traffic profile: the gate's first probe pairs
    #: (`probe_pair`'s dicts), sent as the per-length test's fresh prompt lengths: the
    #: probes double as the last warmup and the warmup's last test doubles as the first
    #: pairs.  ready goes on from them instead of sending its own (and clears them).
    #: Empty: ready sends the first pair.
    first_pairs: list[dict] = field(default_factory=list)
    #: prewarm: this server was measured before and each new prompt length paid in
    #: prefill (warmup/findings.py), so the gate's first probe went alone, with no
    #: control and no second pair: ready sends no pair, and that probe makes the window.
    first_probe_alone: bool = False
    #: after SERVING: watch probes not sent because the supervised server was serving
    #: other clients (Agent._server_busy_with_others); the run record's `watch_probes_skipped`.
    watch_skipped: int = 0

    # -- the run services the stages call ----------------------------------------------
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

    def probe(self, decode: bool = True, max_tokens: int | None = None,
              still_wanted: Callable[[], bool] | None = None) -> float:
        """One readiness probe, recorded; returns its time to first token.  With an
        engine that speaks the traffic profile the probe is a request as a user
        sends it: the profile's endpoint and sampling, a prompt of `probe_length`
        tokens that no earlier request began with, `max_tokens` output tokens
        (default readiness.probe_max_tokens); else a prompt of token ids.
        decode=False (the probes after SERVING): one output token.  The breaker
        judges time to first token only, and 16 decoded tokens every 5 s took 12.5 %
        of a server pod's engine time, which kept warmup_cost_ratio over its alert
        threshold on a healthy pod.  `still_wanted`: asked when the answer comes; False
        drops it (a watch probe that timed out was judged already)."""
        rc = self.cfg.readiness
        tokens = (max_tokens or rc.probe_max_tokens) if decode else 1
        r = self.driver.send_probe(self.profile, self.probe_length or rc.probe_prompt_length, tokens)
        if still_wanted is not None and not still_wanted():
            return r.first_token_seconds    # answered after its watch timeout: already judged a failure
        probe = Probe(r.first_token_seconds, r.total_seconds, r.output_tokens, r.prompt_tokens, r.server_prefill_seconds)
        self.record_probe(r.first_token_seconds, probe=probe)
        if self.probe_log.add_decode(probe):
            self.recorder.decode_window(WindowStats(self.probe_log.decode.quantiles()))
        return r.first_token_seconds

    def probe_pair(self, probe: Callable[[int | None], object], tokens: int | None,
                   replay: bool) -> tuple[Controlled, dict]:
        """A first probe and its control (benefit.Controlled): the same shape, a fresh
        prompt, after the same predecessor: with `replay`, the last warmup requests are
        re-sent between them where `replay_for` says so.  `probe(max_tokens)` sends one
        probe (the ready stage's counts them for its progress line).  The first-request
        figures are this pair's (readiness/probes.py).  Returns the pair and its dict
        for the record."""
        at = len(self.probe_log.gate_probes)
        probe(tokens)
        length = self.probe_length or self.cfg.readiness.probe_prompt_length
        again = self.replay_for(length, 1) if replay and self.replay_for is not None else None
        before = self.driver.warmup_requests
        if again is not None:
            again()
        probe(tokens)
        pair = self.probe_log.pair(at, at + 1)
        return pair, {**pair.as_dict(), "cold": pair.cold(self.cfg.prewarm.converge_tolerance),
                      "replayed_requests": self.driver.warmup_requests - before}

    def record_probe(self, ttft: float, kind: str = "probe", probe: Probe | None = None) -> None:
        """One time-to-first-token sample of the main engine: a probe, or (kind="user")
        a real request through the proxy.  It feeds the window, the adaptive
        thresholds and the breaker (readiness/runtime.py, which also sets the window
        gauges); only probes are kept in the probe log (user traffic would grow it
        without bound)."""
        if kind == "probe":
            self.probe_log.add(probe or Probe(ttft, ttft, 1))
        self.readiness.first_token(ttft)
