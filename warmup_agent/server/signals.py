"""What a running model server says about its own life, read without giving it a task.

A probe would reset a sleeping server's idle timer and wake it; health endpoints, /metrics
and /proc do not.  `identity()` is when the listening process started: a new value means a
new, cold process.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from warmup_agent.server.kinds import ServerKind

log = logging.getLogger("warmup_agent.server.signals")

#: Reads must not hold the watch loop: a hung server is the breaker's business.
READ_TIMEOUT = 1.0


class ServerSignals:
    def __init__(self, url: str, kind: ServerKind | None, health_path: str = "/health",
                 timeout: float = READ_TIMEOUT):
        self.url = url.rstrip("/")
        self.kind = kind
        self.health_path = health_path
        self.timeout = timeout
        self._pid: int | None = None
        self._pid_started: float | None = None

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout) as r:
                return r.read() if r.status == 200 else None
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def health(self) -> str | None:
        """None when the health endpoint answers 200, else "unreachable", "timeout" or "server_error"."""
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=self.timeout) as r:
                return None if r.status == 200 else "server_error"
        except urllib.error.HTTPError:
            return "server_error"
        except (TimeoutError, socket.timeout):
            return "timeout"
        except urllib.error.URLError as e:
            return "timeout" if isinstance(e.reason, (TimeoutError, socket.timeout)) else "unreachable"
        except (OSError, ValueError):
            return "unreachable"

    def sleeping(self) -> bool | None:
        """True/False as the server says; None when it cannot say or did not answer."""
        if self.kind is None or self.kind.sleep_path is None:
            return None
        body = self._get(self.kind.sleep_path)
        if body is None:
            return None
        try:
            value = json.loads(body).get(self.kind.sleep_key)
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, bool) else None

    def wake(self) -> bool:
        """Send the kind's wake call; False where it has none (a request wakes it)."""
        if self.kind is None or self.kind.wake_path is None:
            return False
        req = urllib.request.Request(self.url + self.kind.wake_path, data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=max(self.timeout, 60.0)):
                return True
        except (OSError, urllib.error.URLError) as e:
            log.warning("wake call %s%s failed: %s", self.url, self.kind.wake_path, e)
            return False

    def identity(self) -> float | None:
        """When the server's process started (epoch seconds), or None if unknown."""
        started = self._metric_start_time()
        return started if started is not None else self._listener_start_time()

    def _metric_start_time(self) -> float | None:
        if self.kind is None or self.kind.start_time_metric is None:
            return None
        body = self._get("/metrics")
        if body is None:
            return None
        m = re.search(rb"^" + re.escape(self.kind.start_time_metric.encode()) + rb"(?:\{[^}]*\})? ([0-9.e+]+)$",
                      body, re.MULTILINE)
        return float(m.group(1)) if m else None

    def _listener_start_time(self) -> float | None:
        """The start of the process listening on the URL's port, from /proc."""
        if self._pid is not None and self._pid_started is not None:
            now = _start_time(self._pid)
            if now is not None and abs(now - self._pid_started) < 0.5:
                return self._pid_started
        try:
            port = urlsplit(self.url).port or 80
        except ValueError:
            return None
        pid = listener_pid(port)
        self._pid = pid
        self._pid_started = _start_time(pid) if pid is not None else None
        return self._pid_started


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(parts[9])
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return inodes


def listener_pid(port: int) -> int | None:
    """The process holding a listening TCP socket on `port`, where /proc shows it."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not inodes:
        return None
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            for fd in os.listdir(fd_dir):
                if os.readlink(f"{fd_dir}/{fd}") in inodes:
                    return int(entry)
        except OSError:
            continue
    return None


def _start_time(pid: int) -> float | None:
    """Process start as epoch seconds (10 ms resolution), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        boot_age = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return round(time.time() - boot_age + ticks / os.sysconf("SC_CLK_TCK"), 2)
