"""What a running model server says about its own life, read without giving it a task.

A probe would reset a sleeping server's idle timer and wake it; health endpoints, /metrics
and /proc do not.  `identity()` is when the listening process started: a new value means a
new, cold process.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import urllib.error
import urllib.request
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import psutil
from prometheus_client.parser import text_string_to_metric_families

from warmup_agent.server.kinds import KINDS, ServerKind

if TYPE_CHECKING:
    from exporter.engine_metrics import EngineMetricNames, EngineStats

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
        self._listener: psutil.Process | None = None   # the process on the URL's port, once found

    def _get(self, path: str, timeout: float | None = None) -> bytes | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout if timeout is None else timeout) as r:
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
        """When the server's process started (epoch seconds); None: unknown this time.

        One source per server, read the same way every time: the server's own figure where
        its kind exports one (it reaches across a pod's containers), else the create time of
        the process listening on the URL's port (where that process is visible).  A failed
        read is never answered from the other source: computed another way, the two differed
        by 0.26 s for one process, and that read as a restart.  A failed read is no news."""
        if self.kind is not None and self.kind.start_time_metric is not None:
            return self._metric_start_time(self.kind.start_time_metric)
        return self._listener_start_time()

    def _metric_start_time(self, name: str) -> float | None:
        body = self._get("/metrics")
        if body is None:
            return None
        try:
            for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
                for sample in family.samples:
                    if sample.name == name and math.isfinite(sample.value):
                        return float(sample.value)
        except ValueError:     # not an exposition: nothing said
            return None
        return None

    def water_level(self, timeout: float | None = None) -> EngineStats | None:
        """Requests running and waiting, from the server's /metrics through its kind's names.  None: no
        exposition (llama-server needs --metrics, transformers serve has none) or no answer within `timeout`."""
        if self.kind is not None and not (self.kind.running_metric or self.kind.waiting_metric):
            return None
        body = self._get("/metrics", timeout)
        if body is None:
            return None
        from exporter.engine_metrics import parse_engine_metrics
        try:
            return parse_engine_metrics(body.decode("utf-8", "replace"), engine_metric_names(self.kind))
        except ValueError:
            return None

    def _listener_start_time(self) -> float | None:
        """The create time of the process listening on the URL's port, from psutil: the
        kernel's boot time plus the process's start ticks, as the server's own figure
        (prometheus_client's process collector) computes it."""
        proc = self._listener
        # is_running() is False for a process gone or a pid reused: look for the listener again.
        if proc is None or not proc.is_running():
            try:
                port = urlsplit(self.url).port or 80
            except ValueError:
                return None
            pid = listener_pid(port)
            try:
                proc = psutil.Process(pid) if pid is not None else None
            except psutil.Error:
                proc = None
            self._listener = proc
        # The Process keeps the create time it read first: the same figure at every read.
        return proc.create_time() if proc is not None else None


def engine_metric_names(kind: ServerKind | None = None) -> EngineMetricNames:
    """The series exporter/engine_metrics.py reads for `kind` (server/kinds.py); every kind's
    where None: each name has its server's prefix, so no server's figures read as another's."""
    from exporter.engine_metrics import EngineMetricNames

    def names(k: ServerKind) -> EngineMetricNames:
        def one(name: str | None) -> tuple[str, ...]:
            return (name,) if name else ()
        return EngineMetricNames(running=one(k.running_metric), waiting=one(k.waiting_metric),
                                 kv_use=k.kv_use_metrics, kv_info=one(k.kv_info_metric),
                                 finished=one(k.finished_metric), first_token=one(k.first_token_metric))

    total = EngineMetricNames()
    for k in [kind] if kind is not None else KINDS:
        total += names(k)
    return total


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

