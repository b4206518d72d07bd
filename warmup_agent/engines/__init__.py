"""Engine adapters behind one interface (see base.py)."""
from __future__ import annotations

import importlib.util
from collections.abc import Collection
from typing import TYPE_CHECKING

from warmup_agent.config import ConfigError
from warmup_agent.engines.base import Engine, EngineError

if TYPE_CHECKING:
    from warmup_agent.config_sections import LoraSection, ModelSection, OpenaiSection, VllmSection

# Modules each in-process engine needs beyond the core install, and the extra that brings them.
_NEEDS = {"torch": (("torch", "transformers"), "torch"),
          "vllm": (("vllm", "torch", "transformers"), "vllm")}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed package counts as missing
        return False


def check_installed(name: str) -> None:
    """Raise a ConfigError naming the pip extra when engine `name` cannot be imported here."""
    needs, extra = _NEEDS.get(name, ((), ""))
    missing = [m for m in needs if not _importable(m)]
    if missing:
        raise ConfigError(f"key 'engine': engine {name} needs {' and '.join(missing)}, which this installation lacks: "
                          f"pip install 'warmup-agent[{extra}]', or use engine openai", "engine")


def create(name: str, model_path: str | None, server_command: list[str] | None = None, *,
           model: ModelSection, openai: OpenaiSection, vllm: VllmSection, lora: LoraSection,
           data_dir: str, request_apis: Collection[str] = ()) -> Engine:
    """Build engine `name` from its config sections; imports are lazy so `--help` loads no torch."""
    if name == "torch":
        from warmup_agent.engines.torch.engine import TorchEngine
        if model_path is None:
            raise ValueError("engine torch needs a model directory (the CLI makes the embedded one when none is given)")
        return TorchEngine(model_path, dtype=model.dtype, device=model.device,
                           implementation=model.implementation)
    if name == "openai":
        from warmup_agent.engines.openai.engine import OpenAIEngine
        return OpenAIEngine(openai, data_dir=data_dir, lora=lora, vllm=vllm, server_command=server_command,
                            model_path=model_path or model.path, request_apis=request_apis)
    if name == "vllm":
        if not model_path:
            raise EngineError("model_dir_missing", "engine vllm needs --model DIR (model.path)")
        try:
            from warmup_agent.engines.vllm_engine import VllmEngine
        except ImportError as e:
            raise EngineError("engine_unavailable", f"engine vllm needs the vllm package ({e}); pip install 'warmup-agent[vllm]'") from None
        return VllmEngine(model_path, vllm=vllm, model=model, lora=lora, data_dir=data_dir)
    raise EngineError("engine_unavailable", f"unknown engine '{name}' (known: torch, vllm, openai)")
