"""What the four stages share.

The Agent creates one `StageContext` and every stage is called as `run(ctx, detail)`
with it; a stage sees nothing else of the Agent.  It holds the collaborators, the run
services (`checkpoint`, `fail`, `move`, `probe`) and the stage outputs: a stage hands
later stages what it found through these fields only.  It lives as long as the Agent,
so a re-warm after an engine restart still sees what reserve found.

`detail` is the stage's part of the run record; stages fill it as they go so that a
stage that fails half-way still records what it measured.
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
    """The configuration sections the stages read; only the composition root sees the
    whole Config."""
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
    #: prewarm: the warm-up left for after SERVING (ProfileWarmup.warm_behind), or None.
    warm_behind: Callable[[Callable[[], None], Callable[[], bool]], dict] | None = None
    #: reserve: hardware.HostFacts.as_dict().
    host_facts: dict = field(default_factory=dict)
    #: prewarm: EngineFacts as a dict.
    engine_facts: dict = field(default_factory=dict)
    #: prewarm: the traffic it warmed; probes are requests of it.  None: token-id probes.
    profile: TrafficProfile | None = None
    #: reserve: the NVML GPU behind the engine's device.  None: no visible GPU.
    gpu: GPUFacts | None = None
    #: reserve: free GPU bytes once the plan fit; prewarm sizes batches from it.
    gpu_free_bytes: int | None = None
    #: started by prewarm, stopped by solidify.  None: not sampling.
    ramp: RampSampler | None = None
    #: prewarm: the (prompt_length, batch) shapes warmed.
    warmed_shapes: list[tuple[int, int]] = field(default_factory=list)
    #: solidify: the kernel cache it opened; Agent.stop() closes it.
    kernel_cache: KernelCache | None = None
    profile_summary: dict | None = None
    warmup_summary: dict | None = None
    #: prewarm: a profile length no warmup request used, since a user's first request
    #: meets an unwarmed length too.  None: readiness.probe_prompt_length.
    probe_length: int | None = None
    #: prewarm: (prompt, prompt + answer) tokens of each warmup request and the
    #: lengths warmed; ready predicts the first user's answer from them.
    decoded_ranges: list[tuple[int, int]] = field(default_factory=list)
    profile_lengths: list[int] = field(default_factory=list)
    #: prewarm: output tokens of the first probe.  None: readiness.probe_max_tokens.
    first_probe_tokens: int | None = None
    #: prewarm: (prompt length, requests) -> what re-sends the last warmup requests
    #: before the first probe's control, or None for no replay.
    replay_for: Callable[[int, int], Callable[[], None] | None] | None = None
    #: prewarm: sends one short request alone, so the first probe and the first user
    #: follow the same predecessor.
    settle: Callable[[], None] | None = None
    #: prewarm's per-length test: warming a length spares its first request something (pays)
    length_warmup_pays: bool = True
    #: Agent.let_users_in at a first start or a wake (None on a restart)
    let_users_in: Callable[[], Callable[[], None]] | None = None
    #: what let_users_in returned: every probe waits on it for the users let in
    users_first: Callable[[], None] | None = None
    #: one request through the users' proxy path, sent by ready before SERVING.
    user_path_request: Callable[[], dict] | None = None
    #: prewarm: probe pairs already sent by the warmup's last test; ready goes on
    #: from them.  Empty: ready sends the first pair.
    first_pairs: list[dict] = field(default_factory=list)
    #: prewarm: a known server's first probe went alone, so ready sends no pair.
    first_probe_alone: bool = False
    #: watch probes skipped because the server was busy with other clients.
    watch_skipped: int = 0

    # -- the run services the stages call ----------------------------------------------
    def checkpoint(self) -> None:
        """Raise AgentFailure if the machine failed or started draining."""
        if self.sm.state == State.FAILED:
            raise AgentFailure(self.sm.failure_reason or "failed", self.sm.failure_message or "")
        if self.sm.state == State.DRAINING:
            raise AgentFailure("draining", "stopped by a signal")

    def fail(self, reason: str, message: str) -> NoReturn:
        self.sm.fail(reason, message)
        raise AgentFailure(reason, message)

    def move(self, to: State) -> None:
        """Transition to `to`; already being there is fine (a re-warm)."""
        if self.sm.state == to:
            return
        if not self.sm.transition(to):
            self.checkpoint()
            raise AgentFailure("illegal_transition", f"{self.sm.state.name} -> {to.name} is not allowed")

    def probe(self, decode: bool = True, max_tokens: int | None = None,
              still_wanted: Callable[[], bool] | None = None, length: int | None = None) -> float:
        """Send one readiness probe, record it, and return its time to first token.

        decode=False asks for one output token: the breaker judges time to first
        token only, and decoding on every watch probe costs engine time.
        `still_wanted` is asked when the answer comes; False drops it.  `length`: its
        prompt tokens (None: the probe length prewarm chose)."""
        rc = self.cfg.readiness
        tokens = (max_tokens or rc.probe_max_tokens) if decode else 1
        if self.users_first is not None:
            self.users_first()
        r = self.driver.send_probe(self.profile, length or self.probe_length or rc.probe_prompt_length, tokens)
        if still_wanted is not None and not still_wanted():
            return r.first_token_seconds    # answered after its watch timeout: already judged a failure
        probe = Probe(r.first_token_seconds, r.total_seconds, r.output_tokens, r.prompt_tokens, r.server_prefill_seconds)
        self.record_probe(r.first_token_seconds, probe=probe)
        if self.probe_log.add_decode(probe):
            self.recorder.decode_window(WindowStats(self.probe_log.decode.quantiles()))
        return r.first_token_seconds

    def probe_pair(self, probe: Callable[[int | None], object], tokens: int | None,
                   replay: bool) -> tuple[Controlled, dict]:
        """Send a first probe and its control: the same shape and a fresh prompt after
        the same predecessor (with `replay`, the last warmup requests are re-sent
        between them).  Returns the pair and its dict for the record."""
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
        """Feed one time-to-first-token sample (a probe, or kind="user") to readiness.
        Only probes go in the probe log, which user traffic would grow without bound."""
        if kind == "probe":
            self.probe_log.add(probe or Probe(ttft, ttft, 1))
        self.readiness.first_token(ttft)
