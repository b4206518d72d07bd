"""Start a supervised server before the agent's own imports, so its start-up overlaps them.

`cli.main` calls `start(argv)` first thing: it loads and checks the configuration as the
run will and spawns the command the openai engine would start.  A bad configuration starts
nothing.  The engine adopts the early server (`take`) only if its command and environment
are exactly its own, else kills it; a run that ends first kills it (`discard`).  A kind
with a KV budget flag or run as a module (vLLM) is never spawned early: the engine works
out its command.
WARMUP_NO_EARLY_SPAWN=1 turns this off; it is not a WARMUP_AGENT_* name, which the config would reject.

With proxy.listen, its address is bound here too (proxy/listener.py): users who arrive
from the spawn on are connected and held by the proxy, never refused.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import TYPE_CHECKING

from warmup_agent.config import ConfigError
from warmup_agent.server import listener, preflight
from warmup_agent.server import process as server_process
from warmup_agent.server.command import listen_address, remedy_plan, server_env
from warmup_agent.server.kinds import kind_of_command

if TYPE_CHECKING:
    from warmup_agent.config import Config

# `run` options that take a value (cli.build_parser); any other option before `--` means no early spawn.
_VALUED = {"--config", "--model", "--engine", "--listen", "--proxy-listen", "--data-dir", "--record"}
_FLAGS = {"--once", "--no-progress"}


class Early:
    """The server spawned early: its process, command, environment and the process age at its spawn."""

    def __init__(self, proc: subprocess.Popen, command: list[str], env: dict[str, str], at: float,
                 process_age: float | None) -> None:
        self.proc, self.command, self.env, self.at, self.process_age = proc, command, env, at, process_age


_early: Early | None = None
_listener: tuple[str, socket.socket] | None = None       # (proxy.listen, its socket), bound at the spawn
_loaded: tuple[str | None, dict, Config] | None = None   # (config file, flags, configuration)


def _options(words: list[str]) -> dict[str, str] | None:
    """`run`'s options before `--` as {name: value}; None for anything else."""
    out: dict[str, str] = {}
    i = 0
    while i < len(words):
        name, eq, value = words[i].partition("=")
        if name in _VALUED and eq:
            out[name] = value
        elif name in _VALUED and i + 1 < len(words):
            i += 1
            out[name] = words[i]
        elif name not in _FLAGS:
            return None
        i += 1
    return out


def config_flags(model: str | None, engine: str | None, listen: str | None, data_dir: str | None,
                 proxy_listen: str | None) -> dict[str, str | None]:
    """The config keys `run`'s flags set."""
    return {"model.path": model, "engine": engine, "exporter.listen": listen, "data_dir": data_dir,
            "proxy.listen": proxy_listen}


def _validated(options: dict[str, str], environ: dict[str, str]) -> Config | None:
    """The configuration, loaded as the run will load it; None when it is bad (the run reports it)."""
    from warmup_agent import config
    flags = config_flags(options.get("--model"), options.get("--engine"), options.get("--listen"),
                         options.get("--data-dir"), options.get("--proxy-listen"))
    global _loaded
    try:
        cfg = config.load(options.get("--config"), env=environ, flags=flags)
    except config.ConfigError:
        return None
    _loaded = (options.get("--config"), flags, cfg)
    return cfg


def plan(argv: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str], Config] | None:
    """(command, environment, configuration) the openai engine would start; None to start nothing early."""
    if not argv or argv[0] != "run" or "--" not in argv:
        return None
    cut = argv.index("--")
    options, command = _options(argv[1:cut]), list(argv[cut + 1:])
    kind = kind_of_command(command)
    if options is None or not command or (kind is not None and (kind.kv_budget_flag or kind.run_as_module)):
        return None
    cfg = _validated(options, environ)
    if cfg is None or cfg.engine != "openai":
        return None
    try:
        preflight.check(cfg.engine, cfg.openai.url, cfg.exporter, cfg.proxy, command)
    except ConfigError:
        return None
    host, _ = listen_address(command)
    remedy = remedy_plan(command, cfg.openai.apply_server_remedy, cfg.data_dir).env
    return command, server_env(environ, cfg.data_dir, host, cfg.lora.adapters, remedy), cfg


def _can_start(command: list[str]) -> bool:
    """Whether the executable exists and the port is free; otherwise the supervisor reports it."""
    host, port = listen_address(command)
    return server_process.start_problem(command, host, port) is None


def start(argv: list[str]) -> None:
    """Spawn the server the command line names, if it can be worked out here."""
    global _early
    if _early is not None or os.environ.get("WARMUP_NO_EARLY_SPAWN"):
        return
    try:
        planned = plan(argv, dict(os.environ))
        if planned is None:
            return
        command, env, cfg = planned
        _listen_early(cfg.proxy.listen)
        if not _can_start(command):
            return
        from warmup_agent.server.procstart import process_age_seconds
        proc = server_process.spawn(command, env)
    except (OSError, ValueError):
        return   # the engine's own spawn reports it
    _early = Early(proc, command, server_process.final_env(env), time.monotonic(), process_age_seconds())


def _listen_early(listen: str | None) -> None:
    """Bind proxy.listen now; an address in use is left for the proxy to report."""
    global _listener
    if not listen or _listener is not None:
        return
    try:
        _listener = (listen, listener.bind(listener.parse(listen)))
    except (OSError, ValueError):
        pass


def holds_listener(listen: str | None) -> bool:
    """Whether proxy.listen was bound early, for this same address."""
    return _listener is not None and _listener[0] == listen


def take_listener(listen: str | None) -> socket.socket | None:
    """proxy.listen's socket if it was bound early for this same address, else None."""
    global _listener
    found, _listener = _listener, None
    if found is None:
        return None
    if found[0] == listen:
        return found[1]
    found[1].close()
    return None


def loaded_config(path: str | None, flags: dict[str, str | None]) -> Config | None:
    """The configuration start() loaded, once, for the same file and flags (no second file check)."""
    global _loaded
    found, _loaded = _loaded, None
    if found is not None and found[0] == path and found[1] == flags:
        return found[2]
    return None


def take(command: list[str], env: dict[str, str]) -> tuple[Early | None, str | None]:
    """(early server, None) if it was started with exactly this command and environment, else (None, why)."""
    global _early
    early, _early = _early, None
    if early is None:
        return None, None
    wanted = server_process.final_env(env)
    if early.command == command and early.env == wanted:
        return early, None
    changed = sorted(k for k in set(early.env) | set(wanted) if early.env.get(k) != wanted.get(k))
    why = ("the command differs" if early.command != command
           else f"the environment differs ({', '.join(changed[:4])})")
    _kill(early.proc)
    return None, why


def discard() -> None:
    """Kill the early server if nothing adopted it."""
    global _early
    early, _early = _early, None
    if early is not None:
        _kill(early.proc)


def _kill(proc: subprocess.Popen) -> None:
    server_process.kill_group(proc)
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
