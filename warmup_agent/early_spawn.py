"""Start a supervised server before the agent imports anything (issue 30).

`warmup-agent run ... -- llama-server ...`: everything the agent does before the
server's spawn is on the critical path of every start, and the server's own start-up
(1.3-1.7 s for llama.cpp on an H200) overlaps everything after it.  The CLI's imports
(configuration, engines, logging: 0.2-0.3 s) used to come first.  Now `cli.main`
calls `start(argv)` first thing: from the command line, the environment and the
config file it works out the command and environment the server will get, exactly as
the openai engine would (server_command.py), and spawns it.

That is a guess made before the configuration is validated, so it is checked: when
the engine starts the server (`take`), the early one is adopted only if its command
and environment are exactly what the engine would start; otherwise it is killed and
the engine spawns its own, with one log line saying why.  A run that fails before
that (a config error) kills it (`discard`).  Nothing is spawned early for vLLM (its
command gets a memory budget from the validated config, and it takes a minute to
start anyway), for a command that is not on PATH, or for a port already taken: the
supervisor reports those as before.  WARMUP_NO_EARLY_SPAWN=1 turns it off (to measure
what it saves; not a WARMUP_AGENT_* name, which the config would reject).

Standard library only, and as little of it as possible: this runs before any of the
agent's imports.
"""
from __future__ import annotations

import os
import subprocess
import time

from warmup_agent import server_process
from warmup_agent.data_dir import default_data_dir
from warmup_agent.server_command import is_vllm, listen_address, server_env

# `warmup-agent run` options that take a value (cli.build_parser); any other option
# before `--` (e.g. --help) means: no early spawn.
_VALUED = {"--config", "--model", "--engine", "--listen", "--proxy-listen", "--data-dir", "--record"}
_FLAGS = {"--once", "--no-progress"}


class Early:
    """The server spawned early: its process, command, environment and the process age at its spawn."""

    def __init__(self, proc: subprocess.Popen, command: list[str], env: dict[str, str], at: float,
                 process_age: float | None) -> None:
        self.proc, self.command, self.env, self.at, self.process_age = proc, command, env, at, process_age


_early: Early | None = None


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


def _from_file(path: str) -> dict | None:
    """The config file's mapping (only data_dir and lora.adapters are read), None when
    it cannot be read: config.load reports that."""
    try:
        import yaml
        with open(path, encoding="utf-8") as f:
            tree = yaml.safe_load(f)
    except Exception:  # noqa: BLE001 - any problem: no early spawn, config.load says what it is
        return None
    return tree if isinstance(tree, dict) else ({} if tree is None else None)


def plan(argv: list[str], environ: dict[str, str] | os._Environ) -> tuple[list[str], dict[str, str]] | None:
    """(command, environment) the openai engine would start for this command line,
    or None when nothing should start early."""
    if not argv or argv[0] != "run" or "--" not in argv:
        return None
    cut = argv.index("--")
    options, command = _options(argv[1:cut]), list(argv[cut + 1:])
    if options is None or not command or is_vllm(command):
        return None
    tree: dict = {}
    if "--config" in options:
        found = _from_file(options["--config"])
        if found is None:
            return None
        tree = found
    data_dir = (options.get("--data-dir") or environ.get("WARMUP_AGENT_DATA_DIR") or tree.get("data_dir")
                or default_data_dir())
    lora = tree.get("lora")
    adapters = environ.get("WARMUP_AGENT_LORA_ADAPTERS") or (lora.get("adapters") if isinstance(lora, dict) else None)
    if not isinstance(data_dir, str) or not (adapters is None or isinstance(adapters, str)):
        return None
    host, _ = listen_address(command)
    return command, server_env(environ, data_dir, host, adapters)


def _can_start(command: list[str]) -> bool:
    """What Supervisor.start checks before its own spawn: the executable exists and
    the port is free.  Either failing: leave it to the supervisor's named error."""
    import shutil
    if shutil.which(command[0]) is None:
        return False
    host, port = listen_address(command)
    return not server_process.port_in_use(host, port)


def start(argv: list[str]) -> None:
    """Spawn the server the command line names, if it can be worked out here."""
    global _early
    if _early is not None or os.environ.get("WARMUP_NO_EARLY_SPAWN"):
        return
    try:
        planned = plan(argv, os.environ)
        if planned is None or not _can_start(planned[0]):
            return
        command, env = planned
        from warmup_agent.procstart import process_age_seconds
        proc = server_process.spawn(command, env)
    except (OSError, ValueError):
        return   # the engine's own spawn reports it
    _early = Early(proc, command, server_process.final_env(env), time.monotonic(), process_age_seconds())


def take(command: list[str], env: dict[str, str]) -> tuple[Early | None, str | None]:
    """(the early server, None) when it was started with exactly this command and
    environment, else (None, why not); the early server, if any, is then killed."""
    global _early
    early, _early = _early, None
    if early is None:
        return None, None
    if early.command == command and early.env == server_process.final_env(env):
        return early, None
    changed = sorted(k for k in set(early.env) | set(env) if early.env.get(k) != server_process.final_env(env).get(k))
    why = ("the command differs" if early.command != command
           else f"the environment differs ({', '.join(changed[:4])})")
    _kill(early.proc)
    return None, why


def discard() -> None:
    """Kill the early server if nothing adopted it (the run ended before the engine
    started its server)."""
    global _early
    early, _early = _early, None
    if early is not None:
        _kill(early.proc)


def _kill(proc: subprocess.Popen) -> None:
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
