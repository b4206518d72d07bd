"""Quantized models (issue 16, seed 003 §3): what the model is quantized to, and the
FP8 range validation's counts (warmup_agent/quantization/,
warmup_agent/readiness/fp8_ranges.py)."""
from exporter.metric_spec import MetricSpec

SPECS = (
    MetricSpec("warmup_model_quantization_info", "info",
               "The model's quantization as the agent detected it (config.json quantization_config, server flags); value is always 1.",
               labels=("method", "weight_dtype", "kv_cache_dtype"), unit="short",
               doc="method: fp8, compressed-tensors, fbgemm_fp8, modelopt, awq, gptq, ..., other, none. "
                   "weight_dtype: float8_e4m3fn, float8_e5m2, int8, int4, unquantized, unknown. "
                   "kv_cache_dtype: auto or the server's --kv-cache-dtype (fp8, fp8_e4m3, fp8_e5m2). Set once the weights are loaded."),
    MetricSpec("warmup_fp8_range_checked_values", "gauge",
               "Values of the seed's FP8 range cases put through the model's quantize/dequantize path at the last validation, by range (activations, weights, attention_scores).",
               labels=("range",), unit="short", requires="fp8_model",
               doc="activations: 50 cases per FP8 layer; weights: 30 cases x every weight block scale of every FP8 layer; "
                   "attention_scores: 20 cases once. Absent for a model that is not FP8 or whose layers the agent cannot see (server engines)."),
    MetricSpec("warmup_fp8_range_saturated_values", "gauge",
               "Of those, values beyond the e4m3 range at their scale (|x / scale| > 448, clamped by the cast), by range.",
               labels=("range",), unit="short", requires="fp8_model",
               doc="Above validation.fp8_max_saturated_ratio of the checked values the agent fails with reason fp8_saturation."),
    MetricSpec("warmup_fp8_range_roundtrip_error_ratio", "gauge",
               "Largest FP8 round-trip error of the range's cases, max |dequantize(quantize(x)) - x| / the range's largest |x|, by range.",
               labels=("range",), unit="percentunit", requires="fp8_model",
               doc="At most 2^-4 for a scale that fits; above validation.fp8_max_roundtrip_error the agent fails with reason fp8_roundtrip_error."),
)
