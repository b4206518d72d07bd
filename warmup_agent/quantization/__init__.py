"""Quantized models: what a checkpoint or a server command line says (detect.py, no
torch), and FP8 layers: the arithmetic (fp8_math.py), the layer (layer.py, the one
module that imports torch at its top, loaded on first use) and what runs a model
with them (kernels.py: swap, warm, write a checkpoint).  Every public name is
importable from here, as it was when this was one module.

Detection (issue 16): a checkpoint's config.json `quantization_config` (FP8 formats
first: transformers' "fp8" (FineGrainedFP8, DeepSeek-V3 style 128x128 blocks),
compressed-tensors float-quantized, fbgemm_fp8, modelopt FP8; other methods are
named but not looked into), and a server's command line (`--quantization fp8`,
`--kv-cache-dtype fp8`, TGI's `--quantize`).

FP8 layers: kernels.py's docstring says how `FP8BlockLinear` runs (blockwise-scaled
torch._scaled_mm on Hopper, emulation elsewhere) and why it is not transformers' own.
"""
from __future__ import annotations

from warmup_agent.quantization.detect import (
    QuantizationInfo,
    from_command_line,
    from_config,
    read_model_config,
)
from warmup_agent.quantization.fp8_math import (
    FP8_E4M3_MAX,
    block_scales,
    dequantize,
    expand_block_scales,
    fp8_dtype,
    quantize,
    quantize_weight,
    saturated_mask,
    scaled,
    scaled_mm_operands,
)
from warmup_agent.quantization.kernels import (
    SCALE_SUFFIXES,
    fp8_layers,
    keeps_stored_dtype,
    kernel_shapes,
    layer_class,
    quantize_checkpoint,
    swap_linears,
    warm_gemms,
)

__all__ = [
    "FP8_E4M3_MAX",
    "SCALE_SUFFIXES",
    "QuantizationInfo",
    "block_scales",
    "dequantize",
    "expand_block_scales",
    "fp8_dtype",
    "fp8_layers",
    "from_command_line",
    "from_config",
    "keeps_stored_dtype",
    "kernel_shapes",
    "layer_class",
    "quantize",
    "quantize_checkpoint",
    "quantize_weight",
    "read_model_config",
    "saturated_mask",
    "scaled",
    "scaled_mm_operands",
    "swap_linears",
    "warm_gemms",
]
