"""The openai engine as `warmup-agent run` builds it (cli.make_engine -> engines.create:
each section it reads handed over on its own), from a whole Config, plus what only
tests pass: the server's base environment, the crash callbacks, a logger."""
from __future__ import annotations

from typing import Any

from warmup_agent.config import Config
from warmup_agent.engines.openai.engine import OpenAIEngine


def openai_engine(cfg: Config, server_command: list[str] | None = None, **options: Any) -> OpenAIEngine:
    check = cfg.requests_check
    model_path = options.pop("model_path", None) or cfg.model.path
    return OpenAIEngine(cfg.openai, data_dir=cfg.data_dir, lora=cfg.lora, vllm=cfg.vllm,
                        server_command=server_command, model_path=model_path,
                        request_apis=check.endpoints if check is not None else (), **options)
