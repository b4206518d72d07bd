"""FP8 arithmetic shared by the layer, the checkpoint writer and range validation, so what is validated runs."""
from __future__ import annotations

import math
from typing import Any

FP8_E4M3_MAX = 448.0              # largest finite e4m3; a cast beyond it gives NaN, so values are clamped
_MIN_AMAX = 1e-12                 # an all-zero group gets a tiny scale instead of 0/0


def fp8_dtype(name: str = "float8_e4m3fn") -> Any:
    import torch
    return getattr(torch, name)


def scaled(x: Any, scale: Any) -> Any:
    """x / scale in float32: the value the FP8 cast sees."""
    return x.float() / scale.float()


def saturated_mask(x: Any, scale: Any) -> Any:
    """Values whose scaled magnitude exceeds the largest e4m3 value, which quantize clamps."""
    return scaled(x, scale).abs() > FP8_E4M3_MAX


def quantize(x: Any, scale: Any) -> Any:
    """Saturating e4m3 quantization of x with `scale` (x ~= q * scale); broadcasts."""
    import torch
    return scaled(x, scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(q: Any, scale: Any) -> Any:
    """float32 values of e4m3 q with `scale`; broadcasts."""
    return q.float() * scale.float()


def block_scales(w: Any, block: tuple[int, int]) -> Any:
    """Per-block scale (amax / 448) of a 2-D weight, shape [ceil(N/bn), ceil(K/bk)]."""
    g = _blocks(w.float(), block)
    return g.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX) / FP8_E4M3_MAX


def _blocks(w: Any, block: Any) -> Any:
    """[N, K] -> [N/bn, bn, K/bk, bk], zero-padded to whole blocks."""
    import torch
    n, k = w.shape
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    if pn or pk:
        w = torch.nn.functional.pad(w, (0, pk, 0, pn))
    return w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)


def expand_block_scales(scale: Any, shape: Any, block: Any) -> Any:
    """A block scale tensor broadcast to every element of a [N, K] weight."""
    n, k = shape
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]


def quantize_weight(w: Any, block: tuple[int, int]) -> Any:
    """(e4m3 weight, float32 weight_scale_inv) in transformers' fp8 layout."""
    scale = block_scales(w, block)
    return quantize(w, expand_block_scales(scale, w.shape, block)), scale


def _activation_scales(x2: Any, static_scale: Any, bk: int) -> Any:
    """Scale per token and bk-wide K group (dynamic), or the checkpoint's activation_scale (static)."""
    m, groups = x2.shape[0], math.ceil(x2.shape[1] / bk)
    if static_scale is not None:
        return static_scale.float().reshape(1, 1).expand(m, groups)
    g = _blocks(x2.float(), (1, bk))          # [M, 1, G, bk]
    return g.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX) / FP8_E4M3_MAX


def _quantize_groups(x2: Any, static_scale: Any, bk: int) -> Any:
    """(e4m3 [M, K], scales [M, G]): per-token, per-group activation quantization."""
    s = _activation_scales(x2, static_scale, bk)
    return quantize(x2, expand_block_scales(s, x2.shape, (1, bk))), s


def scaled_mm_operands(weight: Any, weight_scale_inv: Any) -> Any:
    """(weight [N, K'], scale_b) laid out as torch._scaled_mm's blockwise path accepts them.

    K is padded with zero columns until K/128 is a multiple of 4: torch releases disagree
    on scale_b's row stride and cuBLASLt wants 16 bytes, and this layout satisfies all."""
    import torch
    n, k = weight.shape
    sn, sk = weight_scale_inv.shape
    sk4 = sk + (-sk % 4)
    k4 = sk4 * 128
    if k4 == k:
        # detach(): the Parameter itself, stored on the module, would register as a second parameter.
        wp = weight.detach().contiguous()
    else:
        raw = torch.zeros(n, k4, dtype=torch.uint8, device=weight.device)
        raw[:, :k] = weight.view(torch.uint8)
        wp = raw.view(weight.dtype)
    sb = torch.ones(sn, sk4, dtype=torch.float32, device=weight.device)
    sb[:, :sk] = weight_scale_inv
    return wp, sb.t()


def _scaled_mm_ok(device: Any, n: int, k: int, block: Any) -> bool:
    """Whether torch._scaled_mm's blockwise FP8 GEMM can run here (compute capability 9.0+, 128x128 blocks)."""
    import torch
    if device.type != "cuda" or tuple(block or ()) != (128, 128) or n % 128 or k % 128:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and hasattr(torch, "_scaled_mm")
