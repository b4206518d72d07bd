"""FP8 layers in a model: swap linears for FP8BlockLinear, warm their GEMM shapes, write an FP8 checkpoint.

FP8BlockLinear runs transformers' "fp8" layout without transformers' FP8Linear, whose
Triton kernel is fetched from the Hub at first use (GPU hosts may have no network).  It
uses torch._scaled_mm where the GPU has blockwise FP8 GEMM and emulates elsewhere.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

from warmup_agent.errors import EngineError
from warmup_agent.quantization.detect import QuantizationInfo
from warmup_agent.quantization.fp8_math import (
    quantize_weight,
)

# Tensors of a quantized checkpoint never cast to the compute dtype.
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "activation_scale", "input_scale", "k_scale", "v_scale")


def layer_class() -> Any:
    """FP8BlockLinear (layer.py; imports torch on first use)."""
    from warmup_agent.quantization.layer import FP8BlockLinear
    return FP8BlockLinear


def fp8_layers(model: Any) -> list[tuple[str, Any]]:  # Any: FP8BlockLinear is built at run time
    cls = layer_class()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]


def kernel_shapes(model: Any) -> set[tuple[int, int, int]]:
    """Every (M, N, K) FP8 GEMM the model's FP8 layers have run."""
    return {(m, layer.out_features, layer.in_features) for _, layer in fp8_layers(model) for m in layer.m_seen}


def warm_gemms(model: Any, max_tokens: int, cap: int = 8192) -> dict:
    """Run each FP8 GEMM shape traffic can reach: every M up to max_tokens, once per distinct (N, K).

    The grid's forwards reach only the M values it sent; any other length would pay a first-use cost."""
    import time

    import torch
    layers: dict[tuple[int, int, bool], Any] = {}
    all_layers = fp8_layers(model)
    fallbacks = sorted({layer.fallback_reason for _, layer in all_layers if layer.fallback_reason})
    for _, layer in all_layers:
        if layer._fast:
            layers.setdefault((layer.out_features, layer.in_features, layer.activation_scale is None), layer)
    if not layers:   # emulation has no per-shape FP8 kernel to warm
        return {"fp8_gemm_shapes": 0, "fp8_gemm": "emulated", "fp8_gemm_fallbacks": fallbacks}
    t0 = time.perf_counter()
    top = max(1, min(max_tokens, cap))
    with torch.inference_mode():
        for layer in layers.values():
            x = torch.randn(top, layer.in_features, dtype=layer.compute_dtype, device=layer.weight.device)
            for m in range(1, top + 1):
                layer(x[:m])
    torch.cuda.synchronize()
    # Layers of the same (N, K) run the same GEMM.
    for _, layer in fp8_layers(model):
        if (layer.out_features, layer.in_features, layer.activation_scale is None) in layers:
            layer.m_seen |= set(range(1, top + 1))
    emulated = sum(1 for _, layer in all_layers if not layer._fast)
    return {"fp8_gemm": "mixed" if emulated else "scaled_mm_blockwise", "fp8_gemm_shapes": len(layers) * top,
            "fp8_gemm_max_tokens": top, "fp8_gemm_seconds": time.perf_counter() - t0,
            "fp8_layers_emulated": emulated, "fp8_gemm_fallbacks": fallbacks}


def swap_linears(model: Any, checkpoint_names: Any, info: QuantizationInfo, compute_dtype: Any) -> Any:
    """Replace each nn.Linear with a `weight_scale_inv` in the checkpoint by a meta FP8BlockLinear; the count."""
    import torch
    if not info.fp8_weights or info.method != "fp8":
        return 0
    block = info.weight_block_size
    if block is None:
        raise EngineError("quantization_unsupported",
                          "config.json: quantization_config without weight_block_size (per-tensor FP8): "
                          "the torch engine runs the 128x128 block layout only")
    cls = layer_class()
    names = set(checkpoint_names)
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and f"{name}.weight_scale_inv" in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device("meta"):
                layer = cls(module.in_features, module.out_features, block, module.bias is not None,
                            compute_dtype, info.activation_scheme)
            setattr(parent, child, layer)
            count += 1
    return count


def keeps_stored_dtype(name: str) -> bool:
    """Scale tensors stay float32 whatever the compute dtype."""
    return name.endswith(SCALE_SUFFIXES)


_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(src: str, dst: str, block: tuple[int, int] = (128, 128), activation_scheme: str = "dynamic",
                        activation_scale: float | None = None, scale_override: dict | None = None,
                        device: str = "cpu") -> dict:
    """Write an FP8 copy of a Hugging Face model directory with its decoder linears blockwise e4m3.

    `scale_override` multiplies a tensor's scales (tests build out-of-range models with it)."""
    import torch
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f), device=device))
        elif f != "config.json" and os.path.isfile(os.path.join(src, f)) and not f.startswith("."):
            shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dim() == 2 and any(f".{p}." in name for p in _QUANTIZED):
            q, scale = quantize_weight(t, block)
            base = name[: -len(".weight")]
            factor = (scale_override or {}).get(name)
            out[name] = q.cpu().contiguous()
            out[f"{base}.weight_scale_inv"] = (scale * factor if factor else scale).cpu().contiguous()
            if activation_scheme == "static":
                out[f"{base}.activation_scale"] = torch.tensor(float(activation_scale or 1.0), dtype=torch.float32)
        else:
            out[name] = t.cpu().contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": activation_scheme,
                                     "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    return config
