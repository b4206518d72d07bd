"""FP8 models on the CPU (issue 16; CI has no GPU, tests/test_fp8_cuda.py runs the
same on a CUDA device).

Detection of a quantized model from config.json and from a server's command line;
an FP8 checkpoint made locally from the random-weight embedded model, loaded by
the torch engine with emulated FP8 (torch's float8 dtypes convert on the CPU);
seed 003's range validation through every FP8 layer's quantize/dequantize path,
its counts checked against an independent computation from the checkpoint's own
tensors; a model whose scales cannot hold the seed's ranges fails with
fp8_saturation and never serves.

The independent computations use the seed's numbers as written here (not the
agent's SEED_RANGES), the scales read back from the safetensors file (not from the
loaded layers), torch.finfo(float8_e4m3fn).max (not the agent's constant) and a
plain float8 cast."""
from __future__ import annotations

import json
import math
import os
import shutil
import struct

import pytest

from warmup_agent import quantization
from warmup_agent.engines.base import EngineError
from warmup_agent.quantization import QuantizationInfo, from_command_line, from_config

# Seed 003 §3 ("混合精度下的特殊处理"): tensor, range, test cases.
SEED_TABLE = {"activations": (-12.8, 12.7, 50), "weights": (-0.00392, 0.00391, 30), "attention_scores": (0.0, 1.0, 20)}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BAD_LAYER = "model.layers.1.mlp.down_proj"
FAST = {"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
        "WARMUP_AGENT_READINESS_MIN_PROBES": "5", "WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "0",
        "WARMUP_AGENT_MODEL_DEVICE": "cpu"}


# --- detection: config.json --------------------------------------------------------------------
@pytest.mark.parametrize("qc, method, weight_dtype, kv, extra", [
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "fp8", "float8_e4m3fn", "auto", {"weight_block_size": (128, 128), "activation_scheme": "dynamic"}),
    ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "static"},
     "fp8", "float8_e5m2", "auto", {"weight_block_size": None, "activation_scheme": "static"}),
    ({"quant_method": "compressed-tensors",
      "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                                    "input_activations": {"type": "float", "num_bits": 8, "dynamic": True}}},
      "kv_cache_scheme": {"type": "float", "num_bits": 8}},
     "compressed-tensors", "float8_e4m3fn", "fp8_e4m3", {"activation_scheme": "dynamic"}),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "fbgemm_fp8", "float8_e4m3fn", "auto", {}),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
     "modelopt", "float8_e4m3fn", "fp8_e4m3", {"activation_scheme": "static"}),
])
def test_config_json_fp8_formats_are_detected(qc, method, weight_dtype, kv, extra):
    info = from_config({"model_type": "llama", "quantization_config": qc})
    assert (info.method, info.weight_dtype, info.kv_cache_dtype) == (method, weight_dtype, kv)
    assert info.fp8 and info.fp8_weights and info.source == "config.json"
    for k, v in extra.items():
        assert getattr(info, k) == v, k
    assert info.labels() == {"method": method, "weight_dtype": weight_dtype, "kv_cache_dtype": kv}
    json.dumps(info.as_dict())      # goes into the run record as it is


@pytest.mark.parametrize("qc, method, weight_dtype", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq", "int4"),
    ({"quant_method": "gptq", "bits": 8}, "gptq", "int8"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes", "unknown"),
    ({"quant_method": "compressed-tensors",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}}}}, "compressed-tensors", "int4"),
    ({"quant_method": "something-new"}, "other", "unknown"),
])
def test_config_json_other_quantizations_are_named_but_not_fp8(qc, method, weight_dtype):
    info = from_config({"quantization_config": qc})
    assert (info.method, info.weight_dtype, info.kv_cache_dtype) == (method, weight_dtype, "auto")
    assert not info.fp8 and not info.fp8_weights


def test_unquantized_config_json():
    info = from_config({"model_type": "llama", "torch_dtype": "bfloat16"})
    assert info == QuantizationInfo()
    assert info.labels() == {"method": "none", "weight_dtype": "unquantized", "kv_cache_dtype": "auto"}
    assert not info.fp8 and info.source == "none"


