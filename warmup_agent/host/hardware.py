"""Facts about the host: CPUs, memory and GPUs (through NVML), topology, and CPU pinning.

Missing NVML, GPUs or permissions give fewer facts, never an exception.  NVML counts in
PCI order and CUDA in CUDA_VISIBLE_DEVICES order, so `visible_gpu()` maps between them;
labels use the UUID, which survives restarts and re-ordering.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

log = logging.getLogger("warmup_agent.hardware")


@dataclass
class GPUFacts:
    index: int                       # NVML index (PCI order), as nvidia-smi shows it
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    memory_free_bytes: int
    numa_node: int | None = None
    local_cpus: list[int] = field(default_factory=list)
    pcie_generation: int | None = None
    pcie_width: int | None = None
    nvlinks_active: int | None = None          # None: NVLink not supported
    nvlink_peers: dict[str, int] = field(default_factory=dict)   # peer PCI bus id -> active links


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
    """CPU numbers from NVML's affinity words (64-bit, lowest CPU in the lowest bit)."""
    cpus = []
    for w, word in enumerate(words):
        for bit in range(64):
            if word >> bit & 1:
                cpus.append(w * 64 + bit)
    return cpus


def _load_nvml() -> Any:
    import pynvml
    return pynvml


def read_gpus(nvml: Any = None, cpu_count: int | None = None) -> tuple[list[GPUFacts], str | None]:
    """GPU facts from NVML; ([], reason) where NVML is unavailable."""
    try:
        nv = nvml or _load_nvml()
        nv.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver / no library: a CPU host
        return [], f"NVML unavailable: {type(e).__name__}"
    words = ((cpu_count or os.cpu_count() or 1) + 63) // 64
    gpus = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            g = GPUFacts(index=i, uuid=_str(nv.nvmlDeviceGetUUID(h)), name=_str(nv.nvmlDeviceGetName(h)),
                         pci_bus_id=_bus(nv.nvmlDeviceGetPciInfo(h).busId),
                         memory_total_bytes=int(mem.total), memory_free_bytes=int(mem.free))
            g.local_cpus = _try(lambda: _cpus_from_mask(list(nv.nvmlDeviceGetCpuAffinity(h, words)))) or []
            g.numa_node = _try(lambda: int(nv.nvmlDeviceGetNumaNodeId(h)))
            g.pcie_generation = _try(lambda: int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h)))
            g.pcie_width = _try(lambda: int(nv.nvmlDeviceGetCurrPcieLinkWidth(h)))
            g.nvlinks_active, g.nvlink_peers = _nvlinks(nv, h)
            gpus.append(g)
    finally:
        _try(nv.nvmlShutdown)
    return gpus, None


def _nvlinks(nv: Any, h: Any) -> tuple[int | None, dict[str, int]]:
    """Active NVLink links and, per peer PCI bus id, how many of them lead there."""
    active = 0
    peers: dict[str, int] = {}
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            state = nv.nvmlDeviceGetNvLinkState(h, link)
        except Exception:  # noqa: BLE001 - link absent or NVLink unsupported
            if link == 0:
                return None, {}
            break
        if state != getattr(nv, "NVML_FEATURE_ENABLED", 1):
            continue
        active += 1
        peer = _try(lambda: _bus(nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId))
        if peer:
            peers[peer] = peers.get(peer, 0) + 1
    return active, peers


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _bus(v: Any) -> str:
    """Normalise a PCI bus id, which NVML gives with 4 or 8 domain digits depending on the call."""
    s = _str(v).lower()
    domain, _, rest = s.partition(":")
    return f"{int(domain, 16):04x}:{rest}" if rest else s


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - optional NVML fields
        return None


def read_host(nvml: Any = None) -> HostFacts:
    vm = psutil.virtual_memory()
    gpus, err = read_gpus(nvml)
    return HostFacts(cpu_count=os.cpu_count() or 1, allowed_cpus=sorted(os.sched_getaffinity(0)),
                     memory_total_bytes=int(vm.total), memory_available_bytes=int(vm.available),
                     gpus=gpus, nvml_error=err)


