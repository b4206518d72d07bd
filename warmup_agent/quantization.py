"""Quantized models: what a checkpoint or a server command line says, and FP8 layers.

Detection (issue 16): a checkpoint's config.json `quantization_config` (FP8 formats
first: transformers' "fp8" (FineGrainedFP8, DeepSeek-V3 style 128x128 blocks),
compressed-tensors float-quantized, fbgemm_fp8, modelopt FP8; other methods are
named but not looked into), and a server's command line (`--quantization fp8`,
`--kv-cache-dtype fp8`, TGI's `--quantize`).

FP8 layers: `FP8BlockLinear` runs the transformers "fp8" layout (e4m3 weight
[N, K], float32 `weight_scale_inv` per block, so weight ~= q * scale) without
transformers' own FP8Linear, whose GEMM is a Triton kernel fetched from the
Hugging Face Hub at first use (no network on a GPU host, and a download is no
warmup).  On a GPU with blockwise-scaled FP8 GEMM (Hopper: compute capability 9.0
and torch._scaled_mm with 1x128 / 128x128 scales) the layer quantizes its input
per token and 128-wide group and calls torch._scaled_mm; elsewhere (CPU, older
GPUs, odd shapes) it emulates: the same quantization, then dequantize and a
matmul in the compute dtype.  Quantize, saturate and dequantize are one set of
functions, used by the forward pass, by the checkpoint writer and by the range
validation (readiness/fp8_ranges.py), so what is validated is what runs.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any

from warmup_agent.errors import EngineError

FP8_E4M3_MAX = 448.0              # largest finite float8_e4m3fn; beyond it a cast gives NaN, so we clamp
_MIN_AMAX = 1e-12                 # an all-zero group gets a tiny scale instead of 0/0
# Tensors of a quantized checkpoint that keep their stored dtype (never cast to the compute dtype).
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "activation_scale", "input_scale", "k_scale", "v_scale")
_KNOWN_METHODS = {"fp8", "compressed-tensors", "fbgemm_fp8", "modelopt", "awq", "gptq", "bitsandbytes", "torchao",
                  "hqq", "quanto", "eetq", "aqlm", "mxfp4", "bitnet", "fp_quant", "higgs", "vptq", "spqr", "gguf",
                  "marlin", "experts_int8", "auto-round", "quark", "none"}
_FP8_WORDS = {"fp8", "fp8_e4m3", "fp8_e5m2", "float8", "float8_e4m3fn", "e4m3", "e5m2", "modelopt", "fbgemm_fp8"}


@dataclass
class QuantizationInfo:
    """What the agent knows about a model's quantization. Label values are from small fixed sets."""
    method: str = "none"            # fp8 | compressed-tensors | fbgemm_fp8 | modelopt | awq | ... | other | none
    weight_dtype: str = "unquantized"   # float8_e4m3fn | float8_e5m2 | int8 | int4 | unquantized | unknown
    kv_cache_dtype: str = "auto"    # auto | fp8 | fp8_e4m3 | fp8_e5m2 | ...
    activation_scheme: str = ""     # dynamic | static | "" (not said)
    weight_block_size: tuple | None = None   # (rows, cols) per scale, None: per tensor / channel / not said
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


def _method_label(value) -> str:
    m = str(value).strip().lower().replace("_", "-") if value is not None else "other"
    m = {"fbgemm-fp8": "fbgemm_fp8", "experts-int8": "experts_int8", "fp-quant": "fp_quant"}.get(m, m)
    return m if m in _KNOWN_METHODS else "other"


def _fp8_name(fmt) -> str:
    f = str(fmt or "e4m3").lower()
    return "float8_e5m2" if "e5m2" in f else "float8_e4m3fn"


def from_config(config: dict, where: str = "config.json") -> QuantizationInfo:
    """Read config.json's quantization_config. A malformed one is the user's mistake:
    EngineError config_invalid with one line naming the key."""
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
    """A server's quantization from its flags (vLLM/SGLang `--quantization`/`-q`, TGI
    `--quantize`, `--kv-cache-dtype`), over what the model's config.json said
    (model_info).  The server's flag wins: it is what the server runs."""
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


# --- FP8 arithmetic: one quantize/dequantize path for forward, checkpoint writer and validation ---------
def fp8_dtype(name: str = "float8_e4m3fn"):
    import torch
    return getattr(torch, name)


def scaled(x, scale):
    """x / scale in float32: the value the FP8 cast sees."""
    return x.float() / scale.float()


