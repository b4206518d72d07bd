"""llama.cpp's real `llama-server`, built by tools/build_llama_server.py, for tests and benches.

The binary comes from that tool's cache (a CPU build, static, made by `make test-setup`;
the fixture builds it when missing, which takes a while).  The model is a GGUF made by
tools/gguf_convert.py from a Hugging Face directory (the embedded model for tests).
`server_command` is the one place that says how the server is started here.
"""
from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.paths import ROOT


def _tool(name: str, *args: str, timeout: float) -> str:
    """Run tools/<name> with this Python; the path on its last stdout line."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"tools/{name} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return lines[-1]


def ensure_binary(cuda: str = "off", timeout: float = 7200) -> str:
    """The cached llama-server (builds it on first use: tens of minutes on 2 cores)."""
    return _tool("build_llama_server.py", "--cuda", cuda, timeout=timeout)


def ensure_gguf(model_dir: str, outtype: str = "bf16", timeout: float = 600) -> str:
    """The model's GGUF, next to the model directory (converted once)."""
    return _tool("gguf_convert.py", model_dir, "--outtype", outtype, timeout=timeout)


def server_command(binary: str, gguf: str, port: int, host: str = "127.0.0.1", ctx: int = 2048,
                   gpu_layers: int | None = None, metrics: bool = False, extra: tuple[str, ...] = ()) -> list[str]:
    """How llama-server is started here: one model, a context of `ctx` tokens (shared by
    its slots), all layers on the GPU when gpu_layers is given (-ngl), /metrics only
    with metrics=True (llama-server serves it only with --metrics)."""
    cmd = [binary, "-m", gguf, "-c", str(ctx), "--host", host, "--port", str(port)]
    if gpu_layers is not None:
        cmd += ["-ngl", str(gpu_layers)]
    if metrics:
        cmd.append("--metrics")
    return cmd + list(extra)


def server_env(scratch: str) -> dict[str, str]:
    """The caller's environment without WARMUP_AGENT_* (the agent's own settings come
    from the test), and a HOME of its own (llama-server keeps nothing there unless asked)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    home = os.path.join(scratch, "home")
    os.makedirs(home, exist_ok=True)
    env["HOME"] = home
    return env