@pytest.mark.parametrize("qc, words", [
    ([1, 2], "key 'quantization_config': expected a JSON object, got list"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "key 'quantization_config.weight_block_size': got [128]"),
    ({"quant_method": "fp8", "weight_block_size": [128, True]}, "expected two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "key 'quantization_config.activation_scheme': got 'sometimes'"),
])
def test_malformed_quantization_config_is_one_line_naming_the_key(qc, words):
    with pytest.raises(EngineError) as e:
        from_config({"quantization_config": qc}, "/m/config.json")
    assert e.value.reason == "config_invalid"
    assert str(e.value).count("\n") == 0 and words in str(e.value) and "/m/config.json" in str(e.value)


# --- detection: server command lines ----------------------------------------------------------
@pytest.mark.parametrize("command, method, weight_dtype, kv", [
    (["vllm", "serve", "m", "--quantization", "fp8"], "fp8", "float8_e4m3fn", "auto"),
    (["vllm", "serve", "m", "--quantization=fp8"], "fp8", "float8_e4m3fn", "auto"),
    (["python", "-m", "sglang.launch_server", "--model-path", "m", "--quantization", "FP8"], "fp8", "float8_e4m3fn", "auto"),
    (["vllm", "serve", "m", "-q", "fp8"], "fp8", "float8_e4m3fn", "auto"),
    (["text-generation-launcher", "--model-id", "m", "--quantize", "fp8"], "fp8", "float8_e4m3fn", "auto"),
    (["vllm", "serve", "m", "--kv-cache-dtype", "fp8"], "none", "unquantized", "fp8"),
    (["vllm", "serve", "m", "--kv-cache-dtype=fp8_e5m2"], "none", "unquantized", "fp8_e5m2"),
    (["vllm", "serve", "m", "--quantization=fp8", "--kv-cache-dtype", "fp8_e4m3"], "fp8", "float8_e4m3fn", "fp8_e4m3"),
])
def test_server_flags_fp8(command, method, weight_dtype, kv):
    info = from_command_line(command)
    assert (info.method, info.weight_dtype, info.kv_cache_dtype) == (method, weight_dtype, kv)
    assert info.fp8 and info.source == "command line"
    assert info.fp8_weights == (weight_dtype != "unquantized")


@pytest.mark.parametrize("command, method, weight_dtype, kv", [
    (["vllm", "serve", "m"], "none", "unquantized", "auto"),
    (["vllm", "serve", "m", "--quantization", "awq"], "awq", "unknown", "auto"),
    (["vllm", "serve", "m", "--quantization=gptq", "--kv-cache-dtype=auto"], "gptq", "unknown", "auto"),
    (["vllm", "serve", "m", "--kv-cache-dtype", "bfloat16"], "none", "unquantized", "bfloat16"),
    (["llama-server", "-m", "m.gguf", "--quantization"], "none", "unquantized", "auto"),   # flag without a value
])
def test_server_flags_not_fp8(command, method, weight_dtype, kv):
    info = from_command_line(command)
    assert (info.method, info.weight_dtype, info.kv_cache_dtype) == (method, weight_dtype, kv)
    assert not info.fp8


def test_server_flags_over_config_json():
    model = from_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    info = from_command_line(["vllm", "serve", "m", "--kv-cache-dtype=fp8"], model)
    assert (info.method, info.weight_dtype, info.kv_cache_dtype) == ("fp8", "float8_e4m3fn", "fp8")
    assert info.weight_block_size == (128, 128) and info.source == "config.json + command line"
    assert model.kv_cache_dtype == "auto"       # the config's own info is not changed
    assert from_command_line(None, model) == model


def test_openai_engine_detects_from_its_server_command_and_the_model_directory(tmp_path, clean_env):
    from tests.helpers.engines import openai_engine
    from warmup_agent import config
    from warmup_agent.readiness import validation
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    cfg = config.load(env={"WARMUP_AGENT_ENGINE": "openai"})
    e = openai_engine(cfg, ["vllm", "serve", str(tmp_path), "--port", "18999", "--kv-cache-dtype", "fp8"])
    assert e.quantization.labels() == {"method": "fp8", "weight_dtype": "float8_e4m3fn", "kv_cache_dtype": "fp8"}
    assert e.quantization.source == "config.json + command line"
    # A hub id (no local config.json): the flags alone.
    e2 = openai_engine(cfg, ["vllm", "serve", "org/some-model", "--port", "18999", "--quantization=fp8"])
    assert e2.quantization.labels()["method"] == "fp8" and e2.quantization.source == "command line"
    # The agent cannot see a server's scales: the range check says so instead of passing.
    c = validation.check_fp8_ranges(e, 0.0, 0.0625)
    assert c.result == "skipped" and "docs/fp8.md" in c.message and c.ok
    e3 = openai_engine(cfg, ["vllm", "serve", "org/some-model", "--port", "18999"])
    assert validation.check_fp8_ranges(e3, 0.0, 0.0625).message == "the model is not quantized to FP8"


def test_vllm_engine_detects_from_the_model_config_json(tmp_path, clean_env):
    from warmup_agent import config
    from warmup_agent.engines.vllm_engine import VllmEngine
    from warmup_agent.readiness import validation
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "quantization_config": {"quant_method": "fbgemm_fp8"}}))
    cfg = config.load(env={})
    sections = dict(vllm=cfg.vllm, model=cfg.model, lora=cfg.lora, data_dir=cfg.data_dir)
    e = VllmEngine(str(tmp_path), **sections)        # vLLM itself is imported only when loading
    assert e.quantization.labels() == {"method": "fbgemm_fp8", "weight_dtype": "float8_e4m3fn", "kv_cache_dtype": "auto"}
    c = validation.check_fp8_ranges(e, 0.0, 0.0625)
    assert c.result == "skipped" and "vllm does not expose its layers' FP8 scales" in c.message
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": 7}}))
    assert VllmEngine(str(tmp_path), **sections).quantization == QuantizationInfo()   # malformed: vLLM will say so


