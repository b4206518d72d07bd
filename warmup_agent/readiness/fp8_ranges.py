"""FP8 range validation: the seed's warmup cases through each FP8 layer's own
quantize/dequantize path, with the model's scales.

    range              min        max       cases   checked against
    activations        -12.8      +12.7     50      each layer's input quantization
    weights            -0.00392   +0.00391  30      each layer's weight block scales
    attention_scores   0          1         20      the attention-probability scale

Two measurements per range: saturated values (|x / scale| > 448, which the cast clamps)
and the round-trip error, max |dequantize(quantize(x)) - x| / the range's largest |x|.
A scale too small saturates; one too large loses the cases in e4m3's subnormals.  A
scale that fits keeps the error under 2^-4 (three mantissa bits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from warmup_agent import quantization as q


@dataclass(frozen=True)
class Range:
    name: str
    low: float
    high: float
    cases: int

    @property
    def peak(self) -> float:
        return max(abs(self.low), abs(self.high))


SEED_RANGES = (Range("activations", -12.8, 12.7, 50),
               Range("weights", -0.00392, 0.00391, 30),
               Range("attention_scores", 0.0, 1.0, 20))


@dataclass
class RangeResult:
    name: str
    checked: int = 0              # values put through a quantize/dequantize round trip
    saturated: int = 0            # of those, beyond the e4m3 range at their scale
    max_error: float = 0.0        # max |round trip - x| / range's largest |x|
    layers: int = 0
    worst_layer: str = ""         # where max_error (or the first saturation) was seen
    scale_source: str = ""

    @property
    def saturated_ratio(self) -> float:
        return self.saturated / self.checked if self.checked else 0.0

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["saturated_ratio"] = self.saturated_ratio
        return d


@dataclass
class RangeReport:
    ranges: dict[str, RangeResult] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v.as_dict() for k, v in self.ranges.items()}


def cases(r: Range, device: Any = None) -> Any:
    import torch
    return torch.linspace(r.low, r.high, r.cases, dtype=torch.float32, device=device)


def _error(xd: Any, x: Any, r: Range) -> float:
    return float((xd - x).abs().max()) / r.peak


def _note(res: RangeResult, layer: str, sat: int, err: float) -> None:
    if (sat and not res.saturated) or (err > res.max_error and not res.saturated):
        res.worst_layer = layer
    res.saturated += sat
    res.max_error = max(res.max_error, err)


def activations(layer: Any, r: Range) -> Any:
    """(values, saturated, error) of the cases through `layer`'s input quantization,
    tiled so every 128-wide group sees the whole range."""
    x = cases(r, layer.weight.device)
    k = layer.in_features
    tokens = math.ceil(x.numel() / k)                 # one token unless K is smaller than the case count
    flat = x.repeat(math.ceil(tokens * k / x.numel()))[: tokens * k]
    rows = flat.reshape(tokens, k).to(layer.compute_dtype)
    qx, s = layer.quantize_input(rows)
    scale = q.expand_block_scales(s, rows.shape, (1, layer.block[1]))
    xv, qv, sv = rows.float().reshape(-1)[: x.numel()], qx.reshape(-1)[: x.numel()], scale.reshape(-1)[: x.numel()]
    sat = int(q.saturated_mask(xv, sv).sum())
    return xv.numel(), sat, _error(q.dequantize(qv, sv), xv, r)


def weights(layer: Any, r: Range) -> Any:
    """(values, saturated, error) of the cases against every block scale of `layer`."""
    x = cases(r, layer.weight.device)[:, None]
    s = layer.weight_scale_inv.float().reshape(1, -1)
    sat = int(q.saturated_mask(x, s).sum())
    return x.numel() * s.numel(), sat, _error(q.dequantize(q.quantize(x, s), s), x.expand(-1, s.shape[1]), r)


def attention_scale(model: Any) -> Any:
    """The checkpoint's FP8 attention-probability scale and its name, or unit scale."""
    for name, p in model.named_parameters():
        if name.endswith(("attn.prob_scale", "attn.p_scale")):
            return p.detach().float().reshape(-1)[0], name
    return None, "unit (the checkpoint has no attention-probability scale)"


def run(model: Any, ranges: Any = SEED_RANGES) -> RangeReport:
    """The seed's cases through every FP8 layer of `model` (see the module docstring)."""
    import torch
    layers = q.fp8_layers(model)
    report = RangeReport()
    by_name = {r.name: r for r in ranges}
    with torch.inference_mode():
        for r in ranges:
            report.ranges[r.name] = RangeResult(r.name, layers=len(layers) if r.name != "attention_scores" else 1)
        for name, layer in layers:
            for rname, fn in (("activations", activations), ("weights", weights)):
                if rname in by_name:
                    res = report.ranges[rname]
                    n, sat, err = fn(layer, by_name[rname])
                    res.checked += n
                    _note(res, name, sat, err)
        if "activations" in report.ranges:
            schemes = {layer.activation_scheme for _, layer in layers}
            report.ranges["activations"].scale_source = "+".join(sorted(schemes)) + " activation scale"
        if "weights" in report.ranges:
            report.ranges["weights"].scale_source = "weight_scale_inv per block"
        if "attention_scores" in by_name:
            r = by_name["attention_scores"]
            device = layers[0][1].weight.device if layers else None
            scale, source = attention_scale(model)
            x = cases(r, device)
            s = torch.ones((), device=device) if scale is None else scale.to(device)
            res = report.ranges["attention_scores"]
            res.checked, res.scale_source = x.numel(), source
            _note(res, "attention", int(q.saturated_mask(x, s).sum()), _error(q.dequantize(q.quantize(x, s), s), x, r))
    return report
