"""Stage 1, reserve (state INIT): read the host, pin CPUs, create the CUDA context,
reserve GPU memory for the model and the warmup grid.

The process is pinned to its share of the CPUs local to its GPU, so agents on GPUs
that share a socket never overlap.  The reservation is the weights plus the KV cache
of the longest warmup shape at the largest batch, plus activation headroom; when it
cannot fit the agent fails at once with insufficient_gpu_memory and the numbers.

Every sub-step is timed (`Steps`) so a slow reserve says where its time goes.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Any

from exporter.recorder import GpuId, ReserveStats
from warmup_agent.gpu import sizing
from warmup_agent.host import hardware
from warmup_agent.model.directory import check_model_dir, check_safetensors_header, safetensors_files
from warmup_agent.run.progress import coldstart
from warmup_agent.stages.context import StageContext

log = logging.getLogger("warmup_agent.stages.reserve")


def _weight_bytes_on_device(model_path: str, device: str, dtype: str) -> int:
    """Stored weight bytes, doubled when a 16-bit checkpoint loads as float32."""
    stored = sum(check_safetensors_header(f) for f in safetensors_files(model_path))
    if dtype == "float32" or (dtype == "auto" and device == "cpu"):
        config = check_model_dir(model_path)
        if (config.get("torch_dtype") or config.get("dtype")) in ("bfloat16", "float16"):
            return stored * 2
    return stored


def _device_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def configure_engine(ctx: StageContext) -> None:
    """Hand the config's loader and GPU options to the engine."""
    cfg = ctx.cfg
    ctx.engine.configure(progressive=cfg.prewarm.progressive_load, chunk_bytes=cfg.prewarm.staging_chunk_bytes,
                           buffers=cfg.prewarm.staging_buffers, workers=cfg.prewarm.loader_threads,
                           manifest=cfg.prewarm.weights_manifest,
                           cuda_context_timeout=cfg.gpu.cuda_context_timeout_seconds,
                           kernel_compile_timeout=cfg.gpu.kernel_compile_timeout_seconds,
                           graph_max_len=cfg.solidify.graph_max_length)


class Steps:
    """Times reserve's sub-steps into the record, the log and the step gauge."""

    def __init__(self, ctx: StageContext, detail: dict):
        self._recorder = ctx.recorder
        self.seconds = detail.setdefault("steps_seconds", {})

    def record(self, name: str, seconds: float) -> None:
        self.seconds[name] = round(seconds, 6)
        self._recorder.reserve(ReserveStats(step=name, step_seconds=seconds))
        coldstart("step", "reserve", 1, step=name, duration=round(seconds, 6))

    @contextlib.contextmanager
    def __call__(self, name: str) -> Any:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - t0)


def run(ctx: StageContext, detail: dict) -> None:
    cfg = ctx.cfg
    step = Steps(ctx, detail)
    with step("host_facts"):            # NVML init, per-GPU facts, NVLink links
        host = hardware.read_host()
    ctx.host_facts = host.as_dict()
    detail["gpus"] = len(host.gpus)
    device = cfg.model.device
    if device == "auto":
        device = "cuda" if host.gpus else "cpu"
    configure_engine(ctx)

    gpu = None
    if host.gpus and device.startswith("cuda"):
        gpu = hardware.visible_gpu(host.gpus, _device_index(device), os.environ.get("CUDA_VISIBLE_DEVICES"))
    ctx.gpu = gpu
    if gpu is not None:
        detail["gpu_uuid"] = gpu.uuid
        with step("pin_cpus"):
            ctx.host_facts["topology"] = hardware.topology(host.gpus)
            if cfg.reserve.pin_cpus and gpu.local_cpus:
                cpus = hardware.assign_cpus(host.gpus, host.allowed_cpus)[gpu.index]
                detail["pinned_cpus"] = cpus if hardware.pin_cpus(cpus) else None
    else:
        detail["pinned_cpus"] = None  # no GPU: no locality to pin to; keep the cgroup's cpuset

    model_path = ctx.engine.model_path   # None: no local model directory to check
    if not model_path:
        return
    on_gpu = device.startswith("cuda") and gpu is not None
    with step("model_check"):           # config.json and every shard header
        config = check_model_dir(model_path)
        need = _weight_bytes_on_device(model_path, "cuda" if on_gpu else "cpu", cfg.model.dtype)
    detail["weight_bytes"] = need
    if not on_gpu:
        if need > host.memory_available_bytes:
            ctx.fail("insufficient_memory",
                       f"{model_path}: weights need {need / 2**30:.2f} GiB but only {host.memory_available_bytes / 2**30:.2f} GiB of memory is available")
        return
    assert gpu is not None  # on_gpu

    dtype = "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype
    plan = sizing.plan_reservation(config, dtype, need, cfg.prewarm.prompt_lengths + [cfg.prewarm.max_prompt_length],
                                   cfg.prewarm.batch_sizes + ([cfg.prewarm.max_batch] if cfg.prewarm.batch_sizes_from_memory else []),
                                   max(cfg.prewarm.max_new_tokens, 1), cfg.reserve.activation_factor)
    detail["reservation"] = plan.as_dict()
    problem = sizing.check_fits(plan, gpu.memory_free_bytes, f"{model_path} on GPU {gpu.index} ({gpu.uuid})")
    if problem:
        ctx.fail("insufficient_gpu_memory", problem)
    ctx.gpu_free_bytes = gpu.memory_free_bytes
    if ctx.engine.sets_up_device:
        # The process's first `import torch`, timed apart so it is not read as reservation.
        with step("torch_import"):
            if "torch" not in sys.modules:
                import torch  # noqa: F401
        t0 = time.perf_counter()
        ctx.engine.init_device()        # CUDA context, under its deadline
        total = time.perf_counter() - t0
        context = ctx.engine.context_seconds or 0.0
        detail["cuda_context_seconds"] = ctx.engine.context_seconds
        # init_device = cuInit and device enumeration + the context itself.
        step.record("cuda_init", max(total - context, 0.0))
        step.record("cuda_context", context)
        if cfg.reserve.gpu_memory:
            with step("memory_reserve"):
                reserved = ctx.engine.reserve_memory(plan.total_bytes)
            detail["reserved_bytes"] = reserved
            ctx.recorder.reserve(ReserveStats(gpu=GpuId(gpu.index, gpu.uuid), reserved_bytes=reserved))