def saturated_mask(x, scale):
    """Values whose scaled magnitude is beyond the largest e4m3 value: the cast would
    clamp them (we clamp; an unclamped cast would give NaN)."""
    return scaled(x, scale).abs() > FP8_E4M3_MAX


def quantize(x, scale):
    """Saturating e4m3 quantization of x with `scale` (x ~= q * scale); broadcasts."""
    import torch
    return scaled(x, scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(q, scale):
    """float32 values of e4m3 q with `scale`; broadcasts."""
    return q.float() * scale.float()


def block_scales(w, block: tuple[int, int]):
    """Per-block scale (amax / 448) of a 2-D weight, shape [ceil(N/bn), ceil(K/bk)]."""
    g = _blocks(w.float(), block)
    return g.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX) / FP8_E4M3_MAX


def _blocks(w, block):
    """[N, K] -> [N/bn, bn, K/bk, bk], zero-padded to whole blocks."""
    import torch
    n, k = w.shape
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    if pn or pk:
        w = torch.nn.functional.pad(w, (0, pk, 0, pn))
    return w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)


def expand_block_scales(scale, shape, block):
    """A block scale tensor broadcast to every element of a [N, K] weight."""
    n, k = shape
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]


def quantize_weight(w, block: tuple[int, int]):
    """(e4m3 weight, float32 weight_scale_inv) in transformers' fp8 layout."""
    scale = block_scales(w, block)
    return quantize(w, expand_block_scales(scale, w.shape, block)), scale


# --- the layer ---------------------------------------------------------------------------------
def _activation_scales(x2, static_scale, bk: int):
    """Scale per token and bk-wide K group, [M, ceil(K/bk)] float32 (dynamic), or the
    checkpoint's one activation_scale everywhere (static)."""
    m, groups = x2.shape[0], math.ceil(x2.shape[1] / bk)
    if static_scale is not None:
        return static_scale.float().reshape(1, 1).expand(m, groups)
    g = _blocks(x2.float(), (1, bk))          # [M, 1, G, bk]
    return g.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX) / FP8_E4M3_MAX


def _quantize_groups(x2, static_scale, bk: int):
    """(e4m3 [M, K], scales [M, G]): per-token, per-group activation quantization."""
    s = _activation_scales(x2, static_scale, bk)
    return quantize(x2, expand_block_scales(s, x2.shape, (1, bk))), s


def scaled_mm_operands(weight, weight_scale_inv):
    """(weight [N, K'], scale_b [K'/128, N/128]) laid out as torch._scaled_mm's
    blockwise path (1x128 activations x 128x128 weights) accepts them.

    torch checks scale_b.t() for shape (N/128, K/128) and row stride exactly
    K/128 in some releases (2.11, on the H200), and a row stride rounded up to 4
    floats in newer ones; cuBLASLt itself wants that leading dimension to be a
    multiple of 4 floats (16 bytes).  One layout satisfies all three: pad K with
    zero weight columns until K/128 is a multiple of 4 (K=8960 -> 9216).  Zero
    weights times the zero activation columns the GEMM pads in add nothing; the
    padded blocks' scales are 1."""
    import torch
    n, k = weight.shape
    sn, sk = weight_scale_inv.shape
    sk4 = sk + (-sk % 4)
    k4 = sk4 * 128
    if k4 == k:
        # detach(): a plain tensor on the same storage.  The Parameter itself, stored
        # as a module attribute, would register as a second parameter (and the
        # structure check counts it as an unexpected tensor, seen on the H200).
        wp = weight.detach().contiguous()
    else:
        raw = torch.zeros(n, k4, dtype=torch.uint8, device=weight.device)
        raw[:, :k] = weight.view(torch.uint8)
        wp = raw.view(weight.dtype)
    sb = torch.ones(sn, sk4, dtype=torch.float32, device=weight.device)
    sb[:, :sk] = weight_scale_inv
    return wp, sb.t()


def _scaled_mm_ok(device, n: int, k: int, block) -> bool:
    """Blockwise-scaled FP8 GEMM (1x128 activations, 128x128 weights) through
    torch._scaled_mm: measured working on an H200 with torch 2.11 (cuBLAS 13)."""
    import torch
    if device.type != "cuda" or tuple(block or ()) != (128, 128) or n % 128 or k % 128:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and hasattr(torch, "_scaled_mm")


