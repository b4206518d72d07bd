"""The real `transformers serve` (the `serving` extra of transformers) for tests.

An OpenAI-compatible FastAPI server unlike vLLM's: text prompts only on
/v1/completions, no /tokenize, no metrics, unknown request fields refused.  It
serves the embedded model (which ships a chat template) on the CPU, up in ~5 s.
"""
from __future__ import annotations

import os
import sys


def transformers_cli() -> list[str]:
    here = os.path.join(os.path.dirname(sys.executable), "transformers")
    if os.path.exists(here):
        return [here]
    return [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; "
            "sys.argv[0] = 'transformers'; main()"]


def server_command(model_dir: str, port: int) -> list[str]:
    return transformers_cli() + ["serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]


def server_env(scratch: str) -> dict[str, str]:
    """Offline, and a HOME of its own: /v1/models lists ~/.cache/huggingface/hub and
    fails when it is missing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    home = os.path.join(scratch, "home")
    os.makedirs(os.path.join(home, ".cache", "huggingface", "hub"), exist_ok=True)
    env.update(HF_HUB_OFFLINE="1", HOME=home, TOKENIZERS_PARALLELISM="false")
    return env


def available() -> bool:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
        return True
    except ImportError:
        return False
