"""Three-dimensional validation before SERVING.

  structure    parameter count and tensor shapes match what config.json describes;
  numerics     logits on fixed prompts are finite, their mean in range, |logit|
               bounded; for an FP8 model also fp8_ranges.py;
  performance  the gate's P50 time to first token is within a factor of a baseline
               recorded for the same weights and device; the first run records it.

Structure and numerics need the model in this process; other engines skip them.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from warmup_agent.atomic_file import write_json_atomic


@dataclass
class Check:
    name: str                      # structure | numerics | performance
    result: str                    # passed | failed | skipped | recorded
    message: str = ""
    detail: dict = field(default_factory=dict)
    failure_reason: str = ""       # a more precise reason than validation_<name> (fp8_saturation)

    @property
    def ok(self) -> bool:
        return self.result != "failed"

    @property
    def reason(self) -> str:
        return self.failure_reason or f"validation_{self.name}"


def _torch_model(engine: Any) -> Any:
    return engine.torch_model()   # None unless the engine exposes it (Engine.torch_model)


def _reference(model: Any) -> Any:
    """The model config.json describes, on the meta device, built by the same
    implementation as the loaded one."""
    import torch

    from warmup_agent.engines.torch import native_lm
    if isinstance(model, native_lm.NativeCausalLM):
        return native_lm.build_skeleton(model.config, model.lm_head.weight.dtype)[0]
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model.config)


def check_structure(engine: Any) -> Check:
    model = _torch_model(engine)
    if model is None:
        return Check("structure", "skipped", f"engine {engine.name} does not expose its model")
    reference = _reference(model)
    from warmup_agent import quantization
    fp8 = quantization.fp8_layers(model)
    if fp8:   # the reference gets the same FP8 layers: weight and scale shapes follow from config.json
        quantization.swap_linears(reference, [f"{n}.weight_scale_inv" for n, _ in fp8], engine.quantization,
                                  fp8[0][1].compute_dtype)
    want = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want_params = sum(p.numel() for p in reference.parameters())
    have_params = sum(p.numel() for p in model.parameters())
    detail = {"parameters": have_params, "expected_parameters": want_params, "tensors": len(have)}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        first = missing[0] if missing else extra[0]
        return Check("structure", "failed",
                     f"the loaded model has {len(have)} tensors, config.json implies {len(want)} "
                     f"({len(missing)} missing, {len(extra)} unexpected; first: {first})", detail)
    for k in sorted(want):
        if want[k] != have[k]:
            return Check("structure", "failed",
                         f"tensor {k} has shape {list(have[k])}, config.json implies {list(want[k])}", detail)
    if want_params != have_params:
        return Check("structure", "failed",
                     f"the loaded model has {have_params} parameters, config.json implies {want_params}", detail)
    return Check("structure", "passed", detail=detail)


def check_numerics(engine: Any, prompts: list[list[int]], mean_min: float, mean_max: float, abs_max: float) -> Check:
    model = _torch_model(engine)
    if model is None:
        return Check("numerics", "skipped", f"engine {engine.name} does not expose logits")
    import torch
    means, peaks = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long, device=next(model.parameters()).device)
            logits = model(input_ids=ids).logits.float()
            if not bool(torch.isfinite(logits).all()):
                bad = int((~torch.isfinite(logits)).sum())
                return Check("numerics", "failed",
                             f"{bad} of {logits.numel()} logits are NaN or infinite on a {len(p)}-token fixed prompt",
                             {"non_finite": bad})
            means.append(float(logits.mean()))
            peaks.append(float(logits.abs().max()))
    detail = {"logits_mean": means, "logits_abs_max": max(peaks)}
    for m in means:
        if not mean_min < m < mean_max:
            return Check("numerics", "failed",
                         f"mean logit {m:.4g} on a fixed prompt is outside ({mean_min:g}, {mean_max:g}) "
                         "(validation.logits_mean_min/max)", detail)
    if max(peaks) > abs_max:
        return Check("numerics", "failed",
                     f"largest |logit| {max(peaks):.4g} exceeds validation.logits_abs_max {abs_max:g}", detail)
    return Check("numerics", "passed", detail=detail)


def check_fp8_ranges(engine: Any, max_saturated_ratio: float, max_error: float) -> Check:
    """Numerics of an FP8 model (readiness/fp8_ranges.py)."""
    info = engine.quantization
    if info is None or not info.fp8:
        return Check("fp8_ranges", "skipped", "the model is not quantized to FP8")
    model = _torch_model(engine)
    if model is None:
        return Check("fp8_ranges", "skipped",
                     f"engine {engine.name} does not expose its layers' FP8 scales (docs/fp8.md)",
                     {"quantization": info.as_dict()})
    from warmup_agent import quantization
    from warmup_agent.readiness import fp8_ranges
    if not quantization.fp8_layers(model):
        return Check("fp8_ranges", "skipped", "no FP8 layer in the loaded model", {"quantization": info.as_dict()})
    report = fp8_ranges.run(model)
    detail = {"ranges": report.as_dict()}
    bounds = {r.name: r for r in fp8_ranges.SEED_RANGES}
    for r in report.ranges.values():
        b = bounds[r.name]
        if r.saturated_ratio > max_saturated_ratio:
            return Check("fp8_ranges", "failed",
                         f"{r.saturated} of {r.checked} FP8 {r.name} values in [{b.low:g}, {b.high:g}] saturate e4m3 at the model's scales "
                         f"(first in {r.worst_layer}); validation.fp8_max_saturated_ratio allows {max_saturated_ratio:g}",
                         detail, failure_reason="fp8_saturation")
    for r in report.ranges.values():
        b = bounds[r.name]
        if r.max_error > max_error:
            return Check("fp8_ranges", "failed",
                         f"FP8 {r.name} in [{b.low:g}, {b.high:g}] come back with error {r.max_error:.4g} of the range's peak "
                         f"(worst in {r.worst_layer}); validation.fp8_max_roundtrip_error allows {max_error:g}",
                         detail, failure_reason="fp8_roundtrip_error")
    return Check("fp8_ranges", "passed", detail=detail)


def baseline_key(engine: Any, fingerprint: str | None) -> str:
    facts = engine.facts()
    return f"{facts.engine}|{facts.model}|{facts.device}|{facts.dtype}|{(fingerprint or '')[:16]}"


def load_baselines(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def check_performance(p50: float, path: str, key: str, factor: float) -> Check:
    """Compare with the recorded baseline P50 for `key`; record one if there is none."""
    baselines = load_baselines(path)
    base = baselines.get(key, {}).get("p50_seconds")
    detail = {"p50_seconds": p50, "baseline_p50_seconds": base, "factor": factor, "baseline_file": path}
    if not base:
        baselines[key] = {"p50_seconds": p50, "recorded_unix": time.time()}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json_atomic(path, baselines, indent=2)
        detail["baseline_p50_seconds"] = p50
        return Check("performance", "recorded", f"no baseline for this model yet: recorded P50 {p50 * 1000:.2f} ms", detail)
    if p50 > factor * base:
        return Check("performance", "failed",
                     f"P50 time to first token {p50 * 1000:.2f} ms is {p50 / base:.2f}x the recorded baseline "
                     f"{base * 1000:.2f} ms (allowed {factor:g}x, validation.performance_factor; baseline in {path})", detail)
    return Check("performance", "passed", detail=detail)
