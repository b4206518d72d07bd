"""What the four stages share, declared in one place (issue 17).

The Agent (pipeline.py) creates one `StageContext` and owns it as
`agent.context`; every stage is called as `run(agent, ctx, detail)` with it.  A
stage hands later stages what it found through these fields and nothing else:
no stage sets attributes of its own on the Agent.  It lives as long as the
Agent, so a re-warm (prewarm, solidify and ready again after an engine restart)
still sees what reserve found on the first run.

`detail` is the stage's own part of the run record (StageTiming.detail); the
stages fill it as they go rather than return it, so that a stage that fails
half-way still records what it had measured (the reservation that did not fit,
the validation check that failed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the sampler and the cache are imported where they are made
    from warmup_agent.gpu.ramp import RampSampler
    from warmup_agent.hardware import GPUFacts
    from warmup_agent.kernel_cache import KernelCache


@dataclass
class StageContext:
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
    #: prewarm: output tokens of the first readiness probe (the profile's longest
    #: answer).  None: readiness.probe_max_tokens like the others.
    first_probe_tokens: int | None = None
