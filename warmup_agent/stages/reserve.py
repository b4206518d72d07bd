"""Stage 1, reserve (state INIT): read the host, pin CPUs, check the model fits.

On a GPU host: NVML facts per GPU (memory, NUMA node, local CPUs, PCIe, NVLink)
and pinning to the CPUs local to the GPU within the allowed cpuset.  On a CPU
host: CPU and memory facts; there is no GPU locality to pin to.  Both fail fast
(reasons insufficient_memory / insufficient_gpu_memory) when the weights alone
cannot fit, before a minute is spent loading them.
"""
from __future__ import annotations

import logging

from warmup_agent import hardware
from warmup_agent.engines.torch_engine import check_model_dir, check_safetensors_header, safetensors_files

log = logging.getLogger("warmup_agent.stages.reserve")


def _weight_bytes_on_device(model_path: str, device: str, dtype: str) -> int:
    """Bytes the weights will take once loaded: stored bytes, doubled when a
    16-bit checkpoint is loaded as float32 (the CPU default)."""
    stored = sum(check_safetensors_header(f) for f in safetensors_files(model_path))
    if dtype == "float32" or (dtype == "auto" and device == "cpu"):
        config = check_model_dir(model_path)
        if (config.get("torch_dtype") or config.get("dtype")) in ("bfloat16", "float16"):
            return stored * 2
    return stored


def run(agent) -> None:
    cfg = agent.cfg
    host = hardware.read_host()
    agent.host_facts = host.as_dict()
    detail = agent.stages[-1].detail
    detail["gpus"] = len(host.gpus)
    device = cfg["model.device"]
    if device == "auto":
        device = "cuda" if host.gpus else "cpu"

    if host.gpus and device.startswith("cuda"):
        gpu = host.gpus[int(device.split(":")[1]) if ":" in device else 0]
        if cfg["reserve.pin_cpus"] and gpu.local_cpus:
            cpus = hardware.choose_cpus(host.allowed_cpus, gpu.local_cpus)
            detail["pinned_cpus"] = cpus if hardware.pin_cpus(cpus) else None
    else:
        detail["pinned_cpus"] = None  # no GPU: no locality to pin to; keep the cgroup's cpuset

    model_path = getattr(agent.engine, "model_path", None)
    if model_path:
        check_model_dir(model_path)
        need = _weight_bytes_on_device(model_path, "cuda" if device.startswith("cuda") else "cpu", cfg["model.dtype"])
        detail["weight_bytes"] = need
        if device.startswith("cuda") and host.gpus:
            free = gpu.memory_free_bytes
            if need > free:
                agent.fail("insufficient_gpu_memory",
                           f"{model_path}: weights need {need / 2**30:.2f} GiB but GPU {gpu.index} has {free / 2**30:.2f} GiB free")
        elif need > host.memory_available_bytes:
            agent.fail("insufficient_memory",
                       f"{model_path}: weights need {need / 2**30:.2f} GiB but only {host.memory_available_bytes / 2**30:.2f} GiB of memory is available")
