"""Supervise one model server child process: keep it alive and tell the agent when it comes and goes.

A crash after the server was healthy calls `on_server_exit` at once, then restarts it with
capped exponential backoff.  Every Popen runs on the monitor thread, because
PR_SET_PDEATHSIG fires when the *thread* that forked the child ends; the early spawn's
server comes from the main thread, which lives as long as the process.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Callable

from warmup_agent.errors import EngineError
from warmup_agent.server import process as server_process


class Supervisor:
    """Start, watch, restart and stop one server process; callbacks run on the monitor thread."""

    def __init__(self, command: list[str], health_url: str, *, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", port: int | None = None,
                 ready_timeout: float = 300.0, backoff_initial: float = 1.0, backoff_max: float = 30.0,
                 drain_seconds: float = 10.0, max_restarts: int | None = None,
                 on_server_exit: Callable[[int], None] | None = None,
                 on_server_ready: Callable[[], None] | None = None,
                 on_log_line: Callable[[str], None] | None = None,
                 log: logging.Logger | None = None,
                 adopt: subprocess.Popen | None = None, adopted_spawn_time: float | None = None,
                 adopted_process_age: float | None = None):
        if not command:
            raise EngineError("server_command_missing", "no server command given (put it after --)")
        self.command = list(command)
        self.health_url = health_url
        self.env = env
        self.host, self.port = host, port
        self.ready_timeout = ready_timeout
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.drain_seconds = drain_seconds
        self.max_restarts = max_restarts
        self.on_server_exit = on_server_exit
        self.on_server_ready = on_server_ready
        self.on_log_line = on_log_line
        self.log = log or logging.getLogger("warmup_agent.supervisor")
        self.server_log = logging.getLogger("warmup_agent.server")

        self.proc: subprocess.Popen | None = None
        self.restarts = 0                  # restarts after a crash (not the first start)
        # The first start's spawn-to-healthy seconds, which size the warmup budget.
        self.start_seconds: float | None = None
        self.last_lines: collections.deque[str] = collections.deque(maxlen=40)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._first_ready = threading.Event()
        self._log_moved = threading.Event()     # a server log line since the last health check
        self._first_error: EngineError | None = None
        self._monitor: threading.Thread | None = None
        self._readers: list[threading.Thread] = []
        # The early spawn's server, which the first start adopts.
        self._adopt, self._adopted_at = adopt, adopted_spawn_time
        # Seconds from the agent's process start to the first spawn.
        self.first_spawn_process_age: float | None = adopted_process_age

    def start(self) -> None:
        """Start the server and block until it is healthy; on EngineError nothing is left running."""
        # An adopted server holds its own port; early_spawn checked before spawning it.
        problem = None if self._adopt is not None else server_process.start_problem(self.command, self.host, self.port)
        if problem is not None:
            raise EngineError(*problem)
        self._monitor = threading.Thread(target=self._run, name="server-supervisor", daemon=True)
        self._monitor.start()
        self._first_ready.wait()
        if self._first_error is not None:
            self._monitor.join()
            raise self._first_error

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def healthy(self) -> bool:
        # Imported here so the import overlaps the server's start-up.
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self) -> None:
        """SIGTERM the process group, wait up to drain_seconds, then SIGKILL; idempotent, any thread."""
        self._stopping.set()
        with self._lock:
            proc = self.proc
        if proc is not None:
            self._terminate(proc, self.drain_seconds)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=self.drain_seconds + 10)

    def _run(self) -> None:
        backoff = self.backoff_initial
        first = True
        while not self._stopping.is_set():
            try:
                proc = self._spawn()
                spawned = time.monotonic()
                if first and self._adopted_at is not None:
                    spawned = self._adopted_at    # the server's start-up counts from its real spawn
            except OSError as e:
                err = EngineError("server_command_failed", f"cannot start server {self.command[0]!r}: {e.strerror or e}")
                if first:
                    self._fail_first(err)
                    return
                self.log.error(err.message)
                proc = None
            if proc is not None:
                ok = self._wait_healthy(proc)
                if ok:
                    if first:
                        first = False
                        self.start_seconds = time.monotonic() - spawned
                        self._first_ready.set()
                    else:
                        self.log.info("server restarted and healthy (pid %d, restart %d)", proc.pid, self.restarts)
                    healthy_since = time.monotonic()
                    if self.on_server_ready:
                        self.on_server_ready()
                    rc = proc.wait()
                    server_process.kill_group(proc)   # what the dead server spawned must not outlive it
                    self._join_readers()
                    if self._stopping.is_set():
                        return
                    # A server that stayed up for a while earns a fresh backoff.
                    if time.monotonic() - healthy_since > 60:
                        backoff = self.backoff_initial
                    self.log.error("server exited with code %s; restarting in %.1f s (last log: %s)",
                                   rc, backoff, self._last_line())
                    if self.on_server_exit:
                        self.on_server_exit(rc)
                elif first:
                    return  # _wait_healthy reported the reason through _fail_first
                elif self._stopping.is_set():
                    return
            if self.max_restarts is not None and self.restarts >= self.max_restarts:
                self.log.error("server restarted %d times; giving up", self.restarts)
                return
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, self.backoff_max)
            self.restarts += 1

    def _spawn(self) -> subprocess.Popen:
        proc, how = self._adopt, "spawned before the agent's imports"
        self._adopt = None
        if proc is None:
            proc, how = server_process.spawn(self.command, dict(os.environ if self.env is None else self.env)), "started"
            if self.first_spawn_process_age is None:
                from warmup_agent.server.procstart import process_age_seconds
                self.first_spawn_process_age = process_age_seconds()
        with self._lock:
            self.proc = proc
        self.log.info("server %s (pid %d): %s", how, proc.pid, " ".join(self.command))
        reader = threading.Thread(target=self._pump, args=(proc,), name="server-log", daemon=True)
        reader.start()
        self._readers = [reader]
        return proc

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None, "the server is started with stdout=PIPE"
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            self.last_lines.append(line)
            self._log_moved.set()
            self.server_log.info("%s", line)
            if self.on_log_line:
                try:
                    self.on_log_line(line)
                except Exception:  # noqa: BLE001 - a listener bug must not stop log capture
                    self.log.exception("log listener failed")
        proc.stdout.close()

    def _join_readers(self) -> None:
        for t in self._readers:
            t.join(timeout=5)

    def _wait_healthy(self, proc: subprocess.Popen) -> bool:
        started = time.monotonic()
        deadline = started + self.ready_timeout
        while True:
            if self._stopping.is_set():
                self._terminate(proc, 0)
                if self._first_ready.is_set():
                    return False
                self._fail_first(EngineError("stopped", "stopped before the server became healthy"))
                return False
            rc = proc.poll()
            if rc is not None:
                server_process.kill_group(proc)
                self._join_readers()
                reason, why = self._exit_reason()
                err = EngineError(reason, f"server exited with code {rc} before it became healthy: {why}")
                if not self._first_ready.is_set():
                    self._fail_first(err)
                else:
                    self.log.error(err.message)
                    if self.on_server_exit:
                        self.on_server_exit(rc)
                return False
            if self.healthy():
                return True
            if time.monotonic() > deadline:
                self._terminate(proc, 0)
                err = EngineError("server_never_healthy",
                                  f"server did not answer {self.health_url} with 200 within {self.ready_timeout:g} s "
                                  f"(last log: {self._last_line()})")
                if not self._first_ready.is_set():
                    self._fail_first(err)
                else:
                    self.log.error(err.message)
                return False
            # Often at first, then every 0.5 s; a log line wakes it sooner, as servers log "listening".
            if self._log_moved.wait(0.02 if time.monotonic() - started < 30 else 0.5):
                time.sleep(0.002)       # at most one check per 2 ms during a burst of lines
            self._log_moved.clear()

    def _exit_reason(self) -> tuple[str, str]:
        text = "\n".join(self.last_lines)
        if "Address already in use" in text or "address already in use" in text:
            return "port_in_use", "its port is already in use"
        return "server_exited", self._last_line()

    def _last_line(self) -> str:
        return self.last_lines[-1] if self.last_lines else "(no output)"

    def _fail_first(self, err: EngineError) -> None:
        self._first_error = err
        self._first_ready.set()

    def _terminate(self, proc: subprocess.Popen, grace: float) -> None:
        """SIGTERM the whole process group, then SIGKILL it after `grace` seconds."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace if grace > 0 else 0.5)
            except subprocess.TimeoutExpired:
                pass
        # Children may outlive the leader: kill the group regardless.
        server_process.kill_group(proc)
        if proc.poll() is None:
            proc.wait()

