"""Which models the native (plain-torch) implementation runs, from config.json alone.

Any key that would change the numbers and is not implemented makes the model
ineligible, with a reason.  Imports no torch, so the choice is made at once.
"""
from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class NativeConfig:
    """The shape and numerics of a Llama/Qwen2 decoder, as transformers reads them."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # llama3 rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3: tuple[float, float, float, int] | None
    qkv_bias: bool         # qwen2: always; llama: attention_bias
    o_bias: bool           # llama: attention_bias; qwen2: never
    mlp_bias: bool         # llama: mlp_bias; qwen2: never
    tie_word_embeddings: bool
    max_position_embeddings: int


class Ineligible(Exception):
    """config.json asks for something the native implementation does not do."""


def _int(raw: dict, key: str) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise Ineligible(f"{key} is {v!r}, not a positive integer")
    return v


def _rope(raw: dict) -> tuple[float, tuple[float, float, float, int] | None]:
    """(rope_theta, llama3 parameters or None), from `rope_parameters` or the older `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise Ineligible("per-layer-type rope parameters")
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise Ineligible(f"rope_theta is {theta!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0 or raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise Ineligible("partial_rotary_factor is not 1")
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise Ineligible(f"rope type {kind!r} (native: default, llama3)")
    try:
        llama3 = (float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                  int(params.get("original_max_position_embeddings") or raw["max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        raise Ineligible(f"llama3 rope parameters incomplete ({e})") from None
    if llama3[1] == llama3[2]:
        raise Ineligible("llama3 rope with low_freq_factor == high_freq_factor")
    return float(theta), llama3


def _check_supported(raw: dict) -> str:
    """The model_type, or Ineligible naming the first thing not implemented."""
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise Ineligible(f"model_type {model_type!r} has no native implementation (native: llama, qwen2)")
    if raw.get("auto_map"):
        raise Ineligible("remote code (auto_map)")
    archs = raw.get("architectures") or [ARCHITECTURES[model_type]]
    if archs[0] != ARCHITECTURES[model_type]:
        raise Ineligible(f"architecture {archs[0]!r} (native: {ARCHITECTURES[model_type]})")
    if raw.get("quantization_config"):
        raise Ineligible("quantization_config (quantized weights run on transformers)")
    if raw.get("hidden_act", "silu") != "silu":
        raise Ineligible(f"hidden_act {raw.get('hidden_act')!r} (native: silu)")
    if raw.get("use_sliding_window"):
        raise Ineligible("sliding window attention in use (use_sliding_window)")
    if any(t != "full_attention" for t in raw.get("layer_types") or []):
        raise Ineligible("layer_types other than full_attention")
    return str(model_type)


def parse(raw: dict) -> NativeConfig:
    """The NativeConfig for a config.json mapping, or Ineligible(reason)."""
    model_type = _check_supported(raw)
    hidden, heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    for key in _REQUIRED:
        _int(raw, key)
    kv_heads = _int(raw, "num_key_value_heads") if raw.get("num_key_value_heads") is not None else heads
    if heads % kv_heads:
        raise Ineligible(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = _int(raw, "head_dim") if raw.get("head_dim") is not None else hidden // heads
    theta, llama3 = _rope(raw)
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise Ineligible(f"rms_norm_eps is {eps!r}")
    llama = model_type == "llama"
    return NativeConfig(
        model_type=model_type, vocab_size=raw["vocab_size"], hidden_size=hidden,
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(eps), rope_theta=theta, rope_llama3=llama3,
        qkv_bias=bool(raw.get("attention_bias", False)) if llama else True,
        o_bias=bool(raw.get("attention_bias", False)) if llama else False,
        mlp_bias=bool(raw.get("mlp_bias", False)) if llama else False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 0))


def ineligible_reason(raw: dict) -> str:
    """'' when the native implementation runs this config.json, else why not (one line)."""
    try:
        parse(raw)
    except Ineligible as e:
        return str(e)
    return ""