def _make_layer_class():
    """FP8BlockLinear subclasses torch.nn.Module; built on first use so that importing
    this module (detection, the CLI) does not import torch."""
    import torch
    nn = torch.nn

    class FP8BlockLinear(nn.Module):  # type: ignore[name-defined]  # torch.nn, imported above at run time
        """A linear layer in transformers' fp8 layout; forward quantizes its input per
        token and block_k-wide group (dynamic) or with the checkpoint's activation_scale
        (static), then runs the FP8 GEMM (see the module docstring for the two paths)."""

        def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool,
                     compute_dtype, activation_scheme: str = "dynamic", device=None):
            super().__init__()
            self.in_features, self.out_features = in_features, out_features
            self.block = tuple(block)
            self.compute_dtype = compute_dtype
            self.activation_scheme = activation_scheme
            sn, sk = math.ceil(out_features / block[0]), math.ceil(in_features / block[1])
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                       requires_grad=False)
            self.weight_scale_inv = nn.Parameter(torch.empty(sn, sk, dtype=torch.float32, device=device), requires_grad=False)
            self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device), requires_grad=False) if bias else None
            self.activation_scale = (nn.Parameter(torch.empty((), dtype=torch.float32, device=device), requires_grad=False)
                                     if activation_scheme == "static" else None)
            self.m_seen: set[int] = set()     # token counts (GEMM M) this layer has run: kernel shapes warmed
            self._fast: bool | None = None    # decided at the first forward (_choose_path)
            self._weight_mm: Any = None       # the fast path's weight, K padded (scaled_mm_operands)
            self._scale_b = None
            self.fallback_reason = ""

        def extra_repr(self) -> str:
            return f"in={self.in_features}, out={self.out_features}, block={self.block}, act={self.activation_scheme}"

        def activation_scales(self, x2):
            """Scale per token and K group, [M, ceil(K/bk)] float32."""
            return _activation_scales(x2, self.activation_scale, self.block[1])

        def quantize_input(self, x2):
            """(e4m3 [M, K], scales [M, G]): this layer's activation quantization."""
            return _quantize_groups(x2, self.activation_scale, self.block[1])

        def dequantize_weight(self):
            return dequantize(self.weight, expand_block_scales(self.weight_scale_inv, self.weight.shape, self.block))

        def _emulated(self, x2):
            xq, xs = self.quantize_input(x2)
            xd = dequantize(xq, expand_block_scales(xs, x2.shape, (1, self.block[1])))
            return (xd @ self.dequantize_weight().t()).to(x2.dtype)

        def _scaled_mm(self, x2):
            """The blockwise-scaled FP8 GEMM, on operands padded as scaled_mm_operands() lays them out."""
            m, k_pad = x2.shape[0], self._weight_mm.shape[1] - self.in_features
            pad = -m % 4
            xp = torch.nn.functional.pad(x2, (0, k_pad, 0, pad)) if pad or k_pad else x2
            xq, xs = _quantize_groups(xp, self.activation_scale, self.block[1])
            out = torch._scaled_mm(xq, self._weight_mm.t(), scale_a=xs.t().contiguous().t(),
                                   scale_b=self._scale_b, out_dtype=x2.dtype)
            return out[:m] if pad else out

        def _choose_path(self, x2) -> bool:
            """Fast path only where the hardware has it, and only after it gave the
            emulation's answer on this layer's first real input (else emulate, with
            the reason kept in fallback_reason: a wrong GEMM must never serve)."""
            if not _scaled_mm_ok(x2.device, self.out_features, self.in_features, self.block):
                return False
            self._weight_mm, self._scale_b = scaled_mm_operands(self.weight, self.weight_scale_inv)
            # The unpadded weight becomes a view of the padded one: no second copy.
            self.weight.data = self._weight_mm[:, :self.in_features]
            try:
                fast, ref = self._scaled_mm(x2).float(), self._emulated(x2).float()
            except RuntimeError as e:
                return self._fall_back(f"torch._scaled_mm failed: {str(e).splitlines()[0][:200]}")
            err = float((fast - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
            if not err < 2e-2:
                return self._fall_back(f"torch._scaled_mm differs from the emulation by {err:.3g} of the peak")
            return True

        def _fall_back(self, reason: str) -> bool:
            """Emulate from now on.  The weight gets storage of its own, unpadded, back:
            as a view of the padded operand it would keep K'/K of its bytes alive
            (3 % more for K=8960) for a GEMM that never runs."""
            self.fallback_reason = reason
            if self._weight_mm.shape[1] != self.in_features:
                self.weight.data = self._weight_mm.view(torch.uint8)[:, :self.in_features].contiguous().view(self.weight.dtype)
            self._weight_mm = self._scale_b = None
            return False

        def forward(self, x):
            shape = x.shape
            x2 = x.reshape(-1, self.in_features)
            self.m_seen.add(x2.shape[0])
            if self._fast is None:
                self._fast = self._choose_path(x2)
            out = self._scaled_mm(x2) if self._fast else self._emulated(x2)
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*shape[:-1], self.out_features)

    FP8BlockLinear.__qualname__ = "FP8BlockLinear"
    FP8BlockLinear.__module__ = __name__
    return FP8BlockLinear


_LAYER_CLASS = None


def layer_class():
    global _LAYER_CLASS
    if _LAYER_CLASS is None:
        _LAYER_CLASS = _make_layer_class()
    return _LAYER_CLASS


def fp8_layers(model) -> list[tuple[str, Any]]:  # Any: FP8BlockLinear is built at run time
    cls = layer_class()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]


