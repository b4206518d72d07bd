"""A server the bench starts: its own process group, its output in a log file,
and a stop that leaves nothing running.

`stop` sends SIGTERM to the process it started (as Kubernetes does), times the
exit, then counts what outlived it: processes of its group and descendants seen
while it ran (an agent may start its server in a session of its own).  Those are
orphans; they are killed, and so is the group.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

ORPHAN_GRACE = 2.0     # seconds the children get to follow their parent out


@dataclass
class Started:
    proc: subprocess.Popen
    log_path: str
    t0: float                                   # time.monotonic() at spawn
    seen: set[int] = field(default_factory=set)  # descendants seen while it ran

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        return self.proc.poll()

    def note_children(self) -> None:
        """Remember its descendants (call now and then while it runs)."""
        try:
            self.seen.update(c.pid for c in psutil.Process(self.pid).children(recursive=True))
        except psutil.Error:
            pass

    def last_line(self) -> str:
        """The last non-blank line of its output, for an error message."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 4096))
                lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:200] if lines else ""


def spawn(command: list[str], log_path: str, env: dict[str, str] | None = None, cwd: str | None = None) -> Started:
    """Start `command` in a new session (its own process group), output to log_path."""
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)
    return Started(proc, log_path, t0)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid`."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and _alive(p.pid):
                out.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


def stop(s: Started, timeout: float = 60.0) -> dict[str, Any]:
    """SIGTERM, wait up to `timeout` s, then SIGKILL; orphans counted and killed.
    Returns what happened: exit seconds, return code, whether it needed SIGKILL,
    and the orphans."""
    s.note_children()
    killed = False
    t = time.monotonic()
    if s.proc.poll() is None:
        try:
            s.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            s.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            killed = True
            _kill_group(s.pid)
            s.proc.wait()
    exit_seconds = time.monotonic() - t
    deadline = time.monotonic() + ORPHAN_GRACE
    left: list[int] = []
    while True:
        left = sorted(set(group_members(s.pid)) | {p for p in s.seen if _alive(p)})
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _kill_group(s.pid)
    return {"exit_seconds": exit_seconds, "returncode": s.proc.returncode, "sigkill": killed, "orphans": len(left)}


def kill_now(s: Started) -> None:
    """No grace: the group and every descendant seen (an interrupt, a failure)."""
    s.note_children()
    _kill_group(s.pid)
    for pid in s.seen:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        s.proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
