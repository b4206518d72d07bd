"""The model's own configuration and modelling classes, imported directly.

transformers' Auto* classes import mapping tables for every architecture, which is
slow; anything not found directly (remote code, unknown types) still goes the Auto way.
"""
from __future__ import annotations

import importlib
import json
import os
import re
from typing import Any

_SAFE = re.compile(r"^[a-z0-9_]+$")


def _module_name(model_type: str) -> str:
    return model_type.replace("-", "_")


def direct_classes(config: dict) -> tuple[Any, Any] | None:
    """(config class, model class) from the model's own modules, or None."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if not isinstance(model_type, str) or not archs or not isinstance(archs[0], str) or config.get("auto_map"):
        return None
    arch, mod = archs[0], _module_name(model_type)
    if not arch.endswith("ForCausalLM") or not _SAFE.match(mod):
        return None
    try:
        modeling = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        configuration = importlib.import_module(f"transformers.models.{mod}.configuration_{mod}")
    except ImportError:
        return None
    model_cls = getattr(modeling, arch, None)
    config_cls = getattr(model_cls, "config_class", None)
    if model_cls is None or config_cls is None or getattr(config_cls, "model_type", None) != model_type:
        return None
    if getattr(configuration, config_cls.__name__, None) is not config_cls:
        return None
    return config_cls, model_cls


def resolve(model_dir: str) -> tuple[Any, Any]:
    """(build, config) for the model directory, where build(config, dtype=...) makes the model."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    found = direct_classes(raw) if isinstance(raw, dict) else None
    if found is not None:
        config_cls, model_cls = found
        return model_cls._from_config, config_cls.from_pretrained(model_dir)
    from transformers import AutoConfig, AutoModelForCausalLM
    return AutoModelForCausalLM.from_config, AutoConfig.from_pretrained(model_dir)


def build_skeleton(model_dir: str, dtype: Any) -> tuple[Any, dict, set]:
    """(model on the meta device, expected shapes by name, tied names)."""
    import torch
    build, config = resolve(model_dir)
    with torch.device("meta"):
        model = build(config, dtype=dtype)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    return model, expected, tied
