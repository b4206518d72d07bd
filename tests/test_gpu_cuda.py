"""GPU paths on a real CUDA device (skipped on CI, which has none; run on the H200
with `python -m pytest tests/test_gpu_cuda.py`).  Each compares the GPU path with
an independent reference: from_pretrained, the eager decode, the allocator's
own snapshot, NVML against torch."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def engines(embedded_model):
    from warmup_agent.engines.torch.engine import TorchEngine
    # Both transformers: the loader and transformers' StaticCache graphs against from_pretrained
    # (the native forward: test_native_* below).
    prog = TorchEngine(embedded_model, device="cuda", implementation="transformers")
    prog.load_tokenizer()
    prog.init_device()
    prog.load_weights()
    ref = TorchEngine(embedded_model, device="cuda", implementation="transformers")
    ref.configure(progressive=False)
    ref.load_tokenizer()
    ref.load_weights()
    return prog, ref


def test_progressive_pinned_load_equals_from_pretrained(engines):
    prog, ref = engines
    assert prog.load_report.path == "pinned_overlapped", prog.load_report
    assert prog.load_report.order[0] == "model.embed_tokens.weight"
    ids = torch.tensor([prog.tokenize("the first request is as fast as the thousandth")], device="cuda")
    with torch.inference_mode():
        a, b = prog.model(ids).logits, ref.model(ids).logits
    assert torch.equal(a, b)
    assert prog.weight_fingerprint() == ref.weight_fingerprint()


def test_small_chunks_still_load_every_byte(embedded_model):
    from warmup_agent.engines.torch.engine import TorchEngine
    e = TorchEngine(embedded_model, device="cuda")
    e.configure(chunk_bytes=4096 + 3, buffers=2, workers=2)   # odd size: tensors split across many chunks
    e.load_tokenizer()
    e.load_weights()
    ref = TorchEngine(embedded_model, device="cuda", implementation="transformers")
    ref.configure(progressive=False)
    ref.load_tokenizer()
    ref.load_weights()
    assert e.weight_fingerprint() == ref.weight_fingerprint()


def test_cuda_graph_decode_matches_eager(engines):
    prog, _ = engines
    report = prog.solidify([(8, 1), (8, 2)], mode="cuda_graphs")
    assert report.method == "cuda_graphs", report.detail
    assert report.detail["graphs"] == [1, 2]
    t = prog.tokenize("warm up the decode step of every batch size we serve today please")
    prompts = [t[:8], t[3:11]]
    prog.generate(prompts, max_new_tokens=8)
    graphed = prog.last_output.clone()
    decoders, prog._decoders = prog._decoders, {}
    prog.generate(prompts, max_new_tokens=8)
    prog._decoders = decoders
    assert torch.equal(graphed, prog.last_output)


@pytest.fixture(scope="module")
def native_qwen2(embedded_model, tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases, tied embeddings, varied greedy tokens) in bf16,
    loaded natively and through transformers (tests/test_native_lm.py builds it)."""
    from tests.test_native_lm import _tiny
    from warmup_agent.engines.torch.engine import TorchEngine
    d = _tiny(embedded_model, str(tmp_path_factory.mktemp("native") / "qwen2"), "qwen2")
    out = []
    for implementation in ("native", "transformers"):
        e = TorchEngine(d, device="cuda", dtype="bfloat16", implementation=implementation)
        e.init_device()
        e.load_weights()
        e.load_tokenizer()
        out.append(e)
    return out


