"""The openai engine's server: one the agent starts and supervises, or one already running."""
from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Callable

from warmup_agent.engines.base import EngineError
from warmup_agent.server.command import (
    CACHE_ENV,
    RemedyPlan,
    fix_command,
    http_url,
    listen_address,
    model_in_command,
    option,
    remedy_plan,
    server_env,
    server_name_of,
    with_kv_budget,
)
from warmup_agent.server.kinds import kind_of_command
from warmup_agent.warmup import remedy

if TYPE_CHECKING:
    from warmup_agent.config_sections import LoraSection, OpenaiSection, VllmSection
    from warmup_agent.engines.openai.server_traffic import ServerTraffic
    from warmup_agent.server.supervisor import Supervisor

class ServerHandle:
    """The server behind the engine: `command` to start and supervise, or None for `openai.url`.

    `base_env` is the server's environment before ours (default: os.environ)."""

    def __init__(self, openai: OpenaiSection, *, data_dir: str, lora: LoraSection, vllm: VllmSection,
                 command: list[str] | None, traffic: ServerTraffic, base_env: dict[str, str] | None = None,
                 log: logging.Logger | None = None):
        self.command = fix_command(command) if command else None
        self._created = time.time()     # fallback when the process age is unknown
        if self.command:
            host, port = listen_address(self.command)
            self.host: str = host
            self.port: int | None = port
            self.url = (openai.url or http_url(host, port)).rstrip("/")
        elif openai.url:
            self.url = openai.url.rstrip("/")
            parsed = urllib.parse.urlparse(self.url)
            self.host, self.port = parsed.hostname or "", parsed.port   # "": a URL without a host
        else:
            raise EngineError("server_command_missing",
                              "engine openai needs a server command after -- or openai.url (WARMUP_AGENT_OPENAI_URL)")
        self.openai, self.lora, self.vllm = openai, lora, vllm
        self.data_dir = data_dir
        self.base_env = base_env
        self.traffic = traffic
        self.log = log or logging.getLogger("warmup_agent.engines.openai")
        self.health_path = "/" + openai.health_path.lstrip("/")
        self.on_server_exit: Callable[[int], None] | None = None
        self.on_server_ready: Callable[[], None] | None = None
        self.supervisor: Supervisor | None = None
        self._start_thread: threading.Thread | None = None   # waits for the first health 200
        self._start_error: EngineError | None = None
        self._interrupted = threading.Event()
        self.startup: dict[str, float] = {}   # seconds the server's start-up log reports
        kind = kind_of_command(self.command)
        self._startup_log = {k: re.compile(p) for k, p in (kind.startup_log if kind else {}).items()}
        if kind is not None:
            traffic.request_line = re.compile(kind.request_log)
        self.spawn: dict = {}                  # whether the spawn was early, and why not

    @property
    def served_model_name(self) -> str | None:
        return option(self.command, "--served-model-name") if self.command else None

    @property
    def model_option(self) -> str | None:
        return model_in_command(self.command)

    def server_env(self) -> dict[str, str]:
        """The server's environment: ours plus the agent's cache directories."""
        return server_env(os.environ if self.base_env is None else self.base_env, self.data_dir, self.host,
                          self.lora.adapters, self.applied_remedy)

    def server_command(self) -> list[str]:
        """The command as started; one whose kind takes a KV budget gets one unless it sets its memory."""
        assert self.command, "only a supervised server has a command"
        return with_kv_budget(self.command, self.kv_budget_bytes)

    def kv_budget_bytes(self) -> int:
        configured = self.vllm.kv_cache_memory_bytes
        if configured:
            return configured
        import psutil
        return int(min(psutil.virtual_memory().available * 0.25, 4 << 30))

    def set_callbacks(self, on_exit: Callable[[int], None] | None,
                      on_ready: Callable[[], None] | None) -> None:
        """Crash and recovery callbacks; set before load_weights starts the server."""
        self.on_server_exit = on_exit
        self.on_server_ready = on_ready

    @property
    def start_seconds(self) -> float | None:
        """Spawn-to-healthy seconds; None: not started by us."""
        return self.supervisor.start_seconds if self.supervisor is not None else None

    @property
    def name(self) -> str | None:
        """What server it is, from its command line; None: unknown."""
        return server_name_of(self.command)

    @functools.cached_property
    def remedy(self) -> RemedyPlan:
        """Decided once per agent start (warmup/remedy.py), as early_spawn planned it."""
        if not self.command:
            return RemedyPlan({})
        return remedy_plan(self.command, self.openai.apply_server_remedy, self.data_dir)

    @property
    def applied_remedy(self) -> dict[str, str]:
        return self.remedy.env

    def learn_remedy(self, pays: bool | None, decode_tpots: list[float]) -> dict | None:
        """Keep this start's per-length finding and steady decode under the plan's key."""
        plan = self.remedy
        if plan.key is None or self.openai.apply_server_remedy != "auto":
            return None
        store = remedy.RemedyMemory(self.data_dir)
        entry = remedy.learn(store.get(plan.key), bool(plan.env), pays, decode_tpots)
        store.put(plan.key, entry)
        return entry

    def _on_log_line(self, line: str) -> None:
        self.traffic.log_line(line)
        for key, pattern in self._startup_log.items():
            m = pattern.search(line)
            if m:
                self.startup[key] = float(m.group(1))

    def has_compile_artifacts(self) -> bool:
        """Whether the supervised server wrote into its compile-cache folders during this start.

        Older files are ignored: an inherited cache dir full of another program's files
        would otherwise make solidify import torch for nothing.  True for a server we
        did not start (we cannot tell)."""
        if not self.command:
            return True
        from warmup_agent.server.procstart import process_age_seconds
        age = process_age_seconds()
        since = (time.time() - age if age is not None else self._created) - 1.0
        env = self.server_env()
        for var in CACHE_ENV:
            for root, _, files in os.walk(env[var]):
                for name in files:
                    try:
                        if os.stat(os.path.join(root, name)).st_mtime >= since:
                            return True
                    except OSError:
                        continue
        return False

    def prestart(self) -> None:
        """Spawn the supervised server now so its start-up overlaps the agent's; start() waits."""
        if not self.command or self.supervisor is not None or self._interrupted.is_set():
            return
        from warmup_agent.server import early_spawn
        from warmup_agent.server.supervisor import Supervisor
        command, env = self.server_command(), self.server_env()
        early, why_not = early_spawn.take(command, env)
        if why_not:
            self.log.info("the server spawned before the agent's imports is replaced: %s", why_not)
        self.spawn = {"early": early is not None, "early_replaced_because": why_not}
        # Callbacks are looked up when called: the CLI connects them after this.
        self.supervisor = Supervisor(
            command, self.url + self.health_path, env=env,
            adopt=early.proc if early else None, adopted_spawn_time=early.at if early else None,
            adopted_process_age=early.process_age if early else None,
            host=self.host, port=self.port,
            ready_timeout=self.openai.ready_timeout_seconds,
            backoff_initial=self.openai.restart_backoff_initial_seconds,
            backoff_max=self.openai.restart_backoff_max_seconds,
            drain_seconds=self.openai.drain_seconds,
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

    def start(self, while_starting: Callable[[], None]) -> None:
        """Wait until the health path answers 200, running `while_starting` meanwhile (not on a restart)."""
        if self._interrupted.is_set():
            raise EngineError("stopped", "stopped before the server became healthy")
        if self._start_thread is None and self.supervisor is not None:
            # A restarted server (prewarm re-run): it is ours already, just wait for it.
            self._wait_remote_healthy()
            return
        if self.command:
            self.prestart()
            while_starting()
            thread = self._start_thread
            if thread is not None:
                thread.join()
                self._start_thread = None
            if self._start_error is not None:
                raise self._start_error
        else:
            while_starting()
            self._wait_remote_healthy()

    def interrupt(self) -> None:
        """SIGTERM during warmup: stop waiting, and stop a supervised server still starting."""
        self._interrupted.set()
        if self.supervisor is not None:
            self.supervisor.stop()

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()

    def _wait_remote_healthy(self) -> None:
        import urllib.error  # late: see StreamingClient._stream
        import urllib.request
        deadline = time.monotonic() + self.openai.ready_timeout_seconds
        last = ""
        while time.monotonic() < deadline:
            if self._interrupted.is_set():
                raise EngineError("stopped", "stopped before the server became healthy")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(getattr(e, "reason", e))
            self._interrupted.wait(0.5)
        raise EngineError("server_never_healthy",
                          f"{self.url}{self.health_path} did not answer 200 within {self.openai.ready_timeout_seconds:g} s"
                          + (f" (last error: {last})" if last else ""))
