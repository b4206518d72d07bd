"""CPU tests of every GPU code path (CI has no GPU): NVML parsing and CPU
assignment on recorded answers, reservation sizing, fragmentation from a
recorded allocator snapshot, the ramp slope, the progressive loader's plain
path and integrity checks, the static-cache decode against the dynamic one,
the CUDA-graph fallback reason, deadlines, and the traffic generator."""
import hashlib
import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest

from tests.helpers.paths import ROOT
from warmup_agent.engines.base import EngineError
from warmup_agent.gpu import sizing
from warmup_agent.gpu.deadline import run_with_deadline
from warmup_agent.gpu.memory import fragmentation_from_snapshot, old_fragmentation_from_snapshot
from warmup_agent.gpu.ramp import RampSampler, least_squares_slope
from warmup_agent.host import hardware
from warmup_agent.warmup import traffic

H200 = json.load(open(os.path.join(ROOT, "bench", "results", "gpu_nvml_answers_h200.json")))["facts"][0]


class RecordedNVML:
    """Replays NVML answers: per GPU a dict of facts; NVLink remote bus ids per link."""
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, gpus, cpu_words=1):
        self.gpus, self.words = gpus, cpu_words

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, i): return self.gpus[i]
    def nvmlDeviceGetMemoryInfo(self, h): return SimpleNamespace(total=h["memory_total_bytes"], free=h["memory_free_bytes"], used=0)
    def nvmlDeviceGetUUID(self, h): return h["uuid"].encode()
    def nvmlDeviceGetName(self, h): return h["name"]
    def nvmlDeviceGetPciInfo(self, h): return SimpleNamespace(busId=h["nvml_bus_id"].encode())

    def nvmlDeviceGetCpuAffinity(self, h, words):
        mask = [0] * words
        for c in h["local_cpus"]:
            mask[c // 64] |= 1 << (c % 64)
        return mask

    def nvmlDeviceGetNumaNodeId(self, h):
        if h["numa_node"] is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return h["numa_node"]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h): return h["pcie_generation"]
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): return h["pcie_width"]

    def nvmlDeviceGetNvLinkState(self, h, link):
        links = h.get("links")
        if links is None or link >= len(links):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED" if links is None else "NVML_ERROR_INVALID_ARGUMENT")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=h["links"][link])


def h200_recorded():
    g = dict(H200)
    g["nvml_bus_id"] = "00000000:00:06.0"   # NVML's 8-digit domain, as nvmlDeviceGetPciInfo gives it
    return g


def two_gpu_host():
    """A two-socket host laid out like a DGX H200 half: GPUs 0-1 on socket 0
    (CPUs 0-15), GPUs 2-3 on socket 1 (CPUs 16-31), each pair joined by 4 links
    and every GPU with 14 more links to the NVSwitch (constructed, not recorded)."""
    bus = ["00000000:19:00.0", "00000000:3b:00.0", "00000000:9a:00.0", "00000000:bb:00.0"]
    gpus = []
    for i in range(4):
        peer = i ^ 1
        links = [bus[peer].lower()] * 4 + ["00000000:05:00.0"] * 14
        gpus.append(dict(uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", name="NVIDIA H200", nvml_bus_id=bus[i],
                         memory_total_bytes=150754820096, memory_free_bytes=148773142528,
                         numa_node=i // 2, local_cpus=list(range(16 * (i // 2), 16 * (i // 2) + 16)),
                         pcie_generation=5, pcie_width=16, links=links))
    return gpus


def test_recorded_h200_answers_parse_to_the_same_facts():
    gpus, err = hardware.read_gpus(RecordedNVML([h200_recorded()]), cpu_count=16)
    assert err is None and len(gpus) == 1
    g = gpus[0]
    assert (g.uuid, g.pci_bus_id, g.local_cpus, g.pcie_generation, g.pcie_width) == \
        (H200["uuid"], "0000:00:06.0", list(range(16)), 5, 16)
    assert g.numa_node is None and g.nvlinks_active is None     # a VM with one GPU: no NUMA node, no NVLink


def test_topology_counts_nvlinks_between_gpus_and_to_the_switch():
    gpus, _ = hardware.read_gpus(RecordedNVML(two_gpu_host()), cpu_count=32)
    topo = hardware.topology(gpus)
    assert topo["nvlink"][0] == {1: 4, 2: 0, 3: 0}
    assert topo["nvlink"][3] == {0: 0, 1: 0, 2: 4}
    assert topo["nvlink_to_switch"] == {0: 14, 1: 14, 2: 14, 3: 14}
    assert [g.nvlinks_active for g in gpus] == [18] * 4
    assert [g["numa_node"] for g in topo["gpus"]] == [0, 0, 1, 1]


