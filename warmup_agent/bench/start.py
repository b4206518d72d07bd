"""One start of the user's server under one condition, measured from outside.

  alone    the server's command; ready when its health endpoint answers 200
  oneshot  the same, plus one 1-token request at health; ready when it is answered
  agent    `warmup-agent run --engine openai --proxy-listen ... -- COMMAND`; ready at the
           agent's /readyz; every request through its proxy, as users reach the pod
  spawn-alone, spawn-agent
           a user's request sent at the spawn, retried only when refused, to the server
           alone or through the agent's proxy (bench/spawn.py); that request alone is measured

At ready, bench/measure.py's steps; under the agent its exported figures are read
from /metrics before the stop.  Then SIGTERM, timed, and the orphans counted.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from warmup_agent.bench import client, measure, process, spawn
from warmup_agent.bench.measure import Steady
from warmup_agent.bench.traffic import Traffic
from warmup_agent.config import BY_PATH

__all__ = ["Setup", "StartFailed", "StartInterrupted", "Steady", "run_start"]

POLL = 0.01        # seconds between health polls
USERS_TAX_WAIT = 2.0    # seconds the users' first-request tax may take to show after its last answer
# The agent's metrics the bench reads from its /metrics, by name, all of them here
# (tests/test_metrics_doc.py and tests/test_bench_agent_figures.py check them).
#: The users' real first request through the proxy (0 until measured): the figure of record.
EXPORTED_TAXES = (("ttft", "warmup_first_user_request_tax_ratio"),
                  ("total", "warmup_first_user_request_total_tax_ratio"))
#: The agent's probes' prediction of it.
PREDICTED_TAXES = (("ttft", "warmup_first_request_tax_ratio"), ("total", "warmup_first_request_total_tax_ratio"))
USERS_WINDOW = BY_PATH["readiness.first_user_steady_requests"].default
BEHIND_PENDING = "warmup_behind_users_pending"      # 1 while the warm-up behind the users has requests left
BEHIND_SECONDS = "warmup_behind_users_seconds"      # how long the last one took (0 until one finished)
PHASE_SECONDS = "model_loading_phase_duration_seconds"   # by phase: the prewarm stage's seconds
BUDGET_SECONDS = "warmup_budget_seconds"
BUDGET_SPENT = "warmup_budget_spent_seconds"        # what the warm-up took of it, before SERVING
AGENT_METRICS = tuple(name for _, name in EXPORTED_TAXES + PREDICTED_TAXES) + (
    BEHIND_PENDING, BEHIND_SECONDS, PHASE_SECONDS, BUDGET_SECONDS, BUDGET_SPENT)


class StartFailed(Exception):
    """A start that could not be measured: str() the line to show, `record` what was measured."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


class StartInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM to the bench) during a start; `record` is what it measured."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__()
        self.record = record


@dataclass
class Setup:
    """What every start needs; `command` may hold `{port}`, replaced per start."""
    command: list[str]
    host: str
    port: int | None                 # None: a free port per start ({port} in the command)
    model: str | None                # the name requests send (None: the server's default)
    health_path: str = "/health"
    ready_timeout: float = 600.0
    steady: int = 8
    idle: float = 2.0                # seconds of quiet before the warm control
    burst: int = 4
    stop_timeout: float = 60.0
    logs: str = "."
    agent_args: list[str] = field(default_factory=list)   # --config / --model for `run`
    agent_env: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] | None = None

    def server_command(self, port: int) -> list[str]:
        return [w.replace("{port}", str(port)) for w in self.command]


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _wait_ready(s: process.Started, url: str, timeout: float, what: str) -> float:
    """Seconds from spawn until GET url answers 200 (RuntimeError: the caller's StartFailed)."""
    deadline = s.t0 + timeout
    last_note = 0.0
    while True:
        code = s.exited()
        if code is not None:
            line = s.last_line()
            raise RuntimeError(f"exited with code {code} before {what} answered 200"
                               + (f"; its last line: {line}" if line else ""))
        if client.get_status(url) == 200:
            return time.monotonic() - s.t0
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"never became ready: {url} did not answer 200 within {timeout:g} s")
        if now - last_note > 1.0:
            s.note_children()
            last_note = now
        time.sleep(POLL)