def test_native_logits_match_transformers_in_bf16(native_qwen2):
    native, ref = native_qwen2
    assert type(native.model).__name__ == "NativeCausalLM" and native.load_report.path == "plain"   # float32 on disk: cast
    torch.manual_seed(0)
    ids = torch.randint(3, 2048, (3, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :11] = 0
    with torch.inference_mode():
        for kwargs in ({"input_ids": ids[1:2]}, {"input_ids": ids, "attention_mask": mask}):
            a, b = native.model(**kwargs).logits.float(), ref.model(**kwargs).logits.float()
            real = kwargs.get("attention_mask", torch.ones_like(ids[1:2])).bool()
            assert torch.isfinite(a).all()
            # bf16: a few ulps of the largest logit, never a different model.
            assert (a - b)[real].abs().max().item() <= 0.05 * b[real].abs().max().item(), kwargs.keys()
            assert (a[real].argmax(-1) == b[real].argmax(-1)).float().mean().item() >= 0.95


def test_native_cuda_graph_decode_equals_native_eager_decode(native_qwen2):
    from warmup_agent.gpu import graphs
    native, _ = native_qwen2
    report = native.solidify([(10, 1), (10, 2)], mode="cuda_graphs")
    assert report.method == "cuda_graphs", report.detail
    assert report.detail["graphs"] == [1, 2]
    t = native.tokenize("warm up the decode step of every batch size we serve today please " * 2)
    prompts = [t[:10], t[4:14]]
    native.generate(prompts, max_new_tokens=16)
    graphed = native.last_output.clone()
    captured = native._decoders
    native._decoders, reason = graphs.build(native.model, [2], report.detail["graph_max_len"], native.device, capture=False)
    assert reason is None
    try:
        native.generate(prompts, max_new_tokens=16)     # the same static-cache step, eager
    finally:
        native._decoders = captured
    assert graphed.tolist() == native.last_output.tolist()
    assert len(set(graphed[0].tolist())) > 1            # varied tokens: the comparison means something


def test_native_captured_prefill_equals_eager_and_serves_the_probe(native_qwen2):
    """One captured padded prefill per warmed (length, batch): a request whose prompt
    fits replays it (the readiness probe's one-token request too), and its tokens
    equal the same padded prefill run eagerly."""
    from warmup_agent.gpu import graphs
    native, _ = native_qwen2
    report = native.solidify([(16, 1), (32, 1), (16, 2)], mode="cuda_graphs")
    assert report.method == "cuda_graphs", report.detail
    assert report.detail["prefill_graphs"] == [[1, 16], [1, 32], [2, 16]]
    # solidify sent each shape once through generate(), so through its padded prefill graph
    served = {b: {n: p.served for n, p in d.prefills.items()} for b, d in native._decoders.items()}
    assert served == {1: {16: 1, 32: 1}, 2: {16: 1}}
    t = native.tokenize("warm up the prefill of every prompt length we serve today please, and more " * 3)
    requests = ([t[:12]], [t[1:31]], [t[2:14], t[5:17]])
    graphed = []
    for prompts in requests:
        native.generate(prompts, max_new_tokens=8)
        graphed.append(native.last_output.clone())
    native.generate([t[3:19]], max_new_tokens=1)      # the probe's shape: prefill only
    captured = native._decoders
    assert all(p.graph is not None for d in captured.values() for p in d.prefills.values())
    assert {b: {n: p.served for n, p in d.prefills.items()} for b, d in captured.items()} == \
        {1: {16: 3, 32: 2}, 2: {16: 2}}
    native._decoders, reason = graphs.build(native.model, [1, 2], report.detail["graph_max_len"], native.device,
                                            capture=False, prefill_lengths={1: [16, 32], 2: [16]})
    assert reason is None
    try:
        for prompts, want in zip(requests, graphed, strict=True):
            native.generate(prompts, max_new_tokens=8)
            assert native.last_output.tolist() == want.tolist(), [len(p) for p in prompts]
    finally:
        # Release the graphs and their private pool: the allocator tests below compare
        # the snapshot with the allocator's own counters, which read 0.06 % apart on the
        # H200 while this test's graphs and their pool were still held.
        native._decoders = {}
        del captured
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    assert len(set(graphed[0][0].tolist())) > 1


def test_reservation_maps_and_keeps_memory():
    from warmup_agent.gpu import memory
    dev = torch.device("cuda")
    before = torch.cuda.memory_reserved(dev)
    held = memory.reserve(dev, 256 << 20)
    assert held >= before + (256 << 20) - (2 << 20)
    assert torch.cuda.memory_allocated(dev) < held      # released to the allocator, not the driver


def test_fragmentation_equals_the_snapshot_itself():
    """Stranded free bytes (inactive blocks in segments that also hold a live block)
    over reserved bytes, counted here from the snapshot's own blocks, and equal to
    the allocator's inactive_split_bytes over reserved_bytes."""
    from warmup_agent.gpu.memory import fragmentation_from_snapshot
    keep = [torch.empty(3 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    del keep[1], keep[4]                # two holes
    snap = torch.cuda.memory_snapshot()
    stats = torch.cuda.memory_stats()
    dev = torch.cuda.current_device()
    segs = [s for s in snap if s["device"] == dev]
    stranded = sum(b["size"] for s in segs if any(b["state"] == "active_allocated" for b in s["blocks"])
                   for b in s["blocks"] if b["state"] == "inactive")
    reserved = sum(s["total_size"] for s in segs)
    rate = fragmentation_from_snapshot(snap)[dev]
    assert rate == pytest.approx(stranded / reserved)
    assert rate == pytest.approx(stats["inactive_split_bytes.all.current"] / stats["reserved_bytes.all.current"])
    assert 0 < rate < 1


def test_nvml_facts_agree_with_torch(tmp_path):
    from warmup_agent.host import hardware
    gpus, err = hardware.read_gpus()
    assert err is None and gpus
    props = torch.cuda.get_device_properties(0)
    gpu = hardware.visible_gpu(gpus, 0, os.environ.get("CUDA_VISIBLE_DEVICES"))
    assert gpu.uuid.replace("GPU-", "") == str(props.uuid).replace("GPU-", "")
    assert gpu.memory_total_bytes >= props.total_memory
    out = os.environ.get("OUT")
    if out:   # keep the real answers for the record
        with open(os.path.join(out, "nvml_answers_h200.json"), "w") as f:
            json.dump(hardware.topology(gpus) | {"facts": [vars(g) for g in gpus]}, f, indent=2)


def test_cli_on_cuda_drains_on_sigterm(tmp_path, data_dir, embedded_model):
    """Issue 13: on the H200 the CLI never drained (the handler never ran).  The
    command line on CUDA: SERVING, SIGTERM from outside, DRAINING on /startupz,
    exit 0 within 5 s."""
    import signal
    import threading
    import time

    from tests.test_signals import start_agent, watch_states
    proc, url, log = start_agent(tmp_path, data_dir)
    try:
        seen: set = set()
        w = threading.Thread(target=watch_states, args=(url, proc, seen), daemon=True)
        w.start()
        time.sleep(2)   # a probe in flight, as in the failing runs
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
        w.join(2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, open(log).read()[-2000:]
    assert took <= 5, took
    assert "DRAINING" in seen or "signal 15: draining" in open(log).read()
