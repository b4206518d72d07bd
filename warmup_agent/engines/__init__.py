"""Engine adapters behind one interface (see base.py)."""
from __future__ import annotations

from warmup_agent.engines.base import Engine, EngineError


def create(cfg, model_path: str | None, server_command: list[str] | None = None) -> Engine:
    """Build the engine named by cfg.engine.  Imports are lazy: a torch user never
    imports vLLM, and `--help` never imports torch."""
    name = cfg["engine"]
    if name == "torch":
        from warmup_agent.engines.torch_engine import TorchEngine
        return TorchEngine(model_path, dtype=cfg["model.dtype"], device=cfg["model.device"])
    raise EngineError("engine_unavailable", f"engine '{name}' is not available in this build (known: torch)")