def kernel_shapes(model) -> set[tuple[int, int, int]]:
    """Every (M, N, K) FP8 GEMM the model's FP8 layers have run."""
    return {(m, layer.out_features, layer.in_features) for _, layer in fp8_layers(model) for m in layer.m_seen}


def warm_gemms(model, max_tokens: int, cap: int = 8192) -> dict:
    """Run every FP8 GEMM shape the warmed traffic can reach: for each distinct
    (N, K) of the model's FP8 layers, each token count M from 1 to max_tokens
    (prefill of any prompt length x batch up to the largest warmed one, and every
    decode batch), through the layer's own forward.  The grid's forwards reach
    only the M values it happened to send; a first request of another length
    would pay the GEMM's first-use cost per layer shape.  Cheap: one GEMM per
    (M, N, K), not one forward per M."""
    import time

    import torch
    layers: dict[tuple[int, int, bool], Any] = {}
    all_layers = fp8_layers(model)
    fallbacks = sorted({layer.fallback_reason for _, layer in all_layers if layer.fallback_reason})
    for _, layer in all_layers:
        if layer._fast:     # decided by the grid's first forward
            layers.setdefault((layer.out_features, layer.in_features, layer.activation_scale is None), layer)
    if not layers:   # emulated (CPU, or the fallback): dequantize + matmul has no per-shape FP8 kernel to warm
        return {"fp8_gemm_shapes": 0, "fp8_gemm": "emulated", "fp8_gemm_fallbacks": fallbacks}
    t0 = time.perf_counter()
    top = max(1, min(max_tokens, cap))
    with torch.inference_mode():
        for layer in layers.values():
            x = torch.randn(top, layer.in_features, dtype=layer.compute_dtype, device=layer.weight.device)
            for m in range(1, top + 1):
                layer(x[:m])
    torch.cuda.synchronize()
    # Every layer of the same (N, K) runs the same GEMM: mark them all warmed.
    for _, layer in fp8_layers(model):
        if (layer.out_features, layer.in_features, layer.activation_scale is None) in layers:
            layer.m_seen |= set(range(1, top + 1))
    emulated = sum(1 for _, layer in all_layers if not layer._fast)
    # "mixed": some layers fell back to the emulation (their reasons are in fp8_gemm_fallbacks)
    return {"fp8_gemm": "mixed" if emulated else "scaled_mm_blockwise", "fp8_gemm_shapes": len(layers) * top,
            "fp8_gemm_max_tokens": top, "fp8_gemm_seconds": time.perf_counter() - t0,
            "fp8_layers_emulated": emulated, "fp8_gemm_fallbacks": fallbacks}


def swap_linears(model, checkpoint_names, info: QuantizationInfo, compute_dtype):
    """Replace every nn.Linear whose `<name>.weight_scale_inv` is in the checkpoint
    with an FP8BlockLinear (on the meta device, like the skeleton).  Returns the count."""
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


# --- writing an FP8 checkpoint (benchmarks, tests): transformers' "fp8" layout ----------------------
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(src: str, dst: str, block: tuple[int, int] = (128, 128), activation_scheme: str = "dynamic",
                        activation_scale: float | None = None, scale_override: dict | None = None,
                        device: str = "cpu") -> dict:
    """Write an FP8 copy of a bf16/fp32 Hugging Face model directory: every decoder
    linear weight (q/k/v/o, gate/up/down) as e4m3 with a float32 weight_scale_inv per
    block; embeddings, norms, biases and the LM head as they were.  `scale_override`
    maps a tensor name to a factor applied to its scales after quantization (tests
    use it to build a model whose scales cannot hold the seed's ranges).  `device`
    cuda quantizes a large model in seconds.  Returns the config written."""
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
