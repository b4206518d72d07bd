"""The FP8 layer; imported on first use so that importing warmup_agent.quantization needs no torch."""
from __future__ import annotations

import math
from typing import Any

import torch

from warmup_agent.quantization import fp8_math

nn = torch.nn


class FP8BlockLinear(nn.Module):  # type: ignore[name-defined]  # torch is not followed by mypy
    """A linear layer in transformers' fp8 layout, run by torch._scaled_mm or emulated."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool,
                 compute_dtype: Any, activation_scheme: str = "dynamic", device: Any = None) -> None:
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
        self.m_seen: set[int] = set()     # GEMM M values run, i.e. kernel shapes warmed
        self._fast: bool | None = None    # decided at the first forward
        self._weight_mm: Any = None       # the fast path's weight, K padded
        self._scale_b = None
        self.fallback_reason = ""

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={self.block}, act={self.activation_scheme}"

    def activation_scales(self, x2: Any) -> Any:
        """Scale per token and K group, [M, ceil(K/bk)] float32."""
        return fp8_math._activation_scales(x2, self.activation_scale, self.block[1])

    def quantize_input(self, x2: Any) -> Any:
        """(e4m3 [M, K], scales [M, G]): this layer's activation quantization."""
        return fp8_math._quantize_groups(x2, self.activation_scale, self.block[1])

    def dequantize_weight(self) -> Any:
        return fp8_math.dequantize(self.weight, fp8_math.expand_block_scales(self.weight_scale_inv, self.weight.shape, self.block))

    def _emulated(self, x2: Any) -> Any:
        xq, xs = self.quantize_input(x2)
        xd = fp8_math.dequantize(xq, fp8_math.expand_block_scales(xs, x2.shape, (1, self.block[1])))
        return (xd @ self.dequantize_weight().t()).to(x2.dtype)

    def _scaled_mm(self, x2: Any) -> Any:
        """The blockwise-scaled FP8 GEMM."""
        m, k_pad = x2.shape[0], self._weight_mm.shape[1] - self.in_features
        pad = -m % 4
        xp = torch.nn.functional.pad(x2, (0, k_pad, 0, pad)) if pad or k_pad else x2
        xq, xs = fp8_math._quantize_groups(xp, self.activation_scale, self.block[1])
        out = torch._scaled_mm(xq, self._weight_mm.t(), scale_a=xs.t().contiguous().t(),
                               scale_b=self._scale_b, out_dtype=x2.dtype)
        return out[:m] if pad else out

    def _choose_path(self, x2: Any) -> bool:
        """Take the fast path only where it matches the emulation on the first real input: a wrong GEMM must never serve."""
        if not fp8_math._scaled_mm_ok(x2.device, self.out_features, self.in_features, self.block):
            return False
        self._weight_mm, self._scale_b = fp8_math.scaled_mm_operands(self.weight, self.weight_scale_inv)
        # A view of the padded weight, not a second copy.
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
        """Emulate from now on, giving the weight unpadded storage so the padded operand is freed."""
        self.fallback_reason = reason
        if self._weight_mm.shape[1] != self.in_features:
            self.weight.data = self._weight_mm.view(torch.uint8)[:, :self.in_features].contiguous().view(self.weight.dtype)
        self._weight_mm = self._scale_b = None
        return False

    def forward(self, x: Any) -> Any:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        self.m_seen.add(x2.shape[0])
        if self._fast is None:
            self._fast = self._choose_path(x2)
        out = self._scaled_mm(x2) if self._fast else self._emulated(x2)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)
