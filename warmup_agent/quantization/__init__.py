"""Quantized models: detection from a checkpoint or command line, and FP8 layers.

Only layer.py imports torch at its top, and it is loaded on first use.
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
