"""The openai engine's server glue: the command and environment it starts the
server with, the supervisor (server/supervisor.py) that keeps it running, its start-up
log lines, the wait for health, interrupting and closing."""
from __future__ import annotations

import os
import re
import threading
from typing import Callable

from warmup_agent.engines.base import EngineError
from warmup_agent.engines.openai.discovery import Discovery
from warmup_agent.server.command import is_vllm, option, server_env, server_name_of, server_remedy

# vLLM's start-up log lines that say how long its own compile / graph capture took.
_STARTUP_PATTERNS = {
    "compile_seconds": re.compile(r"torch\.compile takes ([\d.]+) s in total"),
    "graph_capture_seconds": re.compile(r"Graph capturing finished in ([\d.]+) sec"),
    "engine_init_seconds": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) sec"),
    "weights_load_seconds": re.compile(r"Loading weights took ([\d.]+) sec"),
    "model_load_seconds": re.compile(r"Model loading took [\d.]+ [GM]i?B(?: memory)? and ([\d.]+) sec"),
}


class ServerGlue(Discovery):
    """Starting and supervising the server (the top layer under OpenAIEngine)."""

    def server_env(self) -> dict[str, str]:
        """The server's environment: ours plus the agent's cache directories
        (server_command.server_env)."""
        return server_env(os.environ if self.base_env is None else self.base_env, self.cfg.data_dir, self.host,
                          self.cfg.lora.adapters, self.applied_remedy)

    def server_command(self) -> list[str]:
        """The command as started: a vLLM command that sets no memory budget gets
        --kv-cache-memory-bytes (without it the CPU build takes ~8 GiB)."""
        assert self.command, "only a supervised server has a command"
        cmd = list(self.command)
        if is_vllm(cmd) and not option(cmd, "--kv-cache-memory-bytes") and not option(cmd, "--gpu-memory-utilization"):
            cmd += ["--kv-cache-memory-bytes", str(self.kv_budget_bytes())]
        return cmd

    def kv_budget_bytes(self) -> int:
        configured = self.cfg.vllm.kv_cache_memory_bytes
        if configured:
            return configured
        import psutil
        return int(min(psutil.virtual_memory().available * 0.25, 4 << 30))

    def set_server_callbacks(self, on_exit: Callable[[int], None] | None,
                             on_ready: Callable[[], None] | None) -> None:
        """Crash and recovery of the supervised server (Engine.set_server_callbacks);
        set before load_weights starts it."""
        self.on_server_exit = on_exit
        self.on_server_ready = on_ready

    @property
    def server_start_seconds(self) -> float | None:
        return self.supervisor.start_seconds if self.supervisor is not None else None

    @property
    def server_name(self) -> str | None:
        return server_name_of(self.command)

    @property
    def applied_remedy(self) -> dict[str, str]:
        """The remedy environment given to the supervised server (openai.apply_server_remedy)."""
        if not (self.cfg.openai.apply_server_remedy and self.command):
            return {}
        return server_remedy(self.command)

    def _on_log_line(self, line: str) -> None:
        self.traffic.log_line(line)
        for key, pattern in _STARTUP_PATTERNS.items():
            m = pattern.search(line)
            if m:
                self.startup[key] = float(m.group(1))

    # -- Engine -----------------------------------------------------------------------

    def prestart(self) -> None:
        """Spawn the supervised server now, without waiting for it: its own start-up
        (1.2-1.5 s for llama.cpp on an H200) then overlaps the agent's set-up and the
        tokenizer load.  start_server() waits for it.  Nothing to do without a command
        or once started."""
        if not self.command or self.supervisor is not None or self._interrupted.is_set():
            return
        from warmup_agent.server import early_spawn
        from warmup_agent.server.supervisor import Supervisor
        command, env = self.server_command(), self.server_env()
        early, why_not = early_spawn.take(command, env)
        if why_not:
            self.log.info("the server spawned before the agent's imports is replaced: %s", why_not)
        self.spawn = {"early": early is not None, "early_replaced_because": why_not}
        # The callbacks are looked up when called: the CLI connects them after this.
        self.supervisor = Supervisor(
            command, self.url + self.health_path, env=env,
            adopt=early.proc if early else None, adopted_spawn_time=early.at if early else None,
            adopted_process_age=early.process_age if early else None,
            host=self.host, port=self.port,
            ready_timeout=self.cfg.openai.ready_timeout_seconds,
            backoff_initial=self.cfg.openai.restart_backoff_initial_seconds,
            backoff_max=self.cfg.openai.restart_backoff_max_seconds,
            drain_seconds=self.cfg.openai.drain_seconds,
            on_server_exit=lambda rc: self.on_server_exit(rc) if self.on_server_exit else None,
            on_server_ready=lambda: self.on_server_ready() if self.on_server_ready else None,
            on_log_line=self._on_log_line, log=self.log)
        supervisor = self.supervisor

        def start() -> None:
            try:
                supervisor.start()
            except EngineError as e:
                self._start_error = e
        self._start_thread = threading.Thread(target=start, name="server-start", daemon=True)
        self._start_thread.start()

    def start_server(self) -> None:
        """Start the server (or wait for the given one) until its health path
        answers 200, and nothing more: no request reaches it.  The local tokenizer
        loads while the server starts."""
        if self._interrupted.is_set():
            raise EngineError("stopped", "stopped before the server became healthy")
        if self._start_thread is None and self.supervisor is not None:
            # Called again after the supervisor restarted a crashed server (the
            # pipeline re-runs prewarm): the server is ours already, just wait for it.
            self._wait_remote_healthy()
            return
        if self.command:
            self.prestart()
            self.load_tokenizer()      # local files: overlaps the server's start-up
            thread = self._start_thread
            if thread is not None:
                thread.join()
                self._start_thread = None
            if self._start_error is not None:
                raise self._start_error
        else:
            self.load_tokenizer()
            self._wait_remote_healthy()

    def interrupt(self) -> None:
        """SIGTERM during warmup: stop waiting for the server; a supervised one that
        is still starting is stopped (its start() then raises 'stopped')."""
        self._interrupted.set()
        if self.supervisor is not None:
            self.supervisor.stop()

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- HTTP -------------------------------------------------------------------------