def visible_indices(uuids: list[str], cuda_visible_devices: str | None) -> list[int]:
    """NVML indices of the GPUs this CUDA_VISIBLE_DEVICES shows, in CUDA order.

    Entries are indices or UUID prefixes; as in CUDA, the list ends at the first bad entry."""
    if cuda_visible_devices is None:
        return list(range(len(uuids)))
    out: list[int] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit():
            i = int(entry) if int(entry) < len(uuids) else None
        else:
            want = entry.removeprefix("GPU-").lower()
            hits = [k for k, u in enumerate(uuids) if want and u.removeprefix("GPU-").lower().startswith(want)]
            i = hits[0] if len(hits) == 1 else None
        if i is None or i in out:
            break
        out.append(i)
    return out


def visible_gpu(gpus: list[GPUFacts], device_index: int, cuda_visible_devices: str | None) -> GPUFacts | None:
    """The NVML GPU behind torch's cuda:<device_index>."""
    by_index = {g.index: g for g in gpus}
    seen = visible_indices([g.uuid for g in sorted(gpus, key=lambda g: g.index)], cuda_visible_devices)
    return by_index.get(seen[device_index]) if 0 <= device_index < len(seen) else None


def topology(gpus: list[GPUFacts]) -> dict:
    """NVLink matrix and locality by NVML index, as `nvidia-smi topo -m` shows it."""
    by_bus = {g.pci_bus_id: g.index for g in gpus}
    links = {g.index: {o.index: 0 for o in gpus if o.index != g.index} for g in gpus}
    switch_links: dict[int, int] = {}
    for g in gpus:
        for bus, n in g.nvlink_peers.items():
            if bus in by_bus and by_bus[bus] != g.index:
                links[g.index][by_bus[bus]] += n
            else:
                switch_links[g.index] = switch_links.get(g.index, 0) + n   # NVSwitch or a GPU outside this VM
    return {"gpus": [{"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id, "numa_node": g.numa_node,
                      "local_cpus": g.local_cpus, "nvlinks_active": g.nvlinks_active,
                      "pcie": [g.pcie_generation, g.pcie_width]} for g in gpus],
            "nvlink": links, "nvlink_to_switch": switch_links}


def choose_cpus(allowed: list[int], gpu_local: list[int]) -> list[int]:
    """CPUs local to the GPU that the cpuset allows, else all allowed CPUs (a container must still run)."""
    local = sorted(set(allowed) & set(gpu_local))
    return local or sorted(allowed)


def assign_cpus(gpus: list[GPUFacts], allowed: list[int]) -> dict[int, list[int]]:
    """Disjoint CPU sets for one agent per GPU; GPUs sharing local CPUs split them in PCI order (stable)."""
    groups: dict[tuple[int, ...], list[GPUFacts]] = {}
    for g in gpus:
        groups.setdefault(tuple(choose_cpus(allowed, g.local_cpus)), []).append(g)
    out = {}
    for cpus, members in groups.items():
        members = sorted(members, key=lambda g: g.pci_bus_id)
        n = len(members)
        if len(cpus) < n:        # fewer CPUs than GPUs: share rather than starve one
            for g in members:
                out[g.index] = list(cpus)
            continue
        per, extra = divmod(len(cpus), n)
        start = 0
        for k, g in enumerate(members):
            size = per + (1 if k < extra else 0)
            out[g.index] = list(cpus[start:start + size])
            start += size
    return out


def pin_cpus(cpus: list[int]) -> bool:
    """Pin every thread of this process, not just this one (threads started earlier would keep the cpuset).

    False, with a log line, where the kernel refuses."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        log.warning("cannot pin to CPUs %s: %s", cpus, e.strerror)
        return False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:      # no /proc: this thread and those it starts from now on
        return True
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return True
