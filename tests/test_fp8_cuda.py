"""FP8 on a real CUDA device (issue 16; skipped without one: run on the H200 with
`python -m pytest tests/test_fp8_cuda.py`).  The embedded model is quantized to
transformers' "fp8" layout, loaded by the torch engine (pinned loader, FP8 GEMMs
by torch._scaled_mm with blockwise scales), warmed by the agent's four stages and
range-validated on the GPU.  Each result is compared with an independent
computation: float64 matmul of the dequantized operands on the CPU, the CPU
emulation of the same checkpoint, the range report computed on the CPU."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.fixture(scope="module")
def fp8_model(embedded_model, tmp_path_factory):
    from warmup_agent.quantization import quantize_checkpoint
    out = str(tmp_path_factory.mktemp("fp8") / "model")
    quantize_checkpoint(embedded_model, out)
    return out


@pytest.fixture(scope="module")
def engine(fp8_model):
    from warmup_agent.engines.torch.engine import TorchEngine
    e = TorchEngine(fp8_model, device="cuda")
    e.init_device()
    e.load_weights()
    e.load_tokenizer()
    return e


def test_fp8_checkpoint_loads_pinned_with_fp8_layers(engine):
    from warmup_agent import quantization
    assert engine.quantization.method == "fp8" and engine.quantization.weight_block_size == (128, 128)
    assert engine.load_report.path == "pinned_overlapped", engine.load_report   # FP8 bytes copied as stored
    layers = quantization.fp8_layers(engine.model)
    assert len(layers) == engine.fp8_layers == 4 * 7
    for _, layer in layers:
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.device.type == "cuda"
        assert layer.weight_scale_inv.dtype == torch.float32


@pytest.mark.skipif(not _hopper(), reason="blockwise-scaled FP8 GEMM needs compute capability 9.0")
def test_scaled_mm_layer_equals_float64_of_the_dequantized_operands(engine):
    from warmup_agent import quantization
    name, layer = quantization.fp8_layers(engine.model)[0]
    x = torch.randn(37, layer.in_features, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x).double().cpu()
        assert layer._fast is True, "the H200 path must be torch._scaled_mm, not the emulation"
        xq, xs = layer.quantize_input(x)
        xd = quantization.dequantize(xq, quantization.expand_block_scales(xs, x.shape, (1, 128))).double().cpu()
        wd = layer.dequantize_weight().double().cpu()
        ref = xd @ wd.T + (layer.bias.double().cpu() if layer.bias is not None else 0)
    err = float((y - ref).abs().max() / ref.abs().max())
    assert err < 1e-2, f"{name}: scaled_mm output differs from float64 by {err:.3g} of the peak"


def test_gpu_logits_match_the_cpu_emulation(engine, fp8_model):
    from warmup_agent.engines.torch.engine import TorchEngine
    cpu = TorchEngine(fp8_model, device="cpu", dtype="bfloat16")
    cpu.load_weights()
    cpu.load_tokenizer()
    ids = engine.tokenize("the first request to an fp8 model is as fast as the thousandth")
    with torch.inference_mode():
        g = engine.model(input_ids=torch.tensor([ids], device="cuda")).logits.float().cpu()
        c = cpu.model(input_ids=torch.tensor([ids])).logits.float()
    rel = float((g - c).norm() / c.norm())
    assert rel < 0.05, f"scaled_mm logits differ from the CPU emulation by {rel:.3g}"


def test_range_validation_on_gpu_equals_cpu(engine, fp8_model):
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.readiness import fp8_ranges
    gpu = fp8_ranges.run(engine.model).as_dict()
    cpu_engine = TorchEngine(fp8_model, device="cpu", dtype="bfloat16")
    cpu_engine.load_weights()
    cpu = fp8_ranges.run(cpu_engine.model).as_dict()
    for name in ("activations", "weights", "attention_scores"):
        assert gpu[name]["checked"] == cpu[name]["checked"] > 0
        assert gpu[name]["saturated"] == cpu[name]["saturated"] == 0
        assert gpu[name]["max_error"] == pytest.approx(cpu[name]["max_error"], rel=1e-5, abs=1e-7)
        assert gpu[name]["max_error"] <= 0.0625


def _agent(model_dir, data_dir, **env):
    from exporter.metrics import AgentMetrics
    from warmup_agent import config
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.pipeline import Agent
    cfg = config.load(env={"WARMUP_AGENT_MODEL_PATH": model_dir, "WARMUP_AGENT_DATA_DIR": data_dir,
                           "WARMUP_AGENT_MODEL_DEVICE": "cuda", "WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "0", **env})
    engine = TorchEngine(model_dir, dtype=cfg["model.dtype"], device=cfg["model.device"])
    metrics = AgentMetrics()
    return Agent(cfg, engine, metrics=metrics), engine, metrics


def test_agent_warms_every_fp8_gemm_shape_and_validates_ranges(fp8_model, tmp_path):
    from warmup_agent import quantization
    agent, engine, metrics = _agent(fp8_model, str(tmp_path))
    state = agent.run()
    assert state.name == "SERVING", (agent.sm.failure_reason, agent.sm.failure_message)
    rec = agent.record()
    assert rec["quantization"]["method"] == "fp8"
    stages = {s["name"]: s for s in rec["stages"]}
    assert stages["ready"]["validation"]["fp8_ranges"]["result"] == "passed"
    reg = metrics.registry
    assert reg.get_sample_value("warmup_model_quantization_info",
                                {"method": "fp8", "weight_dtype": "float8_e4m3fn", "kv_cache_dtype": "auto"}) == 1
    assert reg.get_sample_value("warmup_fp8_range_checked_values", {"range": "activations"}) == 50 * 28
    assert reg.get_sample_value("warmup_fp8_range_saturated_values", {"range": "weights"}) == 0
    if _hopper():
        assert stages["solidify"]["fp8_gemm"] == "scaled_mm_blockwise", stages["solidify"]
        assert stages["solidify"]["fp8_gemm_fallbacks"] == []
        assert stages["solidify"]["fp8_gemm_shapes"] > 0
        # Requests of traffic-like shapes after SERVING run no FP8 GEMM shape the warmup did not.
        warmed = quantization.kernel_shapes(engine.model)
        ids = engine.tokenize("an outside client asks something of ordinary length here")
        for batch, length in ((1, 20), (1, 37), (2, 11), (4, 128)):
            prompt = (ids * (length // len(ids) + 1))[:length]
            engine.generate([prompt] * batch, max_new_tokens=3)
        assert quantization.kernel_shapes(engine.model) <= warmed
    agent.stop()


def test_a_saturating_fp8_model_never_serves_on_gpu(embedded_model, tmp_path):
    from warmup_agent.quantization import quantize_checkpoint
    bad = str(tmp_path / "bad")
    # One layer's block scales shrunk 1000x: its weights no longer hold the seed's weight range.
    quantize_checkpoint(embedded_model, bad, scale_override={"model.layers.1.mlp.down_proj.weight": 1e-3})
    agent, _, metrics = _agent(bad, str(tmp_path / "data"))
    state = agent.run()
    assert state.name == "FAILED"
    assert agent.sm.failure_reason == "fp8_saturation", agent.sm.failure_message
    assert "model.layers.1.mlp.down_proj" in agent.sm.failure_message
    assert metrics.registry.get_sample_value("warmup_fp8_range_saturated_values", {"range": "weights"}) > 0
    agent.stop()
