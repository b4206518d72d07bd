"""Three-dimensional validation before SERVING (seed 003, "预热有效性的动态验证").

  structure    parameter count and every tensor shape of the loaded model match
               the model that config.json describes (built on the meta device);
  numerics     logits on fixed prompts are finite and their mean lies in a
               configured range (seed: -5 < mean < 5), |logit| under a bound;
  performance  the gate's P50 time to first token is within a factor (seed 1.2x)
               of a baseline recorded on an earlier run of the same weights on
               the same device; the first run records the baseline.

Each check returns a `Check`; a failed one carries a named reason
(validation_structure, validation_numerics, validation_performance) and one
line for the user.  Structure and numerics need the model itself: torch engine
only for now (other engines report the check as skipped).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field


@dataclass
class Check:
    name: str                      # structure | numerics | performance
    result: str                    # passed | failed | skipped | recorded
    message: str = ""
    detail: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.result != "failed"

    @property
    def reason(self) -> str:
        return f"validation_{self.name}"


def _torch_model(engine):
    model = getattr(engine, "model", None)
    return model if getattr(engine, "name", None) == "torch" and model is not None else None


def check_structure(engine) -> Check:
    model = _torch_model(engine)
    if model is None:
        return Check("structure", "skipped", f"engine {getattr(engine, 'name', '?')} does not expose its model")
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(model.config)
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


def check_numerics(engine, prompts: list[list[int]], mean_min: float, mean_max: float, abs_max: float) -> Check:
    model = _torch_model(engine)
    if model is None:
        return Check("numerics", "skipped", f"engine {getattr(engine, 'name', '?')} does not expose logits")
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


def baseline_key(engine, fingerprint: str | None) -> str:
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
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(baselines, f, indent=2)
        os.replace(tmp, path)
        detail["baseline_p50_seconds"] = p50
        return Check("performance", "recorded", f"no baseline for this model yet: recorded P50 {p50 * 1000:.2f} ms", detail)
    if p50 > factor * base:
        return Check("performance", "failed",
                     f"P50 time to first token {p50 * 1000:.2f} ms is {p50 / base:.2f}x the recorded baseline "
                     f"{base * 1000:.2f} ms (allowed {factor:g}x, validation.performance_factor; baseline in {path})", detail)
    return Check("performance", "passed", detail=detail)
