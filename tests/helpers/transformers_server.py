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


# A small warmup of the embedded model: one prompt length, batch 1, 4-token answers.
SMALL_WARMUP = {"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[24]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
                "WARMUP_AGENT_PREWARM_MAX_OUTPUT_TOKENS": "4", "WARMUP_AGENT_READINESS_PROBE_MAX_TOKENS": "4",
                "WARMUP_AGENT_READINESS_PROBE_PROMPT_LENGTH": "20", "WARMUP_AGENT_READINESS_MIN_PROBES": "5",
                "WARMUP_AGENT_READINESS_TPOT_CONVERGENCE_RATIO": "4"}


def start_agent(scratch: str, model_dir: str, data_dir: str, port: int, listen: int, record: str,
                **env_overrides: str):
    """`warmup-agent run --engine openai --model DIR -- transformers serve DIR` with
    SMALL_WARMUP (and `env_overrides`), its output in scratch/agent.log; the Popen."""
    import subprocess

    from tests.conftest import ROOT, agent_cmd
    env = server_env(scratch)
    env.update(SMALL_WARMUP, **env_overrides)
    log = open(os.path.join(scratch, "agent.log"), "w")
    return subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", model_dir,
                                      "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}", "--record", record,
                                      "--", *server_command(model_dir, port)),
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
