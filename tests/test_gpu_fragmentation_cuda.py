"""gpu_fragmentation_rate on a real CUDA device (skipped without one; run on the H200
with `python -m pytest tests/test_gpu_fragmentation_cuda.py`).

Fragmentation is made on purpose in this process's caching allocator, and the
figure is checked against the allocator's own counters
(torch.cuda.memory_stats: inactive_split_bytes / reserved_bytes), against the
bytes the test itself stranded, and through the collector against NVML's
index and UUID for the device."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20


def _rate():
    from warmup_agent.gpu.memory import fragmentation_from_snapshot
    dev = torch.cuda.current_device()
    torch.cuda.synchronize()
    snap = torch.cuda.memory_snapshot()
    stats = torch.cuda.memory_stats(dev)
    if not stats.get("reserved_bytes.all.current"):
        return 0.0, 0.0, 0              # nothing reserved (after empty_cache): nothing stranded
    return (fragmentation_from_snapshot(snap)[dev],
            stats["inactive_split_bytes.all.current"] / stats["reserved_bytes.all.current"],
            stats["reserved_bytes.all.current"])


def test_figure_equals_the_allocators_own_count_and_rises_with_holes():
    torch.cuda.empty_cache()
    keep = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4)]  # one warm tensor set
    before, allocator_before, _ = _rate()
    assert before == pytest.approx(allocator_before, rel=1e-12)

    # 8 MiB requests come out of 20 MiB segments, two to a segment: freeing one
    # of each pair leaves a hole beside a live block in every segment.
    pairs = [torch.empty(8 * MiB, dtype=torch.uint8, device="cuda") for _ in range(64)]
    mid, allocator_mid, _ = _rate()
    del pairs[::2]
    after, allocator_after, reserved = _rate()
    assert after == pytest.approx(allocator_after, rel=1e-12)
    assert after > mid + (32 * 8 * MiB) / reserved * 0.9     # at least the 32 holes we made
    # No absolute bound on `before`: tests that ran earlier in this process (the
    # engine's, tests/test_gpu_cuda.py) leave their own stranded blocks (0.42 on the H200).
    assert after > before

    # Freeing the other half empties those segments: nothing is stranded any more.
    del pairs
    cleared, allocator_cleared, _ = _rate()
    assert cleared == pytest.approx(allocator_cleared, rel=1e-12)
    assert cleared < after
    del keep


def test_a_wholly_free_segment_is_not_fragmentation():
    """A reservation released to the allocator (what stage 1 does) is one free
    segment: reusable for any request that fits, so the figure does not move."""
    from warmup_agent.gpu import memory
    torch.cuda.empty_cache()
    base, _, _ = _rate()
    memory.reserve(torch.device("cuda", torch.cuda.current_device()), 512 * MiB)
    rate, allocator, reserved = _rate()
    assert reserved >= 512 * MiB
    assert rate == pytest.approx(allocator, rel=1e-12)
    assert rate <= base + 1e-9


def test_collector_labels_by_nvml_index_and_uuid():
    pynvml = pytest.importorskip("pynvml")
    from prometheus_client import CollectorRegistry

    from exporter.collectors import AllocatorCollector
    x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")   # the allocator holds memory on this device
    reg = CollectorRegistry()
    reg.register(AllocatorCollector())
    samples = [s for m in reg.collect() for s in m.samples if s.name == "gpu_fragmentation_rate"]
    assert len(samples) == 1, samples
    labels = samples[0].labels
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(int(labels["gpu"]))
    uuid = pynvml.nvmlDeviceGetUUID(h)
    assert labels["uuid"] == (uuid.decode() if isinstance(uuid, bytes) else uuid)
    assert labels["uuid"].removeprefix("GPU-") == str(torch.cuda.get_device_properties(0).uuid).removeprefix("GPU-")
    rate, allocator, _ = _rate()
    assert samples[0].value == pytest.approx(allocator, abs=1e-3)
    del x