def test_cpu_assignment_is_disjoint_local_and_stable():
    gpus, _ = hardware.read_gpus(RecordedNVML(two_gpu_host()), cpu_count=32)
    plan = hardware.assign_cpus(gpus, list(range(32)))
    assert plan == {0: list(range(0, 8)), 1: list(range(8, 16)), 2: list(range(16, 24)), 3: list(range(24, 32))}
    # enumeration order does not change who gets what (split in PCI bus order)
    assert hardware.assign_cpus(list(reversed(gpus)), list(range(32))) == plan
    # a cpuset that excludes socket 1: GPUs 2-3 fall back to the allowed CPUs, which
    # all four then split: still disjoint, nobody left without CPUs
    narrow = hardware.assign_cpus(gpus, list(range(12)))
    assert sorted(c for cpus in narrow.values() for c in cpus) == list(range(12))
    assert all(len(cpus) == 3 for cpus in narrow.values())


def test_visible_gpu_follows_cuda_visible_devices_by_index_and_uuid():
    gpus, _ = hardware.read_gpus(RecordedNVML(two_gpu_host()), cpu_count=32)
    assert hardware.visible_gpu(gpus, 0, None).index == 0
    assert hardware.visible_gpu(gpus, 0, "2,3").index == 2
    assert hardware.visible_gpu(gpus, 1, "2,3").index == 3
    assert hardware.visible_gpu(gpus, 0, "GPU-00000003").index == 3
    assert hardware.visible_gpu(gpus, 1, "2") is None


def test_no_nvml_is_a_cpu_host_not_an_error():
    class Broken:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    gpus, err = hardware.read_gpus(Broken())
    assert gpus == [] and "NVML unavailable" in err


# --- sizing -------------------------------------------------------------------------------
QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936)


def test_kv_bytes_per_token_of_qwen2_1_5b():
    # 2 x 28 layers x 2 kv heads x 128 head_dim x 2 bytes
    assert sizing.kv_bytes_per_token(QWEN2_1_5B, "bfloat16") == 2 * 28 * 2 * 128 * 2 == 28672


def test_the_engines_share_one_kv_formula_and_say_unknown_rather_than_guess():
    """One formula for the torch, vllm and openai engines' facts (issue 24: it was
    written four times, with three different fallbacks for an unknown dtype)."""
    assert sizing.kv_bytes_per_token_if_known(QWEN2_1_5B, "bfloat16") == 28672
    assert sizing.kv_bytes_per_token_if_known(QWEN2_1_5B, "float32") == 2 * 28672
    assert sizing.kv_bytes_per_token_if_known(QWEN2_1_5B, "float8_e4m3fn") is None
    assert sizing.kv_bytes_per_token_if_known({"hidden_size": 1536}, "bfloat16") is None
    import inspect

    from warmup_agent.engines import vllm_engine
    from warmup_agent.engines.openai import engine as openai_engine
    from warmup_agent.engines.torch import engine as torch_engine
    for module in (torch_engine, vllm_engine, openai_engine):
        source = inspect.getsource(module)
        assert "kv_bytes_per_token_if_known" in source and '"bfloat16": 2' not in source, module.__name__


def test_reservation_plan_and_fail_fast_numbers():
    plan = sizing.plan_reservation(QWEN2_1_5B, "bfloat16", 3_087_007_744, [16, 128], [1, 4], 2)
    assert plan.kv_bytes == 28672 * 130 * 4
    assert plan.total_bytes == plan.weight_bytes + plan.kv_bytes + plan.activation_bytes
    assert sizing.check_fits(plan, H200["memory_free_bytes"], "m") is None
    msg = sizing.check_fits(plan, 2 << 30, "m on GPU 0")
    assert msg.startswith("m on GPU 0: needs 2.") and "only 2.00 GiB is free" in msg and "28672 B/token" in msg