def _spawn(setup: Setup, condition: str, index: int, port: int,
           proxy_port: int | None = None) -> tuple[process.Started, str]:
    """The condition's process (the agent: its proxy on `proxy_port`) and its ready URL."""
    log = os.path.join(setup.logs, f"{condition}-{index + 1}.log")
    cmd = setup.server_command(port)
    if condition not in ("agent", "spawn-agent"):
        return process.spawn(cmd, log, env=setup.env), _url(setup.host, port) + setup.health_path
    listen = process.free_port()
    record = os.path.join(setup.logs, f"{condition}-{index + 1}.record.json")
    proxy = ["--proxy-listen", f"127.0.0.1:{proxy_port}"] if proxy_port is not None else []
    agent = [sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--engine", "openai",
             "--listen", f"127.0.0.1:{listen}", "--record", record, *proxy, *setup.agent_args, "--", *cmd]
    env = dict(setup.env if setup.env is not None else os.environ, **setup.agent_env)
    return process.spawn(agent, log, env=env), f"http://127.0.0.1:{listen}/readyz"


def run_start(setup: Setup, traffic: Traffic, condition: str, index: int) -> dict[str, Any]:
    """One start, measured; StartFailed when the server fails to start, get ready or answer."""
    port = setup.port if setup.port is not None else process.free_port()
    shape = traffic.shape(index)
    rec: dict[str, Any] = {"condition": condition, "start": index + 1, "port": port, "shape": shape.describe()}
    _wait_port(setup.host, port, rec)
    if condition.startswith("spawn-"):
        return _spawn_start(setup, traffic.request(shape), condition, index, port, rec)
    proxy_port = process.free_port() if condition == "agent" else None
    s, ready_url = _spawn(setup, condition, index, port, proxy_port)
    rec.update(pid=s.pid, log=s.log_path)
    base = _url(setup.host, port)
    # What users reach: under the agent its proxy, as the chart's Service targets it
    users = f"http://127.0.0.1:{proxy_port}" if proxy_port is not None else base
    rec["users_url"] = users
    try:
        try:
            if condition == "agent":
                rec["ready_seconds"] = _wait_ready(s, ready_url, setup.ready_timeout, "the agent's /readyz")
            else:
                rec["health_seconds"] = _wait_ready(s, ready_url, setup.ready_timeout, setup.health_path)
                if condition == "oneshot":
                    client.stream_chat(base, setup.model, {"messages": [{"role": "user", "content": "Hello"}],
                                                           "max_tokens": 1})
                rec["ready_seconds"] = time.monotonic() - s.t0
        except RuntimeError as e:
            raise StartFailed(f"{condition} start {index + 1}: the {_who(condition)} {e}", rec) from None
        _measure(measure.Requests(users, setup.model, traffic, shape, index), setup,
                 ready_url.removesuffix("/readyz") if condition == "agent" else None, rec)
    except client.RequestFailed as e:
        code = _exit_code(s)
        process.kill_now(s)
        if code is not None:
            how = f"the {_who(condition)} exited with code {code} mid-run ({e})"
        elif e.kind == "refused":
            refuser = "the agent's proxy" if proxy_port is not None else "the server"
            how = f"{refuser} refused a request mid-run ({e})"
            if "context" in str(e).lower():
                how += "; the prompts do not fit its context: lower --max-context"
        elif e.kind == "error_event":
            how = f"a request failed mid-run: the server sent an error event mid-stream ({e})"
        elif e.kind == "cut_off":
            how = f"a request failed mid-run: the server cut its stream off ({e})"
        else:
            how = f"the server stopped answering mid-run ({e})"
        raise StartFailed(f"{condition} start {index + 1}: {how}", rec) from None
    except KeyboardInterrupt:  # Ctrl-C: nothing it started stays behind, what it measured stays
        process.kill_now(s)
        raise StartInterrupted(rec) from None
    except BaseException:
        process.kill_now(s)
        raise
    try:
        rec["sigterm"] = process.stop(s, setup.stop_timeout)
    except KeyboardInterrupt:
        process.kill_now(s)
        raise StartInterrupted(rec) from None
    return rec


