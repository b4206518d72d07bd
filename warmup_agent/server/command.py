"""A model server's command line: what the agent reads from it (options, the
address it will listen on, LoRA adapters) and the few fixes it makes to it."""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from typing import Callable

from warmup_agent.server.kinds import DEFAULT_PORT, KINDS, kind_of_command

DEFAULT_HOST = "127.0.0.1"


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


def listen_address(command: list[str]) -> tuple[str, int]:
    """Where a server started with this command answers: --host and --port, or its defaults."""
    host = option(command, "--host") or DEFAULT_HOST
    kind = kind_of_command(command)
    port = option(command, "--port") or (kind.default_port if kind is not None else DEFAULT_PORT)
    return reach_host(host.strip("[]")), int(port)


def fix_command(command: list[str]) -> list[str]:
    """The command as the agent starts it: a kind's preset executable becomes `python -m` its `run_as_module`."""
    kind = kind_of_command(command)
    exe = kind.preset.executable if kind is not None and kind.preset is not None else ()
    if (kind is None or not kind.run_as_module or len(command) < len(exe)
            or [os.path.basename(command[0]), *command[1:len(exe)]] != list(exe)):
        return list(command)
    import shutil
    script = shutil.which(command[0])
    python = os.path.join(os.path.dirname(script), "python") if script else sys.executable
    rest = command[len(exe):]
    if rest and not rest[0].startswith("-"):
        rest = ["--model", rest[0]] + rest[1:]
    return [python, "-m", kind.run_as_module] + rest


def parse_adapters(spec: str | None) -> list[tuple[str, str]]:
    """`lora.adapters` "a=/p,b=/q" -> [("a", "/p"), ("b", "/q")]."""
    if not spec:
        return []
    return [(n.strip(), p.strip()) for n, p in (part.split("=", 1) for part in spec.split(","))]


def server_name_of(command: list[str] | None) -> str | None:
    """The kinds.py name of the server a command starts, or None."""
    kind = kind_of_command(command)
    return kind.name if kind is not None else None


@dataclass(frozen=True)
class RemedyPlan:
    """The remedy environment for a server command ({} if none), why, and its verdict's key."""
    env: dict[str, str]
    why: str | None = None       # None: the server's kind has no remedy
    key: str | None = None


def remedy_plan(command: list[str] | None, mode: str, data_dir: str) -> RemedyPlan:
    """The plan for `command` under openai.apply_server_remedy `mode`."""
    kind = kind_of_command(command)
    if kind is None or not kind.remedy_env:
        return RemedyPlan({})
    # Late: only a kind with a remedy pays its imports before an early spawn (~15 ms).
    from warmup_agent.warmup import remedy
    key = remedy.remedy_key(kind.name, model_in_command(command), kind.remedy_env)
    d = remedy.decide(mode, remedy.RemedyMemory(data_dir).get(key))
    return RemedyPlan(dict(kind.remedy_env) if d.apply else {}, d.why, key)


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


#: Compile-cache variables of every supervised server -> folder under <data_dir>/cache.
CACHE_ENV = {**{v: sub for k in KINDS for v, sub in k.cache_env.items()},
             "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def server_env(base: dict[str, str] | os._Environ, data_dir: str, host: str, lora_adapters: str | None,
               remedy: dict[str, str] | None = None) -> dict[str, str]:
    """`base` plus the agent's cache directories (made here), the kinds' environment defaults and `remedy`; `base` wins."""
    env = dict(base)
    for var, value in (remedy or {}).items():
        env.setdefault(var, value)
    for var, sub in CACHE_ENV.items():
        env.setdefault(var, os.path.join(data_dir, "cache", sub))
        os.makedirs(env[var], exist_ok=True)
    # vLLM's CPU build leaves socket files in TMPDIR.
    env.setdefault("TMPDIR", server_tmpdir(data_dir))
    os.makedirs(env["TMPDIR"], exist_ok=True)
    loopback = host.startswith("127.") or host == "localhost"
    adapters = bool(parse_adapters(lora_adapters))
    for kind in KINDS:
        for var, value in {**(kind.loopback_env if loopback else {}), **(kind.lora_env if adapters else {})}.items():
            env.setdefault(var, value)
    return env


def with_kv_budget(command: list[str], budget: Callable[[], int]) -> list[str]:
    """`command` plus its kind's KV budget flag and `budget()`, unless it sets one of the kind's memory options."""
    kind = kind_of_command(command)
    if kind is None or kind.kv_budget_flag is None or any(option(command, f) for f in kind.memory_flags):
        return list(command)
    return [*command, kind.kv_budget_flag, str(budget())]


def describe_command(command: list[str]) -> str:
    return shlex.join(command)
