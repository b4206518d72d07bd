"""One agent per GPU on a two-GPU host, on the CPU: the per-GPU series convention
(docs/metrics.md, "Per-GPU series") checked on NVML answers for a two-H200 host
built from the answers recorded on one H200 (bench/results/gpu_nvml_answers_h200.json)
plus a second GPU laid out as the two-GPU host showed it (NV18 between the pair,
CPUs 16-31).  The real two-GPU run is bench/bench_two_gpu.py."""
import copy
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from exporter.collectors import NVMLCollector
from tests.test_gpu_cpu_paths import H200, RecordedNVML
from warmup_agent import hardware

UUID1 = "GPU-1c5e2f7a-0d4b-8e39-a6c1-2b9f04d7e311"   # constructed: the second GPU


def two_h200():
    """GPU 0 as recorded; GPU 1 a copy on the other bus and CPUs; 18 links each way."""
    g0 = dict(H200, nvml_bus_id="00000000:00:06.0", memory_used_bytes=4394 << 20, util=37)
    g1 = dict(copy.deepcopy(g0), uuid=UUID1, nvml_bus_id="00000000:00:07.0", local_cpus=list(range(16, 32)),
              memory_used_bytes=4100 << 20, util=12)
    g0["links"] = ["00000000:00:07.0"] * 18
    g1["links"] = ["00000000:00:06.0"] * 18
    return [g0, g1]


class TwoGPUNVML(RecordedNVML):
    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["memory_total_bytes"], free=h["memory_free_bytes"], used=h["memory_used_bytes"])

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=h["util"], memory=0)


def scrape(cvd) -> dict:
    """{(metric, gpu, uuid): value} of one agent's NVML collector with this CUDA_VISIBLE_DEVICES."""
    reg = CollectorRegistry()
    reg.register(NVMLCollector(nvml=TwoGPUNVML(two_h200(), cpu_words=1), cuda_visible_devices=cvd))
    return {(s.name, s.labels["gpu"], s.labels["uuid"]): s.value
            for fam in reg.collect() for s in fam.samples}


def test_two_agents_export_disjoint_gpus_with_the_physical_index():
    a, b = scrape("0"), scrape("1")
    assert {k[1:] for k in a} == {("0", H200["uuid"])}
    assert {k[1:] for k in b} == {("1", UUID1)}
    assert a[("warmup_gpu_memory_used_bytes", "0", H200["uuid"])] == 4394 << 20
    assert b[("warmup_gpu_memory_used_bytes", "1", UUID1)] == 4100 << 20
    assert b[("warmup_gpu_utilization_ratio", "1", UUID1)] == pytest.approx(0.12)
    # a node-level sum by uuid counts each GPU once (the fault of the first two-GPU try)
    node = {}
    for (name, _, uuid), v in list(a.items()) + list(b.items()):
        if name == "warmup_gpu_memory_total_bytes":
            node[uuid] = node.get(uuid, 0) + v
    assert node == {H200["uuid"]: H200["memory_total_bytes"], UUID1: H200["memory_total_bytes"]}


def test_labels_stay_with_the_physical_gpu_whatever_the_order_or_spelling():
    swapped = scrape("1,0")
    assert {k[1:] for k in swapped} == {("0", H200["uuid"]), ("1", UUID1)}
    assert {k[1:] for k in scrape(UUID1)} == {("1", UUID1)}
    assert {k[1:] for k in scrape(UUID1.removeprefix("GPU-")[:8])} == {("1", UUID1)}
    assert {k[1:] for k in scrape(None)} == {("0", H200["uuid"]), ("1", UUID1)}   # unset: every GPU


def test_a_cuda_visible_devices_naming_no_gpu_exports_none():
    assert scrape("") == {}
    assert scrape("7") == {}
    assert {k[1:] for k in scrape("1,7,0")} == {("1", UUID1)}      # CUDA stops at the first bad entry


def test_visible_indices_maps_cuda_order_to_nvml_order():
    uuids = [H200["uuid"], UUID1]
    assert hardware.visible_indices(uuids, None) == [0, 1]
    assert hardware.visible_indices(uuids, "1,0") == [1, 0]
    assert hardware.visible_indices(uuids, f"{UUID1},0") == [1, 0]
    assert hardware.visible_indices(uuids, "GPU-") == []            # a prefix matching both is no GPU
    assert hardware.visible_indices(uuids, "0,0") == [0]


def test_two_h200_topology_and_cpu_shares():
    gpus, err = hardware.read_gpus(TwoGPUNVML(two_h200()), cpu_count=32)
    assert err is None
    topo = hardware.topology(gpus)
    assert topo["nvlink"] == {0: {1: 18}, 1: {0: 18}} and topo["nvlink_to_switch"] == {}
    plan = hardware.assign_cpus(gpus, list(range(32)))
    assert plan == {0: list(range(16)), 1: list(range(16, 32))}
    # the agent started with CUDA_VISIBLE_DEVICES=1 finds and pins to GPU 1's CPUs
    assert hardware.visible_gpu(gpus, 0, "1").uuid == UUID1
    assert plan[hardware.visible_gpu(gpus, 0, "1").index] == list(range(16, 32))


def test_pinning_covers_threads_started_before_it():
    """The exporter thread starts before reserve pins: it must move too (checked in
    /proc, the kernel's view)."""
    import os
    import threading
    before = sorted(os.sched_getaffinity(0))
    if len(before) < 2:
        pytest.skip("needs two allowed CPUs")
    started, release = threading.Event(), threading.Event()
    tid = {}

    def worker():
        tid["id"] = threading.get_native_id()
        started.set()
        release.wait(10)
    t = threading.Thread(target=worker)
    t.start()
    started.wait(10)
    try:
        assert hardware.pin_cpus(before[:1])
        status = open(f"/proc/self/task/{tid['id']}/status").read()
        line = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:"))
        assert line.split(":")[1].strip() == str(before[0])
    finally:
        release.set()
        t.join()
        for t_id in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(t_id), before)
            except OSError:
                pass
