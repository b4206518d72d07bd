"""Collectors for values read at scrape time: the process, NVML, the allocator.

Dependencies are injected through the constructor, and one failing read never blanks
the rest of the scrape.  Without a GPU the GPU families are absent.  The process
series (`warmup_process_*`) are prometheus_client's own ProcessCollector under the
`warmup` namespace, not a copy of it.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.core import GaugeMetricFamily

from exporter.catalogue import spec

log = logging.getLogger("exporter.collectors")


def _family(name: str, labels: Any = None) -> GaugeMetricFamily:
    s = spec(name)
    return GaugeMetricFamily(s.name, s.help, labels=list(s.labels) if labels is None else labels)


#: The namespace of the process series: warmup_process_resident_memory_bytes etc.
PROCESS_NAMESPACE = "warmup"


def process_collector(pid: Callable[[], int | str] = lambda: "self", proc: str = "/proc") -> ProcessCollector:
    """warmup_process_* of one process (default: this one) from /proc, left unregistered.

    Memory, CPU seconds, open and maximum fds and the start time, as every Prometheus
    client exports them; absent where there is no /proc."""
    return ProcessCollector(namespace=PROCESS_NAMESPACE, pid=pid, proc=proc, registry=None)


_FROM_ENV = object()


class NVMLCollector:
    """Memory and utilisation of the GPUs this agent owns (its CUDA_VISIBLE_DEVICES,
    or all), so one agent per GPU exports each GPU once.  Labels: `gpu`, the physical
    NVML index; `uuid`, stable across restarts."""

    def __init__(self, nvml: Any = None, cuda_visible_devices: Any = _FROM_ENV) -> None:
        self._nvml = nvml
        self._ok: bool | None = None
        self._visible = os.environ.get("CUDA_VISIBLE_DEVICES") if cuda_visible_devices is _FROM_ENV \
            else cuda_visible_devices

    def _init(self) -> bool:
        if self._ok is None:
            try:
                if self._nvml is None:
                    import pynvml
                    self._nvml = pynvml
                self._nvml.nvmlInit()
                self._ok = True
            except Exception:  # noqa: BLE001 - no driver: a CPU host
                self._ok = False
        return bool(self._ok)

    def owned(self) -> list[tuple[int, str, object]]:
        """(physical index, UUID, handle) of each GPU this agent owns, in CUDA order."""
        from warmup_agent.host.hardware import visible_indices
        nv = self._nvml
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        uuids = [_text(nv.nvmlDeviceGetUUID(h)) for h in handles]
        return [(i, uuids[i], handles[i]) for i in visible_indices(uuids, self._visible)]

    def collect(self) -> Any:
        if not self._init():
            return
        nv = self._nvml
        used, total, util = (_family("warmup_gpu_memory_used_bytes"), _family("warmup_gpu_memory_total_bytes"),
                             _family("warmup_gpu_utilization_ratio"))
        try:
            owned = self.owned()
        except Exception:  # noqa: BLE001 - NVML gone: no GPU families this scrape
            log.debug("NVML enumeration failed", exc_info=True)
            return
        for i, uuid, h in owned:
            try:
                labels = [str(i), uuid]
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                used.add_metric(labels, float(mem.used))
                total.add_metric(labels, float(mem.total))
                util.add_metric(labels, nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
            except Exception:  # noqa: BLE001 - one GPU failing leaves the others
                log.debug("NVML read of GPU %d failed", i, exc_info=True)
        yield used
        yield total
        yield util


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class AllocatorCollector:
    """gpu_fragmentation_rate from this process's PyTorch caching allocator, per device
    it reserves memory on (warmup_agent.gpu.memory.fragmentation_from_snapshot).

    Only an engine whose model lives in this process has a figure; a device on which
    this allocator reserves nothing is absent rather than a misleading 0.  Labelled
    like the NVML series, not by torch's index (0 in every single-GPU process)."""

    def __init__(self, snapshot: Any = None, gpu_labels: Any = None) -> None:
        self._snapshot = snapshot
        self._gpu_labels = gpu_labels or _TorchGpuLabels()

    def collect(self) -> Any:
        from warmup_agent.gpu.memory import fragmentation_from_snapshot, reserved_from_snapshot
        snap = self._snapshot
        if snap is None:
            torch = sys.modules.get("torch")
            if torch is None:
                return
            try:
                if not torch.cuda.is_available() or not torch.cuda.is_initialized():
                    return
                snap = torch.cuda.memory_snapshot
            except Exception:  # noqa: BLE001
                return
        try:
            segments = snap()
            reserved = reserved_from_snapshot(segments)
            fam = _family("gpu_fragmentation_rate")
            for dev, rate in sorted(fragmentation_from_snapshot(segments).items()):
                if reserved.get(dev):           # nothing reserved: no figure, not a 0
                    fam.add_metric(list(self._gpu_labels(dev)), rate)
            yield fam
        except Exception:  # noqa: BLE001 - never blank the scrape
            log.debug("allocator snapshot failed", exc_info=True)


class _TorchGpuLabels:
    """torch device index -> (NVML index, UUID), cached.  Without NVML the index is
    "unknown"."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[str, str]] = {}

    def __call__(self, dev: int) -> tuple[str, str]:
        if dev not in self._cache:
            import torch
            uuid = str(torch.cuda.get_device_properties(dev).uuid)
            uuid = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
            self._cache[dev] = (_nvml_index(uuid), uuid)
        return self._cache[dev]


def _nvml_index(uuid: str) -> str:
    try:
        import pynvml
        pynvml.nvmlInit()
        return str(pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)))
    except Exception:  # noqa: BLE001 - no NVML: the UUID alone
        return "unknown"


def register_default_collectors(registry: Any) -> None:
    """Register the scrape-time collectors on the agent's registry: this process, NVML, the allocator."""
    for c in (process_collector(), NVMLCollector(), AllocatorCollector()):
        registry.register(c)