# --- an FP8 checkpoint of the embedded model -----------------------------------------------------
def _safetensors(path: str):
    """(header, raw bytes) of a safetensors file, read without the safetensors library."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        return header, f.read()


def _tensor(header, data, name):
    """A float8/float32/bfloat16 tensor from raw bytes."""
    import torch
    meta = header[name]
    dtype = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16}[meta["dtype"]]
    a, b = meta["data_offsets"]
    return torch.frombuffer(bytearray(data[a:b]), dtype=dtype).reshape(meta["shape"])


@pytest.fixture(scope="module")
def fp8_model(embedded_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fp8") / "model")
    quantization.quantize_checkpoint(embedded_model, out)
    return out


@pytest.fixture(scope="module")
def bad_model(embedded_model, tmp_path_factory):
    """One layer's block scales shrunk 1000x: its weights cannot hold the seed's weight range."""
    out = str(tmp_path_factory.mktemp("fp8bad") / "model")
    quantization.quantize_checkpoint(embedded_model, out, scale_override={f"{BAD_LAYER}.weight": 1e-3})
    return out


def _engine(path, dtype="auto"):
    from warmup_agent.engines.torch.engine import TorchEngine
    e = TorchEngine(path, device="cpu", dtype=dtype)
    e.load_weights()
    return e


@pytest.fixture(scope="module")
def fp8_engine(fp8_model):
    return _engine(fp8_model)


@pytest.fixture(scope="module")
def bad_engine(bad_model):
    return _engine(bad_model)


def test_checkpoint_is_transformers_fp8_layout_and_dequantizes_to_the_original(embedded_model, fp8_model):
    import torch
    src_header, src = _safetensors(os.path.join(embedded_model, "model.safetensors"))
    header, data = _safetensors(os.path.join(fp8_model, "model.safetensors"))
    with open(os.path.join(fp8_model, "config.json"), encoding="utf-8") as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    fp8 = sorted(n for n, m in header.items() if n != "__metadata__" and m["dtype"] == "F8_E4M3")
    assert len(fp8) == 4 * len(LINEARS) and all(any(f".{p}." in n for p in LINEARS) for n in fp8)
    for name in fp8:
        w = _tensor(header, data, name).float()
        s = _tensor(header, data, name.replace(".weight", ".weight_scale_inv"))
        n, k = w.shape
        assert tuple(s.shape) == (math.ceil(n / 128), math.ceil(k / 128))
        orig = _tensor(src_header, src, name).float()
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                block = orig[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                assert float(s[i, j]) == pytest.approx(float(block.abs().max()) / 448, rel=1e-6)
                deq = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] * s[i, j]
                assert float((deq - block).abs().max()) <= float(block.abs().max()) * 2 ** -4
    # Everything else is as it was.
    assert {n for n, m in header.items() if m.get("dtype") == "BF16"} == \
        {n for n in src_header if n != "__metadata__" and n not in fp8}
    assert torch.equal(_tensor(header, data, "lm_head.weight"), _tensor(src_header, src, "lm_head.weight"))


def test_torch_engine_loads_fp8_on_cpu_with_emulated_layers(fp8_engine, embedded_model):
    import torch
    e = fp8_engine
    assert e.quantization.labels() == {"method": "fp8", "weight_dtype": "float8_e4m3fn", "kv_cache_dtype": "auto"}
    assert e.quantization.weight_block_size == (128, 128) and e.quantization.source == "config.json"
    layers = quantization.fp8_layers(e.model)
    assert e.fp8_layers == len(layers) == 4 * len(LINEARS)
    assert {n.rsplit(".", 1)[1] for n, _ in layers} == set(LINEARS)
    assert not any(isinstance(m, torch.nn.Linear) for n, m in e.model.named_modules() if n.endswith(LINEARS))
    for _, layer in layers:
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
    # One layer's forward equals float64 of operands quantized here by hand: input per
    # token and 128-wide group at amax / 448, weight from the file's bytes.
    name, layer = layers[5]
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    s = x.reshape(3, -1, 128).abs().amax(-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    xd = ((x.reshape(3, -1, 128) / s).to(torch.float8_e4m3fn).double() * s.double()).reshape(3, -1)
    wd = layer.weight.double() * layer.weight_scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    with torch.inference_mode():
        y = layer(x).double()
        assert layer._fast is False      # the CPU emulates
    ref = xd @ wd.T
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5, name
    # The whole model generates, and its logits stay near the unquantized model's.
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([[5, 17, 300, 1200, 42, 7, 9, 11]])
    with torch.inference_mode():
        full = AutoModelForCausalLM.from_pretrained(embedded_model, torch_dtype=torch.float32)(input_ids=ids).logits
        q = e.model(input_ids=ids).logits.float()
    assert torch.isfinite(q).all()
    assert float((q - full).norm() / full.norm()) < 0.1


def test_torch_engine_refuses_a_quantization_it_cannot_run(embedded_model, tmp_path):
    from warmup_agent.engines.torch.engine import TorchEngine
    d = tmp_path / "awq"
    shutil.copytree(embedded_model, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError) as e:
        TorchEngine(str(d), device="cpu").load_weights()
    assert e.value.reason == "quantization_unsupported" and "awq" in str(e.value) and "engine openai" in str(e.value)


# --- range validation ---------------------------------------------------------------------------
def _expected(model_dir, static_activation_scale=None):
    """The seed's cases against the checkpoint's scales, computed here from the file:
    {range: (checked, saturated, max round-trip error / the range's peak)}."""
    import torch
    fmax = torch.finfo(torch.float8_e4m3fn).max
    header, data = _safetensors(os.path.join(model_dir, "model.safetensors"))
    scales = [_tensor(header, data, n) for n in sorted(header) if n.endswith(".weight_scale_inv")]
    layers = len(scales)

    def roundtrip(x, s):
        # x, s float64.  Saturated: beyond e4m3's largest value by more than float32
        # arithmetic noise (a dynamic scale, amax / 448, lands its own amax on 448
        # within one float32 ulp: that value is not saturated, and a validation that
        # counted it would fail every healthy model).
        scaled = x / s
        sat = int((scaled.abs() > fmax * (1 + 2 ** -20)).sum())
        back = scaled.clamp(-fmax, fmax).float().to(torch.float8_e4m3fn).double() * s
        return sat, float((back - x).abs().max())

    out = {}
    lo, hi, n = SEED_TABLE["activations"]
    x = torch.linspace(lo, hi, n, dtype=torch.float32).double()
    peak = max(abs(lo), abs(hi))
    # dynamic: one group holds all 50 cases, so its scale is the largest |case| / 448
    s = torch.tensor(static_activation_scale if static_activation_scale else float(x.abs().max()) / fmax,
                     dtype=torch.float32).double()
    sat, err = roundtrip(x, s)
    out["activations"] = (n * layers, sat * layers, err / peak)
    lo, hi, n = SEED_TABLE["weights"]
    x = torch.linspace(lo, hi, n, dtype=torch.float32).double()
    sat, err, checked = 0, 0.0, 0
    for sc in scales:
        for v in sc.reshape(-1).double():
            a, b = roundtrip(x, v)
            sat, err, checked = sat + a, max(err, b), checked + n
    out["weights"] = (checked, sat, err / max(abs(lo), abs(hi)))
    lo, hi, n = SEED_TABLE["attention_scores"]
    x = torch.linspace(lo, hi, n, dtype=torch.float32).double()
    sat, err = roundtrip(x, torch.tensor(1.0, dtype=torch.float64))
    out["attention_scores"] = (n, sat, err / max(abs(lo), abs(hi)))
    return out


def _assert_report_matches(report, expected):
    assert set(report) == set(SEED_TABLE)
    for name, (checked, saturated, error) in expected.items():
        r = report[name]
        assert (r["checked"], r["saturated"]) == (checked, saturated), name
        assert r["saturated_ratio"] == pytest.approx(saturated / checked)
        assert r["max_error"] == pytest.approx(error, rel=1e-4, abs=1e-9), name


def test_seed_ranges_are_the_seed_table():
    from warmup_agent.readiness import fp8_ranges
    assert {r.name: (r.low, r.high, r.cases) for r in fp8_ranges.SEED_RANGES} == SEED_TABLE


def test_healthy_fp8_model_passes_with_counts_from_its_own_scales(fp8_engine, fp8_model):
    from warmup_agent.readiness import fp8_ranges, validation
    report = fp8_ranges.run(fp8_engine.model).as_dict()
    expected = _expected(fp8_model)
    _assert_report_matches(report, expected)
    assert report["activations"]["checked"] == 50 * 28 and report["attention_scores"]["checked"] == 20
    assert all(r["saturated"] == 0 and 0 < r["max_error"] <= 2 ** -4 for r in report.values())
    assert report["activations"]["scale_source"] == "dynamic activation scale"
    c = validation.check_fp8_ranges(fp8_engine, 0.0, 0.0625)
    assert c.result == "passed" and c.ok and c.detail["ranges"] == report
    assert validation.check_structure(fp8_engine).result == "passed"   # the FP8 layers' shapes follow config.json


def test_shrunk_scales_fail_with_fp8_saturation_above_the_limit(bad_engine, bad_model):
    from warmup_agent.readiness import fp8_ranges, validation
    expected = _expected(bad_model)
    report = fp8_ranges.run(bad_engine.model).as_dict()
    _assert_report_matches(report, expected)
    checked, saturated, _ = expected["weights"]
    # down_proj [256, 512] has 2 x 4 blocks; every case saturates at 1/1000 of a fitting scale
    assert saturated == 30 * 8 and report["weights"]["worst_layer"] == BAD_LAYER
    assert expected["activations"][1] == expected["attention_scores"][1] == 0
    ratio = saturated / checked
    c = validation.check_fp8_ranges(bad_engine, 0.0, 0.0625)
    assert c.result == "failed" and not c.ok and c.reason == "fp8_saturation"
    assert f"{saturated} of {checked} FP8 weights" in c.message and BAD_LAYER in c.message
    assert "validation.fp8_max_saturated_ratio" in c.message
    # The limit is a limit: just under the ratio still fails, at it saturation passes
    # (and the saturated values' round-trip error is then the reason).
    assert validation.check_fp8_ranges(bad_engine, ratio * 0.999, 0.0625).reason == "fp8_saturation"
    c = validation.check_fp8_ranges(bad_engine, ratio, 0.0625)
    assert c.reason == "fp8_roundtrip_error" and "validation.fp8_max_roundtrip_error" in c.message
    assert validation.check_fp8_ranges(bad_engine, ratio, 1.0).result == "passed"


def test_static_activation_scale_is_the_one_validated(embedded_model, tmp_path):
    """A checkpoint whose static activation scale (0.01) cannot hold +-12.8: every
    case beyond 4.48 saturates, in every layer."""
    d = str(tmp_path / "static")
    quantization.quantize_checkpoint(embedded_model, d, activation_scheme="static", activation_scale=0.01)
    engine = _engine(d)
    assert engine.quantization.activation_scheme == "static"
    from warmup_agent.readiness import fp8_ranges, validation
    report = fp8_ranges.run(engine.model).as_dict()
    expected = _expected(d, static_activation_scale=0.01)
    _assert_report_matches(report, expected)
    beyond = sum(1 for i in range(50) if abs(-12.8 + i * (12.7 + 12.8) / 49) > 4.48)
    assert expected["activations"][1] == beyond * 28 and beyond == 32
    assert report["activations"]["scale_source"] == "static activation scale"
    assert validation.check_fp8_ranges(engine, 0.0, 0.0625).reason == "fp8_saturation"


def test_fp8_limits_are_checked_config_keys(clean_env):
    from warmup_agent import config
    cfg = config.load(env={})
    assert (cfg["validation.fp8_ranges"], cfg["validation.fp8_max_saturated_ratio"],
            cfg["validation.fp8_max_roundtrip_error"]) == (True, 0.0, 0.0625)
    for key, value, expected in (("FP8_MAX_SATURATED_RATIO", "1.5", "expected a number from 0 to 1"),
                                 ("FP8_MAX_ROUNDTRIP_ERROR", "0", "expected a number > 0 and <= 1")):
        with pytest.raises(config.ConfigError) as e:
            config.load(env={f"WARMUP_AGENT_VALIDATION_{key}": value})
        assert "\n" not in str(e.value) and f"validation.{key.lower()}" in str(e.value) and expected in str(e.value)


# --- the agent: info metric, run record, never SERVING -----------------------------------------
def _run_agent(model_dir, data_dir, **env):
    from exporter.metrics import AgentMetrics
    from warmup_agent import config
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.pipeline import Agent
    cfg = config.load(env={**FAST, "WARMUP_AGENT_MODEL_PATH": model_dir, "WARMUP_AGENT_DATA_DIR": data_dir, **env})
    agent = Agent(cfg, TorchEngine(model_dir, dtype=cfg["model.dtype"], device=cfg["model.device"]), metrics=AgentMetrics())
    state = agent.run()
    agent.stop()
    return agent, state


def _sample(agent, name, labels=None):
    return agent.metrics.registry.get_sample_value(name, labels or {})


def test_agent_serves_a_healthy_fp8_model_and_exports_its_quantization(fp8_model, tmp_path, clean_env):
    from warmup_agent.states import State
    agent, state = _run_agent(fp8_model, str(tmp_path))
    assert state == State.SERVING, (agent.sm.failure_reason, agent.sm.failure_message)
    assert _sample(agent, "warmup_model_quantization_info",
                   {"method": "fp8", "weight_dtype": "float8_e4m3fn", "kv_cache_dtype": "auto"}) == 1
    rec = agent.record()
    assert rec["quantization"]["method"] == "fp8" and rec["quantization"]["weight_block_size"] == [128, 128]
    json.dumps(rec)
    v = {s["name"]: s for s in rec["stages"]}["ready"]["validation"]["fp8_ranges"]
    assert v["result"] == "passed"
    expected = _expected(fp8_model)
    for name, (checked, saturated, error) in expected.items():
        assert _sample(agent, "warmup_fp8_range_checked_values", {"range": name}) == checked
        assert _sample(agent, "warmup_fp8_range_saturated_values", {"range": name}) == saturated == 0
        assert _sample(agent, "warmup_fp8_range_roundtrip_error_ratio", {"range": name}) == pytest.approx(error, rel=1e-4)
    assert _sample(agent, "warmup_validation_checks_total", {"check": "fp8_ranges", "result": "passed"}) == 1


def test_agent_never_serves_a_model_whose_scales_saturate(bad_model, tmp_path, clean_env):
    from warmup_agent.states import State
    agent, state = _run_agent(bad_model, str(tmp_path))
    assert state == State.FAILED
    assert State.SERVING not in [s for s, _ in agent.sm.history]
    assert agent.sm.failure_reason == "fp8_saturation" and BAD_LAYER in agent.sm.failure_message
    assert _sample(agent, "model_loading_failures_total", {"reason": "fp8_saturation"}) == 1
    assert _sample(agent, "warmup_validation_checks_total", {"check": "fp8_ranges", "result": "failed"}) == 1
    assert _sample(agent, "warmup_validation_checks_total", {"check": "numerics", "result": "passed"}) == 1
    _, saturated = _expected(bad_model)["weights"][:2]
    assert _sample(agent, "warmup_fp8_range_saturated_values", {"range": "weights"}) == saturated > 0
    rec = agent.record()
    assert rec["final_state"] == "FAILED" and rec["failure_reason"] == "fp8_saturation"
    assert {s["name"]: s for s in rec["stages"]}["ready"]["validation"]["fp8_ranges"]["result"] == "failed"
    assert rec["quantization"]["weight_dtype"] == "float8_e4m3fn"


def test_agent_limits_come_from_the_config(bad_model, tmp_path, clean_env):
    from warmup_agent.states import State
    agent, state = _run_agent(bad_model, str(tmp_path), WARMUP_AGENT_VALIDATION_FP8_MAX_SATURATED_RATIO="1",
                              WARMUP_AGENT_VALIDATION_FP8_MAX_ROUNDTRIP_ERROR="1")
    assert state == State.SERVING, (agent.sm.failure_reason, agent.sm.failure_message)
    agent, state = _run_agent(bad_model, str(tmp_path / "off"), WARMUP_AGENT_VALIDATION_FP8_RANGES="false")
    assert state == State.SERVING
    assert "fp8_ranges" not in agent.stages[-1].detail["validation"]
    assert _sample(agent, "warmup_fp8_range_checked_values", {"range": "weights"}) is None


# --- the fast path's operand layout, checked on the CPU ----------------------------------------
def _blockwise_scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, strict_stride=True):
    """What torch._scaled_mm's blockwise path (1x128 x 128x128) computes, with the
    layout checks of torch 2.11 (ScaledBlas.cpp is_blockwise_1x128_scaling and
    is_blockwise_128x128_scaling, the latter on b.t() / scale_b.t(), row stride
    exactly ceil(K/128)); these refused a K=8960 layer on the H200."""
    m, k = a.shape
    n = b.shape[1]
    g = math.ceil(k / 128)
    assert b.stride() == (1, k), "b must be column-major"
    assert scale_a.shape == (m, g) and scale_a.stride() == (1, m), "Invalid scaling configuration (scale_a)"
    sbt = scale_b.t()
    assert sbt.shape == (math.ceil(n / 128), g) and sbt.stride() == (g, 1), "Invalid scaling configuration (scale_b)"
    assert g % 4 == 0 and m % 4 == 0, "cuBLASLt: scale leading dimensions must be multiples of 4 floats"
    ad = a.float() * scale_a.repeat_interleave(128, dim=1)[:, :k]
    bd = b.float() * scale_b.repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    return (ad @ bd).to(out_dtype)


@pytest.mark.parametrize("k", [256, 640, 1536])       # K/128 = 2, 5, 12: padded to 4, 8, 12 groups
def test_fast_path_operands_fit_torch_layout_checks_and_match_the_emulation(k, monkeypatch):
    import torch
    torch.manual_seed(0)
    layer = quantization.layer_class()(k, 256, (128, 128), bias=False, compute_dtype=torch.float32)
    w = torch.randn(256, k) * 0.02
    q, s = quantization.quantize_weight(w, (128, 128))
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    monkeypatch.setattr(torch, "_scaled_mm", _blockwise_scaled_mm_reference, raising=False)
    monkeypatch.setattr(quantization.fp8_math, "_scaled_mm_ok", lambda *a: True)
    x = torch.randn(37, k)                            # M=37: padded to 40 rows
    with torch.inference_mode():
        y = layer(x)
    assert layer._fast is True, layer.fallback_reason
    # the fast path's operands are no new parameters (the structure check counts them)
    assert set(layer.state_dict()) == {"weight", "weight_scale_inv"}
    assert layer._weight_mm.shape == (256, k + (-(k // 128) % 4) * 128)
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)), "the layer's weight still reads as loaded"
    ref = layer._emulated(x)
    assert y.shape == (37, 256)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


def _refusing_scaled_mm(*a, **kw):
    raise RuntimeError("Invalid scaling configuration\nmore detail")


def _wrong_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    import torch
    return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)


@pytest.mark.parametrize("gemm, reason", [(_refusing_scaled_mm, "torch._scaled_mm failed: Invalid scaling configuration"),
                                          (_wrong_scaled_mm, "torch._scaled_mm differs from the emulation by 1 of the peak")])
def test_a_layer_that_falls_back_emulates_on_its_own_unpadded_weight(gemm, reason, monkeypatch):
    """K=640 pads to 1024 for the fast path; a layer that then falls back must not keep
    the padded buffer alive behind its weight (1.6x its bytes here, 3 % at K=8960)."""
    import torch
    torch.manual_seed(0)
    k, n = 640, 256
    layer = quantization.layer_class()(k, n, (128, 128), bias=False, compute_dtype=torch.float32)
    q, s = quantization.quantize_weight(torch.randn(n, k) * 0.02, (128, 128))
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    monkeypatch.setattr(torch, "_scaled_mm", gemm, raising=False)
    monkeypatch.setattr(quantization.fp8_math, "_scaled_mm_ok", lambda *a: True)
    x = torch.randn(8, k)
    with torch.inference_mode():
        y = layer(x)
    assert layer._fast is False
    assert layer.fallback_reason == reason
    assert layer.weight.untyped_storage().nbytes() == n * k, "the padded operand still backs the weight"
    assert layer.weight.is_contiguous() and layer._weight_mm is None and layer._scale_b is None
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)), "the weight still reads as loaded"
    assert set(layer.state_dict()) == {"weight", "weight_scale_inv"}
    assert torch.allclose(y, layer._emulated(x))


def test_unpadded_scale_stride_is_what_torch_2_11_refuses():
    """The layout before the fix (scale rows padded in place of K): the check that failed on the H200."""
    import torch
    k, n = 640, 256
    a = torch.zeros(8, k, dtype=torch.float8_e4m3fn)
    b = torch.zeros(n, k, dtype=torch.float8_e4m3fn).t()
    buf = torch.ones(n // 128, 8)
    with pytest.raises(AssertionError, match="scale_b"):
        _blockwise_scaled_mm_reference(a, b, torch.ones(5, 8).t(), buf[:, :5].t(), torch.float32)
