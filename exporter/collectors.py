"""Collectors for values read at scrape time: process memory, NVML, the allocator.

Like prometheus_client's ProcessCollector: dependencies injected through the
constructor, fresh metric families on every collect(), and one failing section
(an NVML call, a /proc read) never blanks the rest of the scrape.  Without a GPU
the GPU families are simply absent.
"""
from __future__ import annotations

import logging
import os
import sys

import psutil
from prometheus_client.core import GaugeMetricFamily

from exporter.catalogue import spec

log = logging.getLogger("exporter.collectors")


def _family(name: str, labels=None) -> GaugeMetricFamily:
    s = spec(name)
    return GaugeMetricFamily(s.name, s.help, labels=list(s.labels) if labels is None else labels)


class ProcessCollector:
    def __init__(self, process: psutil.Process | None = None):
        self._proc = process or psutil.Process()

    def collect(self):
        try:
            fam = _family("warmup_process_resident_memory_bytes")
            fam.add_metric([], float(self._proc.memory_info().rss))
            yield fam
        except Exception:  # noqa: BLE001 - a /proc read must not blank the scrape
            log.debug("process memory read failed", exc_info=True)


_FROM_ENV = object()


class NVMLCollector:
    """Memory and utilisation from NVML for the GPUs this agent owns: those its
    CUDA_VISIBLE_DEVICES names (every GPU when unset), mapped to physical devices
    by index or UUID.  One agent per GPU on a node then exports each GPU once, so
    `sum by (uuid)` over a node counts every GPU once (docs/metrics.md, "Per-GPU
    series").  Labels: `gpu` = the physical NVML index (what nvidia-smi shows,
    whatever CUDA_VISIBLE_DEVICES says), `uuid` = the GPU's UUID (stable across
    restarts and re-ordering)."""

    def __init__(self, nvml=None, cuda_visible_devices=_FROM_ENV):
        self._nvml = nvml
        self._ok = None
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
        return self._ok

    def owned(self) -> list[tuple[int, str, object]]:
        """(physical index, UUID, handle) of each GPU this agent owns, in CUDA order."""
        from warmup_agent.hardware import visible_indices
        nv = self._nvml
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        uuids = [_text(nv.nvmlDeviceGetUUID(h)) for h in handles]
        return [(i, uuids[i], handles[i]) for i in visible_indices(uuids, self._visible)]

    def collect(self):
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


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class AllocatorCollector:
    """gpu_fragmentation_rate from this process's PyTorch caching allocator:
    1 - largest free block / free reserved bytes, per device it has touched
    (warmup_agent.gpu.memory.fragmentation_from_snapshot).  Reads torch only if
    the process already imported it and initialised CUDA.  `snapshot` is
    injectable so the computation is tested on a recorded snapshot."""

    def __init__(self, snapshot=None):
        self._snapshot = snapshot

    def collect(self):
        from warmup_agent.gpu.memory import fragmentation_from_snapshot
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
            fam = _family("gpu_fragmentation_rate")
            for dev, rate in sorted(fragmentation_from_snapshot(snap()).items()):
                fam.add_metric([str(dev)], rate)
            yield fam
        except Exception:  # noqa: BLE001 - never blank the scrape
            log.debug("allocator snapshot failed", exc_info=True)


def register_default_collectors(registry) -> None:
    for c in (ProcessCollector(), NVMLCollector(), AllocatorCollector()):
        registry.register(c)
