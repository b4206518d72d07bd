"""Stage 3, solidify (PRIME): freeze what the engine can for the warmed shapes.

torch engine on a GPU: one CUDA graph per warmed batch size for the decode step
over a static KV cache (fallback to eager replay with a named reason, counted
in warmup_solidify_fallbacks_total); on the CPU: replay each warmed shape once
more; torch.compile on request (solidify.mode compile).  Compile and kernel
caches point at the kernel cache's local tier: restored from the shared tier
before compiling, published after.  A degraded or broken cache never fails the
warmup: it only costs a compile.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from exporter.recorder import GpuId, SolidifyStats
from warmup_agent.stages.context import StageContext

if TYPE_CHECKING:  # types only: imported where it is opened
    from warmup_agent.kernel_cache import KernelCache

log = logging.getLogger("warmup_agent.stages.solidify")


def open_kernel_cache(ctx: StageContext) -> KernelCache | None:
    """The two-tier kernel cache with the engines' cache variables pointed at its
    local tier and restored from the shared tier; None when it cannot be used."""
    try:
        from warmup_agent.kernel_cache import KernelCache
        cfg = ctx.cfg
        cache = KernelCache.from_config(cfg.kernel_cache, data_dir=cfg.data_dir, model=cfg.model, solidify=cfg.solidify,
                                        recorder=ctx.recorder)
        os.environ.update(cache.env())
        cache.restore()
        return cache
    except Exception as e:  # noqa: BLE001 - a cache problem costs a compile, never the warmup
        log.warning("kernel cache unavailable (%s: %s); compiling without it", type(e).__name__, e)
        return None


def _publish(cache: KernelCache | None) -> None:
    if cache is None:
        return
    try:
        cache.publish()
    except Exception as e:  # noqa: BLE001
        log.warning("kernel cache publish failed (%s: %s)", type(e).__name__, e)


def run(ctx: StageContext, detail: dict) -> None:
    mode = ctx.cfg.solidify.mode
    # Opened on every run (cheap with a local tier only) so its metrics and the
    # shared tier's state are visible; only compilation fills it.
    # A server engine whose server compiled nothing into the cache folders it was
    # given (`transformers serve`, eager) has nothing to share: skip the cache,
    # whose namespace costs a torch import (seconds on a GPU host) on the way to SERVING.
    wanted = mode != "none" and ctx.engine.has_compile_artifacts()
    cache = open_kernel_cache(ctx) if wanted else None
    previous, ctx.kernel_cache = ctx.kernel_cache, cache   # the agent closes it at stop
    if previous is not None:  # a re-warm opens a fresh one
        previous.close()
    with ctx.driver.busy("solidify"):     # its engine-seconds count in warmup_cost_ratio
        shapes = ctx.warmed_shapes
        if cache is not None and mode == "compile":
            report = cache.compile_once("solidify", lambda: ctx.engine.solidify(shapes, mode=mode))
        else:
            report = ctx.engine.solidify(shapes, mode=mode)
    _publish(cache)
    if cache is not None:
        detail["kernel_cache"] = "degraded" if cache.degraded else "ok"
    detail.update(method=report.method, shapes=report.shapes, **report.detail)
    gpu = GpuId(ctx.gpu.index, ctx.gpu.uuid) if ctx.gpu is not None else None
    ctx.recorder.solidify(SolidifyStats(
        fallback_reason=report.detail.get("fallback_reason"), gpu=gpu,
        cuda_graphs=len(report.detail.get("graphs", [])) + len(report.detail.get("prefill_graphs", []))))
    ramp = ctx.ramp
    if ramp is not None:
        slope = ramp.stop()
        detail["ramp_samples"] = len(ramp.samples)
        if slope is not None and gpu is not None:
            detail["ramp_slope_per_second"] = slope
            ctx.recorder.solidify(SolidifyStats(gpu=gpu, ramp_slope=slope))
