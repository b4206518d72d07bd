"""A model's quantization, from config.json's `quantization_config` and the server's flags (no torch).

FP8 formats are read in detail; other methods are named only.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from warmup_agent.errors import EngineError

_KNOWN_METHODS = {"fp8", "compressed-tensors", "fbgemm_fp8", "modelopt", "awq", "gptq", "bitsandbytes", "torchao",
                  "hqq", "quanto", "eetq", "aqlm", "mxfp4", "bitnet", "fp_quant", "higgs", "vptq", "spqr", "gguf",
                  "marlin", "experts_int8", "auto-round", "quark", "none"}
_FP8_WORDS = {"fp8", "fp8_e4m3", "fp8_e5m2", "float8", "float8_e4m3fn", "e4m3", "e5m2", "modelopt", "fbgemm_fp8"}


@dataclass
class QuantizationInfo:
    """What the agent knows about a model's quantization; label values come from small fixed sets."""
    method: str = "none"            # fp8 | compressed-tensors | fbgemm_fp8 | modelopt | awq | ... | other | none
    weight_dtype: str = "unquantized"   # float8_e4m3fn | float8_e5m2 | int8 | int4 | unquantized | unknown
    kv_cache_dtype: str = "auto"    # auto | fp8 | fp8_e4m3 | fp8_e5m2 | ...
    activation_scheme: str = ""     # dynamic | static | "" (not said)
    weight_block_size: tuple | None = None   # (rows, cols) per scale; None: not blockwise
    source: str = "none"            # config.json | command line | config.json + command line | none

    @property
    def fp8_weights(self) -> bool:
        return self.weight_dtype.startswith("float8")

    @property
    def fp8(self) -> bool:
        return self.fp8_weights or self.kv_cache_dtype.startswith("fp8")

    def labels(self) -> dict:
        return {"method": self.method, "weight_dtype": self.weight_dtype, "kv_cache_dtype": self.kv_cache_dtype}

    def as_dict(self) -> dict:
        d = asdict(self)
        d["weight_block_size"] = list(self.weight_block_size) if self.weight_block_size else None
        return d


def _method_label(value: Any) -> str:
    m = str(value).strip().lower().replace("_", "-") if value is not None else "other"
    m = {"fbgemm-fp8": "fbgemm_fp8", "experts-int8": "experts_int8", "fp-quant": "fp_quant"}.get(m, m)
    return m if m in _KNOWN_METHODS else "other"


def _fp8_name(fmt: Any) -> str:
    f = str(fmt or "e4m3").lower()
    return "float8_e5m2" if "e5m2" in f else "float8_e4m3fn"


def from_config(config: dict, where: str = "config.json") -> QuantizationInfo:
    """Read config.json's quantization_config; a malformed one raises EngineError config_invalid."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is None:
        return QuantizationInfo()
    if not isinstance(qc, dict):
        raise EngineError("config_invalid", f"{where}: key 'quantization_config': expected a JSON object, got {type(qc).__name__}")
    method = _method_label(qc.get("quant_method"))
    info = QuantizationInfo(method=method, weight_dtype="unknown", source="config.json")
    if method == "fp8":      # transformers FineGrainedFP8 / DeepSeek-V3 layout
        info.weight_dtype = _fp8_name(qc.get("fmt"))
        info.activation_scheme = str(qc.get("activation_scheme") or "dynamic").lower()
        block = qc.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, list) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise EngineError("config_invalid",
                                  f"{where}: key 'quantization_config.weight_block_size': got {block!r}; expected two positive integers")
            info.weight_block_size = tuple(block)
        if info.activation_scheme not in ("dynamic", "static"):
            raise EngineError("config_invalid",
                              f"{where}: key 'quantization_config.activation_scheme': got {qc.get('activation_scheme')!r}; expected dynamic or static")
    elif method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
        w = weights[0] if weights else {}
        if w.get("type") == "float" and w.get("num_bits") == 8:
            info.weight_dtype = "float8_e4m3fn"
            acts = [g.get("input_activations") or {} for g in groups.values() if isinstance(g, dict)]
            if acts and acts[0]:
                info.activation_scheme = "dynamic" if acts[0].get("dynamic") else "static"
            if w.get("strategy") == "block" and isinstance(w.get("block_structure"), list):
                info.weight_block_size = tuple(w["block_structure"])
        elif w.get("type") == "int" and w.get("num_bits") in (4, 8):
            info.weight_dtype = f"int{w['num_bits']}"
        kv = qc.get("kv_cache_scheme")
        if isinstance(kv, dict) and kv.get("type") == "float" and kv.get("num_bits") == 8:
            info.kv_cache_dtype = "fp8_e4m3"
    elif method == "fbgemm_fp8":   # per-channel e4m3 weights, dynamic per-token activations
        info.weight_dtype, info.activation_scheme = "float8_e4m3fn", "dynamic"
    elif method == "modelopt":
        algo = str(qc.get("quant_algo") or "").upper()
        if algo == "FP8":
            info.weight_dtype, info.activation_scheme = "float8_e4m3fn", "static"
        if str(qc.get("kv_cache_quant_algo") or "").upper() == "FP8":
            info.kv_cache_dtype = "fp8_e4m3"
    elif method in ("awq", "gptq", "auto-round", "marlin"):
        bits = qc.get("bits") or qc.get("w_bit")
        info.weight_dtype = f"int{bits}" if bits in (2, 3, 4, 8) else "unknown"
    return info


def _option(command: list[str], *names: str) -> str | None:
    for i, word in enumerate(command):
        for name in names:
            if word == name and i + 1 < len(command):
                return command[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def from_command_line(command: list[str] | None, model_info: QuantizationInfo | None = None) -> QuantizationInfo:
    """A server's quantization from its flags over `model_info`; the flags win, as they are what runs."""
    info = QuantizationInfo(**vars(model_info)) if model_info else QuantizationInfo()
    if not command:
        return info
    q = _option(command, "--quantization", "-q", "--quantize")
    kv = _option(command, "--kv-cache-dtype")
    if q is not None:
        ql = q.strip().lower()
        info.method = "fp8" if ql in _FP8_WORDS and ql not in ("modelopt", "fbgemm_fp8") else _method_label(ql)
        if ql in _FP8_WORDS:
            info.weight_dtype = _fp8_name(ql)
            info.activation_scheme = info.activation_scheme or "dynamic"
        elif info.source == "none":
            info.weight_dtype = "unknown"
    if kv is not None:
        kvl = kv.strip().lower()
        info.kv_cache_dtype = kvl if kvl in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "bfloat16", "float16") else "other"
    if q is not None or kv is not None:
        info.source = "config.json + command line" if info.source == "config.json" else "command line"
    return info


def read_model_config(path: str) -> dict:
    """config.json of a local model directory, or {} when there is none to read (a hub id)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