def test_reserve_stage_fails_fast_with_insufficient_gpu_memory(embedded_model, monkeypatch):
    from exporter.metrics import AgentMetrics
    from warmup_agent import config
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.pipeline import Agent
    from warmup_agent.states import State
    small = h200_recorded() | {"memory_free_bytes": 1 << 20}
    real = hardware.read_host
    monkeypatch.setattr(hardware, "read_host", lambda nvml=None: real(RecordedNVML([small])))
    monkeypatch.setattr(hardware, "pin_cpus", lambda cpus: True)
    cfg = config.load(env={"WARMUP_AGENT_MODEL_DEVICE": "cuda"})
    agent = Agent(cfg, TorchEngine(embedded_model, device="cuda"), metrics=AgentMetrics())
    assert agent.run() == State.FAILED
    assert agent.sm.failure_reason == "insufficient_gpu_memory"
    assert "but only 0.00 GiB is free" in agent.sm.failure_message and H200["uuid"] in agent.sm.failure_message
    assert agent.metrics.registry.get_sample_value("model_loading_failures_total", {"reason": "insufficient_gpu_memory"}) == 1


def test_batch_sizes_from_memory_follow_the_seed_formula():
    # 0.7 x free / (max_seq_len x kv bytes per token)
    assert sizing.batch_sizes_from_memory(10 * 512 * 28672, 28672, 512, fraction=0.7, cap=64) == [1, 2, 4]
    assert sizing.batch_sizes_from_memory(10 ** 12, 28672, 512, cap=8) == [1, 2, 4, 8]
    assert sizing.batch_sizes_from_memory(1, 28672, 512) == [1]


# --- fragmentation and ramp ---------------------------------------------------------------------
SNAPSHOT = [  # shaped like torch.cuda.memory_snapshot(): segments with blocks and states
    {"device": 0, "total_size": 20 << 20, "blocks": [
        {"size": 4 << 20, "state": "active_allocated"}, {"size": 6 << 20, "state": "inactive"},
        {"size": 8 << 20, "state": "active_allocated"}, {"size": 2 << 20, "state": "inactive"}]},
    {"device": 0, "total_size": 2 << 20, "blocks": [{"size": 2 << 20, "state": "inactive"}]},
    {"device": 1, "total_size": 8 << 20, "blocks": [{"size": 8 << 20, "state": "active_allocated"}]},
]


RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded")


def _recorded(name):
    with open(os.path.join(RECORDED, name), encoding="utf-8") as f:
        return json.load(f)


def test_fragmentation_counts_free_bytes_stranded_beside_live_blocks():
    rates = fragmentation_from_snapshot(SNAPSHOT)
    # device 0: 6 + 2 MiB free beside live blocks; the wholly free 2 MiB segment is not stranded
    assert rates[0] == pytest.approx(8 / 22)
    assert rates[1] == 0.0                               # nothing free: not fragmented
    assert old_fragmentation_from_snapshot(SNAPSHOT)[0] == pytest.approx(1 - 6 / 10)


def test_fragmentation_of_a_recorded_h200_pod_equals_the_allocators_own_count():
    """Snapshot of a freshly warmed H200 pod (bench/diagnostics/gpu_allocator_probe.py, default
    config, Qwen2-1.5B shape) against torch.cuda.memory_stats() taken at the same
    moment: the figure is the allocator's inactive_split_bytes / reserved_bytes."""
    snap = _recorded("allocator_snapshot_h200_warm.json")
    stats = _recorded_stats()
    assert fragmentation_from_snapshot(snap)[0] == pytest.approx(
        stats["inactive_split_bytes.all.current"] / stats["reserved_bytes.all.current"], rel=1e-12)
    assert fragmentation_from_snapshot(snap)[0] < 0.05          # close to 0 on a healthy pod
    assert old_fragmentation_from_snapshot(snap)[0] == pytest.approx(0.586, abs=0.001)  # what issue 13 saw


def _recorded_stats():
    with open(os.path.join(os.path.dirname(RECORDED), "..", "bench", "results", "gpu_allocator_probe_h200.json")) as f:
        return json.load(f)["runs"][0]["warm"]["stats"]


def _fragment(snapshot, every: int):
    """The same pod after freeing every `every`-th live block of each segment that
    holds several (what days of traffic with varying shapes do): holes between
    live blocks.  Neighbouring free blocks are not merged here, which the
    figure does not care about (it sums free bytes)."""
    out = []
    for seg in snapshot:
        blocks = [dict(b) for b in seg["blocks"]]
        live = [b for b in blocks if b["state"] != "inactive"]
        if len(live) > 1:
            for b in live[::every]:
                b["state"] = "inactive"
        out.append({**seg, "blocks": blocks})
    return out


