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
from warmup_agent.host import hardware

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


# --- bench/bench_two_gpu.py: its parsing and checks, on the constructed answer set ----------------
def bench():
    from bench import bench_two_gpu
    return bench_two_gpu


def constructed():
    import json
    return json.load(open(bench().CONSTRUCTED))


def test_bench_reads_nvidia_smi_as_printed():
    b, c = bench(), constructed()
    topo = b.parse_topo(c["nvidia_smi"]["topo_m"]["stdout"])     # header underlined with ANSI codes
    assert topo == {0: {"links": {1: "NV18"}, "cpu_affinity": list(range(16)), "numa_affinity": 0},
                    1: {"links": {0: "NV18"}, "cpu_affinity": list(range(16, 32)), "numa_affinity": 1}}
    q = b.parse_query(c["nvidia_smi"]["q"]["stdout"])
    assert [(g["bus_id"], g["uuid"], g["minor_number"], g["memory_total_mib"]) for g in q] == \
        [("0000:00:06.0", H200["uuid"], 0, 143771), ("0000:00:07.0", UUID1, 1, 143771)]
    assert b.parse_nvlink_status(c["nvidia_smi"]["nvlink_s"]["stdout"]) == \
        {0: {"links": 18, "active": 18}, 1: {"links": 18, "active": 18}}
    assert b.cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11] and b.cpu_list("N/A") == []
    assert (b.nvlink_count("NV18"), b.nvlink_count("SYS"), b.nvlink_count(" X ")) == (18, 0, 0)


def test_bench_records_nvml_in_the_format_it_replays():
    b, c = bench(), constructed()
    assert b.record_nvml(b.ReplayNVML(c["nvml_answers"]), 32) == c["nvml_answers"]


def test_bench_topology_comparison_agrees_and_catches_a_vm_that_hides_peers():
    b, c = bench(), constructed()
    result = {}
    b.host_step(result, c)
    cmp = result["topology_comparison"]
    assert cmp["all_match"], cmp["mismatches"]
    whats = {r["what"] for r in cmp["rows"]}
    assert {"nvlink_links_to_gpu1", "local_cpus", "numa_node", "uuid_at_bus_id", "nvlinks_active"} <= whats
    # a VM whose NVLink remote PCI ids are the host's, not the guest's: the agent then
    # counts the links as going to a switch, and the comparison must say so
    vm = copy.deepcopy(c)
    for g in vm["nvml_answers"]:
        g["links"] = ["00000000:9a:00.0"] * 18
    b.host_step(result, vm)
    bad = {(r["gpu"], r["what"]) for r in result["topology_comparison"]["mismatches"]}
    assert bad == {(0, "nvlink_links_to_gpu1"), (1, "nvlink_links_to_gpu0")}


def test_bench_label_check_names_every_wrong_series():
    b = bench()
    good = [{"name": "warmup_gpu_memory_used_bytes", "labels": {"gpu": "1", "uuid": UUID1}, "value": 1.0},
            {"name": "warmup_state", "labels": {"state": "SERVING"}, "value": 1.0}]
    assert b.check_labels(good, 1, UUID1)["ok"]
    # the faults of the first two-GPU try: the other GPU's NVML series, the torch index
    bad = good + [{"name": "warmup_gpu_memory_used_bytes", "labels": {"gpu": "0", "uuid": H200["uuid"]}, "value": 1.0},
                  {"name": "gpu_fragmentation_rate", "labels": {"gpu": "0"}, "value": 0.5}]
    r = b.check_labels(bad, 1, UUID1)
    assert not r["ok"] and [w["name"] for w in r["wrong"]] == ["warmup_gpu_memory_used_bytes", "gpu_fragmentation_rate"]
    assert not b.check_labels(good[1:], 1, UUID1)["ok"]           # no per-GPU series at all is no pass


def test_bench_tax_is_the_first_probe_after_serving_over_the_next_twenty():
    b = bench()
    rec = {"probes_seconds": [0.5] * 10 + [0.030] + [0.025] * 10 + [0.027] * 10 + [0.1] * 5, "first_request_tax_ratio": 1.2}
    t = b.tax_from_record(rec, 10)
    assert t["tax"] == pytest.approx(0.030 / 0.026)
    assert "error" in b.tax_from_record(dict(rec, probes_seconds=[0.1] * 20), 10)
    assert b.p99([1.0, 1.2, 0.9]) == 1.2 and b.p99(list(range(1, 201))) == 198 and b.p99([]) is None


@pytest.mark.slow
def test_bench_dry_run_starts_two_cli_agents_and_writes_its_json(tmp_path):
    """The H200x2 command's own code on the CPU: two `warmup-agent run` processes at
    once, SERVING, probes after SERVING, SIGTERM to both, the JSON with every section."""
    import glob
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "bench/bench_two_gpu.py", "--dry-run", "--out-dir", str(tmp_path)],
                       cwd=bench().ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = json.load(open(glob.glob(str(tmp_path / "two_gpu_dryrun_cpu_*.json"))[0]))
    s = out["summary"]
    assert s["errors"] == [] and out["errors"] == [], s["errors"] + out["errors"]
    assert s["topology_matches_nvidia_smi"] and s["both_serving_every_start"]
    assert s["sigterm_exit_codes"] == [0, 0]
    agents = list(out["pairs"][0]["agents"].values())
    why = json.dumps([{k: a.get(k) for k in ("cvd", "sigterm", "tax")} for a in agents])
    assert len(s["first_request_taxes"]) == 2 and all(t > 0 for t in s["first_request_taxes"]), why
    assert sorted(a["cvd"] for a in agents) == ["0", "1"]
    # (DRAINING on /startupz lasts only until the exporter stops: the bench records
    # whether its poll caught it, but that is a race, not asserted here)
    assert all(a["sigterm"]["state_when_sent"] == "SERVING" and a["sigterm"]["seconds"] > 0 for a in agents), why
    assert out["provenance"]["commit"] and out["child_env"]["NCCL_NVLS_ENABLE"] == "0"
