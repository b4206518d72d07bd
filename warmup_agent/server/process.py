"""The one way a supervised server is spawned, shared by the supervisor and the early spawn (stdlib only)."""
from __future__ import annotations

import ctypes  # at the top: importing in preexec_fn (after the fork) can deadlock
import os
import signal
import subprocess

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: have the kernel SIGKILL the child when its parent thread dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux/glibc: the process group kill in Supervisor.stop() still applies


def final_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with unbuffered Python output, so log lines reach the agent as written."""
    out = dict(env)
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


def spawn(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start the server in its own process group, output on one pipe, killed when the spawning thread ends."""
    return subprocess.Popen(command, env=final_env(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_die_with_parent)


def port_in_use(host: str, port: int) -> bool:
    """True when something already accepts connections on host:port."""
    import socket
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def start_problem(command: list[str], host: str, port: int | None) -> tuple[str, str] | None:
    """(reason, message) if the executable is missing or the port is taken, else None."""
    import shutil
    if shutil.which(command[0]) is None:
        return ("server_command_not_found",
                f"server command not found: {command[0]!r} (first word after --; not on PATH and not an executable file)")
    if port is not None and port_in_use(host, port):
        return ("port_in_use", f"port {host}:{port} is already in use: another server listens there; "
                               f"stop it or give the server another --port")
    return None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the server's whole process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