def test_fragmentation_rises_as_free_memory_splits_between_live_blocks():
    snap = _recorded("allocator_snapshot_h200_warm.json")
    seen = [fragmentation_from_snapshot(snap)[0]] + [fragmentation_from_snapshot(_fragment(snap, k))[0] for k in (8, 4, 2)]
    assert seen == sorted(seen) and seen[-1] > 0.3 > seen[0], seen
    # independent count for one case: every freed byte of a segment that keeps a live block
    frag = _fragment(snap, 2)
    stranded = sum(b["size"] for s in frag for b in s["blocks"] if b["state"] == "inactive"
                   and any(x["state"] != "inactive" for x in s["blocks"]))
    assert seen[-1] == pytest.approx(stranded / sum(s["total_size"] for s in frag))


def test_allocator_collector_exports_the_snapshot_rate_by_nvml_index_and_uuid():
    from prometheus_client import CollectorRegistry

    from exporter.collectors import AllocatorCollector
    reg = CollectorRegistry()
    snap = SNAPSHOT + [{"device": 2, "total_size": 0, "blocks": []}]   # torch device 2 holds nothing
    uuids = {0: ("3", "GPU-aaaa"), 1: ("5", "GPU-bbbb"), 2: ("6", "GPU-cccc")}
    reg.register(AllocatorCollector(snapshot=lambda: snap, gpu_labels=uuids.__getitem__))
    assert reg.get_sample_value("gpu_fragmentation_rate", {"gpu": "3", "uuid": "GPU-aaaa"}) == pytest.approx(8 / 22)
    assert reg.get_sample_value("gpu_fragmentation_rate", {"gpu": "5", "uuid": "GPU-bbbb"}) == 0.0
    assert reg.get_sample_value("gpu_fragmentation_rate", {"gpu": "6", "uuid": "GPU-cccc"}) is None  # no figure, not a 0
    assert reg.get_sample_value("gpu_fragmentation_rate", {"gpu": "0"}) is None


def test_ramp_slope_is_the_least_squares_fit():
    import numpy as np
    t = [0.0, 0.05, 0.1, 0.15, 0.2, 0.25]
    y = [0.0, 0.0, 0.1, 0.3, 0.3, 0.6]
    assert least_squares_slope(list(zip(t, y, strict=True))) == pytest.approx(np.polyfit(t, y, 1)[0])
    assert least_squares_slope([(1.0, 0.5)]) is None


def test_ramp_sampler_reads_nvml_at_its_interval():
    reads = iter([10, 20, 30, 40, 50, 60, 70, 80, 90, 100] + [100] * 1000)
    nvml = SimpleNamespace(nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=next(reads)))
    s = RampSampler(nvml, None, interval=0.01).start()
    deadline = time.monotonic() + 10
    while len(s.samples) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    slope = s.stop()
    assert len(s.samples) >= 5 and slope > 0
    assert slope == pytest.approx(least_squares_slope(s.samples))


# --- deadlines ----------------------------------------------------------------------------------
def test_deadline_names_the_reason_and_passes_errors_through():
    import threading
    release = threading.Event()
    with pytest.raises(EngineError) as e:
        run_with_deadline(release.wait, 0.05, "cuda_context_timeout", "CUDA context creation")  # set only below
    release.set()
    assert e.value.reason == "cuda_context_timeout" and "0.05 s" in e.value.message
    # deadlines no loaded machine comes near: these return or raise at once
    assert run_with_deadline(lambda: 7, 600, "x", "y") == 7
    with pytest.raises(ZeroDivisionError):
        run_with_deadline(lambda: 1 / 0, 600, "x", "y")


# --- loader on the CPU --------------------------------------------------------------------------
def test_forward_order_puts_embeddings_first_and_layers_numerically():
    from warmup_agent.gpu.loader import forward_rank
    names = ["lm_head.weight", "model.norm.weight", "model.layers.10.mlp.w", "model.layers.2.mlp.w",
             "model.layers.0.attn.q", "model.embed_tokens.weight"]
    assert sorted(names, key=forward_rank) == ["model.embed_tokens.weight", "model.layers.0.attn.q",
                                               "model.layers.2.mlp.w", "model.layers.10.mlp.w",
                                               "model.norm.weight", "lm_head.weight"]


