"""Facts about the host: CPUs, memory and GPUs (through NVML), and CPU pinning.

Everything here degrades quietly: no NVML library, no GPU, or a cpuset we may not
change all give facts with fewer fields, never an exception.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field

import psutil

log = logging.getLogger("warmup_agent.hardware")


@dataclass
class GPUFacts:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    memory_free_bytes: int
    numa_node: int | None = None
    local_cpus: list[int] = field(default_factory=list)
    pcie_generation: int | None = None
    pcie_width: int | None = None
    nvlinks_active: int | None = None


@dataclass
class HostFacts:
    cpu_count: int
    allowed_cpus: list[int]
    memory_total_bytes: int
    memory_available_bytes: int
    gpus: list[GPUFacts] = field(default_factory=list)
    nvml_error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _cpus_from_mask(words: list[int]) -> list[int]:
    """NVML returns CPU affinity as 64-bit words, lowest CPU in the lowest bit."""
    cpus = []
    for w, word in enumerate(words):
        for bit in range(64):
            if word >> bit & 1:
                cpus.append(w * 64 + bit)
    return cpus


def read_gpus() -> tuple[list[GPUFacts], str | None]:
    """GPU facts from NVML; ([], reason) where NVML is unavailable."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver / no library: a CPU host
        return [], f"NVML unavailable: {type(e).__name__}"
    gpus = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            g = GPUFacts(index=i, uuid=_str(pynvml.nvmlDeviceGetUUID(h)), name=_str(pynvml.nvmlDeviceGetName(h)),
                         pci_bus_id=_str(pynvml.nvmlDeviceGetPciInfo(h).busId),
                         memory_total_bytes=int(mem.total), memory_free_bytes=int(mem.free))
            g.local_cpus = _try(lambda: _cpus_from_mask(list(pynvml.nvmlDeviceGetCpuAffinity(h, (os.cpu_count() + 63) // 64)))) or []
            g.numa_node = _try(lambda: int(pynvml.nvmlDeviceGetNumaNodeId(h)))
            g.pcie_generation = _try(lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)))
            g.pcie_width = _try(lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)))
            g.nvlinks_active = _count_nvlinks(pynvml, h)
            gpus.append(g)
    finally:
        _try(pynvml.nvmlShutdown)
    return gpus, None


def _count_nvlinks(pynvml, h) -> int | None:
    active = 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                active += 1
        except Exception:  # noqa: BLE001 - link absent or NVLink unsupported
            if link == 0:
                return None
            break
    return active


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - optional NVML fields
        return None


def read_host() -> HostFacts:
    vm = psutil.virtual_memory()
    gpus, err = read_gpus()
    return HostFacts(cpu_count=os.cpu_count() or 1, allowed_cpus=sorted(os.sched_getaffinity(0)),
                     memory_total_bytes=int(vm.total), memory_available_bytes=int(vm.available),
                     gpus=gpus, nvml_error=err)


def choose_cpus(allowed: list[int], gpu_local: list[int]) -> list[int]:
    """CPUs to pin to: those local to the GPU that the cgroup cpuset allows.
    Falls back to all allowed CPUs when the two do not intersect (a container
    whose cpuset sits on the other socket must still run)."""
    local = sorted(set(allowed) & set(gpu_local))
    return local or sorted(allowed)


def pin_cpus(cpus: list[int]) -> bool:
    """Pin this process; False (and a log line) where the kernel refuses."""
    try:
        os.sched_setaffinity(0, cpus)
        return True
    except OSError as e:
        log.warning("cannot pin to CPUs %s: %s", cpus, e.strerror)
        return False