def _spawn_start(setup: Setup, body: dict[str, Any], condition: str, index: int, port: int,
                 rec: dict[str, Any]) -> dict[str, Any]:
    """A user who arrives at the spawn: their request, sent to what users reach (the
    server; the agent's proxy), timed from the spawn to its whole answer; then the
    time to ready (/health; the agent's /readyz) and SIGTERM."""
    proxy_port = process.free_port() if condition == "spawn-agent" else None
    s, ready_url = _spawn(setup, condition, index, port, proxy_port)
    rec.update(pid=s.pid, log=s.log_path)
    users = f"http://127.0.0.1:{proxy_port}" if proxy_port is not None else _url(setup.host, port)
    try:
        try:
            rec["spawn_arrival"] = spawn.arrive(users, setup.model, body, s.t0, setup.ready_timeout)
            rec["ready_seconds"] = _wait_ready(s, ready_url, setup.ready_timeout, "ready")
        except (client.RequestFailed, RuntimeError) as e:
            process.kill_now(s)
            raise StartFailed(f"{condition} start {index + 1}: the user sent at the spawn got no answer: {e}",
                              rec) from None
        rec["sigterm"] = process.stop(s, setup.stop_timeout)
    except KeyboardInterrupt:
        process.kill_now(s)
        raise StartInterrupted(rec) from None
    return rec


def _measure(r: measure.Requests, setup: Setup, agent: str | None, rec: dict[str, Any]) -> None:
    """bench/measure.py's steps; under the agent (`agent`: its URL) the warm-up behind the users too."""
    pending = (lambda: _read(agent, BEHIND_PENDING)) if agent else None
    steady = measure.first_and_steady(r, setup.steady, rec, pending)
    measure.controls(r, steady, setup.idle, rec)
    measure.burst(r, steady, setup.burst, rec)
    if agent and pending:
        measure.after_background(r, setup.steady, rec, pending, lambda: _read(agent, BEHIND_SECONDS))
    measure.new_length(r, rec)
    if agent:
        _agent_said(agent, rec)


def _read(agent: str, name: str) -> float | None:
    """One unlabelled sample of the agent's /metrics; None where it does not answer."""
    text = client.get_text(agent + "/metrics")
    return None if text is None else client.gauge(text, name)


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _agent_said(agent: str, rec: dict[str, Any], wait: float = USERS_TAX_WAIT) -> None:
    """The agent's figures: the users' first-request taxes (up to `wait` s), the prediction, the budget."""
    deadline = time.monotonic() + wait
    while True:
        text = client.get_text(agent + "/metrics") or ""
        users = {what: client.gauge(text, name) or None for what, name in EXPORTED_TAXES}   # 0: not measured
        if users["ttft"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    users_window_tax(rec)
    for what, name in PREDICTED_TAXES:
        measured = rec.get(f"first_{what}_tax")
        rec[f"agent_exported_{what}_tax"] = users[what]
        rec[f"exported_over_measured_{what}_tax"] = _over(users[what], rec.get(f"first_{what}_tax_users_window",
                                                                              measured))
        rec[f"agent_predicted_{what}_tax"] = predicted = client.gauge(text, name)
        rec[f"predicted_over_measured_{what}_tax"] = _over(predicted, measured)
    # The budget covers the warm-up alone; the prewarm stage also waits for the server's start-up.
    budget, spent = client.gauge(text, BUDGET_SECONDS), client.gauge(text, BUDGET_SPENT)
    phase = client.gauge(text, PHASE_SECONDS, {"phase": "prewarm"})
    rec.update(warmup_budget_seconds=budget, warmup_budget_spent_seconds=spent, prewarm_phase_seconds=phase,
               warmup_budget_overspend_ratio=_over(spent, budget), prewarm_phase_over_budget=_over(phase, budget))


def users_window_tax(rec: dict[str, Any], n: int = USERS_WINDOW) -> None:
    """The client's first-TTFT tax over the answers the agent's exported one uses (the n after it)."""
    after, first = rec.get("steady_ttft_all_seconds") or [], (rec.get("first") or {}).get("ttft_seconds")
    if first and len(after) >= n:
        rec["first_ttft_tax_users_window"] = first / statistics.median(after[:n])


def _exit_code(s: process.Started, wait: float = 1.0) -> int | None:
    """Its exit code if it died (a dropped stream comes a moment before the exit is seen)."""
    try:
        return s.proc.wait(wait)
    except subprocess.TimeoutExpired:   # still running
        return None


def _who(condition: str) -> str:
    return "agent" if condition == "agent" else "server"


def _wait_port(host: str, port: int, rec: dict[str, Any], timeout: float = 10.0) -> None:
    """The port must be free before a start: a listener left there would be measured instead."""
    deadline = time.monotonic() + timeout
    while not process.port_free(host, port):
        if time.monotonic() > deadline:
            raise StartFailed(f"{rec['condition']} start {rec['start']}: port {port} on {host} is in use "
                              "by another process", rec)
        time.sleep(0.2)