@pytest.fixture(scope="module")
def loaded(embedded_model):
    from warmup_agent.engines.torch.engine import TorchEngine
    # Both transformers: these tests are about the loader and transformers' StaticCache
    # path (the native forward has its own: tests/test_native_lm.py).
    prog = TorchEngine(embedded_model, device="cpu", implementation="transformers")
    prog.load_tokenizer()
    prog.load_weights()
    ref = TorchEngine(embedded_model, device="cpu", implementation="transformers")
    ref.configure(progressive=False)
    ref.load_tokenizer()
    ref.load_weights()
    return prog, ref


def test_progressive_plain_path_equals_from_pretrained(loaded):
    import torch
    prog, ref = loaded
    assert prog.load_report.path == "plain" and "not a CUDA device" in prog.load_report.reason
    assert prog.load_report.order[0] == "model.embed_tokens.weight"
    ids = torch.tensor([prog.tokenize("the first request is as fast as the thousandth")])
    with torch.inference_mode():
        assert torch.equal(prog.model(ids).logits, ref.model(ids).logits)
    assert prog.weight_fingerprint() == ref.weight_fingerprint()


def test_static_cache_decode_equals_dynamic_decode(loaded):
    from warmup_agent.gpu import graphs
    prog, _ = loaded
    decoders, reason = graphs.build(prog.model, [1, 2], 64, prog.device, capture=False)
    assert reason is None
    t = prog.tokenize("warm up the decode step of every batch size we serve today please")
    prompts = [t[:9], t[2:11]]
    prog._decoders = decoders
    try:
        prog.generate(prompts, max_new_tokens=6)
        static = prog.last_output.clone()
    finally:
        prog._decoders = {}
    prog.generate(prompts, max_new_tokens=6)
    assert static.tolist() == prog.last_output.tolist()


def test_cuda_graphs_on_cpu_fall_back_with_a_named_reason(loaded):
    prog, _ = loaded
    report = prog.solidify([(8, 1)], mode="cuda_graphs")
    assert report.method == "replay" and report.detail["fallback_reason"] == "no_cuda_device"
    assert prog._decoders == {}


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_manifest_mismatch_is_weights_corrupt(embedded_model, tmp_path):
    from warmup_agent.engines.torch.engine import TorchEngine
    d = _copy(embedded_model, tmp_path / "m")
    shard = os.path.join(d, "model.safetensors")
    good = hashlib.sha256(open(shard, "rb").read()).hexdigest()
    manifest = tmp_path / "SHA256SUMS"
    manifest.write_text(f"{good}  model.safetensors\n")
    e = TorchEngine(d, device="cpu")
    e.configure(manifest=str(manifest))
    e.load_tokenizer()
    e.load_weights()                                     # matches: loads
    with open(shard, "r+b") as f:                        # flip one byte of tensor data
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(EngineError) as err:
        e.load_weights()
    assert err.value.reason == "weights_corrupt" and "does not match the manifest" in err.value.message


def test_dtype_disagreeing_with_config_is_weights_corrupt(embedded_model, tmp_path):
    from warmup_agent.engines.torch.engine import TorchEngine
    d = _copy(embedded_model, tmp_path / "m")
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float16"
    json.dump(cfg, open(cfg_path, "w"))
    e = TorchEngine(d, device="cpu")
    e.load_tokenizer()
    with pytest.raises(EngineError) as err:
        e.load_weights()
    assert err.value.reason == "weights_corrupt" and "stored as bfloat16" in err.value.message


# --- traffic generator ---------------------------------------------------------------------------
def test_gaussian_lengths_follow_the_seed_default():
    import statistics
    xs = traffic.gaussian_lengths(4000, 23, 5, seed=1)
    assert abs(statistics.mean(xs) - 23) < 0.5 and abs(statistics.pstdev(xs) - 5) < 0.5
    assert traffic.gaussian_lengths(5, seed=3) == traffic.gaussian_lengths(5, seed=3)


def test_lengths_learned_from_a_sample_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("a b c\n\nd e\nf g h i j\n")
    lengths = traffic.lengths_from_sample(str(f), str.split, 50)
    assert set(lengths) <= {3, 2, 5} and len(lengths) == 50
    with pytest.raises(ValueError, match="no non-empty prompts"):
        traffic.lengths_from_sample(str(tmp_path / "empty"), str.split, 3) if (tmp_path / "empty").write_text("\n") else None


def test_warmup_lengths_add_the_power_of_two_grid():
    assert traffic.power_of_two_grid(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert traffic.warmup_lengths([16, 24], [21, 24], 32) == [1, 2, 4, 8, 16, 21, 24, 32]
