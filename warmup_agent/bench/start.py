"""One start of the user's server under one condition, measured from outside.

  alone    the server's command; ready when its health endpoint answers 200
  oneshot  the same, plus one 1-token request at health; ready when it is answered
  agent    `warmup-agent run --engine openai ... -- COMMAND`; ready at the agent's /readyz
  spawn-alone, spawn-agent
           a user's request sent at the spawn, retried only when refused, to the server
           alone or through the agent's proxy (bench/spawn.py); that request alone is measured

At ready the first request goes out at once, then the steady ones one by one;
after a quiet pause the warm control (the same shape: what a warm server's
"first" request reads, the noise floor of the tax) and one a dozen words longer
than any before it (what a warm server pays at a new prompt length); then a
burst of concurrent ones; then SIGTERM, timed, and the orphans counted.  Under
the agent its exported first-request taxes are read from /metrics before the stop.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from warmup_agent.bench import client, process, spawn
from warmup_agent.bench.traffic import Shape, Traffic

POLL = 0.01        # seconds between health polls
# The agent's metrics the bench reads from its /metrics, as any scraper does: by name
# (tests/test_metrics_doc.py checks these against the catalogue).
EXPORTED_TAXES = (("ttft", "warmup_first_request_tax_ratio"), ("total", "warmup_first_request_total_tax_ratio"))


class StartFailed(Exception):
    """A start that could not be measured; str() is the one line to show, and
    `record` keeps what was measured before it failed."""

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
    """Seconds from spawn until GET url answers 200; StartFailed-ready messages
    are raised by the caller from the RuntimeError's text."""
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
    """Start the condition's process (the agent with its proxy on `proxy_port` where
    given); returns it and the URL that says it is ready."""
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


@dataclass
class Steady:
    """The steady requests' medians: what an answer of n tokens takes on a warm server."""
    ttft: float
    total: float
    tpot: float | None      # None where every steady answer was one chunk

    def total_for(self, a: client.Answer) -> float:
        """A steady answer as long as `a`: TTFT + (its tokens - 1) x time per token.  The
        first answer of a random or sampled model can run much longer than the steady
        ones; dividing by their plain median would count its length as cold start."""
        if self.tpot is None:
            return self.total
        return self.ttft + max(0, a.chunks - 1) * self.tpot

    def tax(self, a: client.Answer) -> dict[str, float | None]:
        return {"ttft": a.ttft / self.ttft, "total": a.total / self.total_for(a),
                "tpot": a.tpot / self.tpot if a.tpot is not None and self.tpot else None}


def _measure(base: str, model: str | None, traffic: Traffic, shape: Shape, setup: Setup, out: dict) -> None:
    """First, steady, the two controls, burst; each figure goes into `out` as soon as it is measured."""
    first = client.stream_chat(base, model, traffic.request(shape))
    out["first"] = first.as_dict()
    answers = [client.stream_chat(base, model, traffic.request(shape)) for _ in range(setup.steady)]
    tpots = [t for a in answers if (t := a.tpot) is not None]
    steady = Steady(statistics.median(a.ttft for a in answers), statistics.median(a.total for a in answers),
                    statistics.median(tpots) if tpots else None)
    tax = steady.tax(first)
    out.update(steady_ttft_seconds=steady.ttft, steady_total_seconds=steady.total, steady_tpot_seconds=steady.tpot,
               first_ttft_tax=tax["ttft"], first_total_tax=tax["total"], first_tpot_tax=tax["tpot"],
               steady_ttft_all_seconds=[a.ttft for a in answers])
    time.sleep(setup.idle)
    warm = steady.tax(client.stream_chat(base, model, traffic.request(shape)))
    longer = client.stream_chat(base, model, traffic.request(traffic.longer(shape)))
    out.update(warm_control_ttft_ratio=warm["ttft"], warm_control_total_ratio=warm["total"],
               new_length_ttft_ratio=longer.ttft / steady.ttft)
    if setup.burst > 1:
        bodies = [traffic.request(shape) for _ in range(setup.burst)]
        with ThreadPoolExecutor(setup.burst) as pool:
            burst = list(pool.map(lambda b: client.stream_chat(base, model, b), bodies))
        burst_ttft = statistics.median(a.ttft for a in burst)
        out.update(burst_ttft_median_seconds=burst_ttft, burst_total_max_seconds=max(a.total for a in burst),
                   burst_ttft_over_steady=burst_ttft / steady.ttft)


def run_start(setup: Setup, traffic: Traffic, condition: str, index: int) -> dict[str, Any]:
    """One start, measured; raises StartFailed (with what was measured) when the
    server fails to start, never gets ready, or stops answering."""
    port = setup.port if setup.port is not None else process.free_port()
    shape = traffic.shape(index)
    rec: dict[str, Any] = {"condition": condition, "start": index + 1, "port": port, "shape": shape.describe()}
    _wait_port(setup.host, port, rec)
    if condition.startswith("spawn-"):
        return _spawn_start(setup, traffic.request(shape), condition, index, port, rec)
    s, ready_url = _spawn(setup, condition, index, port)
    rec.update(pid=s.pid, log=s.log_path)
    base = _url(setup.host, port)
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
        _measure(base, setup.model, traffic, shape, setup, rec)
        if condition == "agent":
            _agent_said(ready_url.removesuffix("/readyz") + "/metrics", rec)
    except client.RequestFailed as e:
        code = _exit_code(s)
        process.kill_now(s)
        if code is not None:
            how = f"the {_who(condition)} exited with code {code} mid-run ({e})"
        elif e.kind == "refused":
            how = f"the server refused a request mid-run ({e})"
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


def _agent_said(metrics_url: str, rec: dict[str, Any]) -> None:
    """The agent's exported first-request taxes (its probes' prediction, since the
    bench's requests go straight to the server), beside what the bench measured."""
    text = client.get_text(metrics_url) or ""
    for what, name in EXPORTED_TAXES:
        said, measured = client.gauge(text, name), rec.get(f"first_{what}_tax")
        rec[f"agent_exported_{what}_tax"] = said
        rec[f"exported_over_measured_{what}_tax"] = said / measured if said and measured else None


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
