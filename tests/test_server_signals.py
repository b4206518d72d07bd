"""A server's identity (warmup_agent/server/signals.py): when its process started, read
from one source, the same way every time, and unknown (None) when the read fails.

Real processes on 127.0.0.1: a Python process exposing prometheus_client's own process
series (as vLLM's API server does) and a plain `http.server` (a server whose kind exports
no start time).  A /metrics read is made to time out by stopping the server (SIGSTOP).
Before issue 73 that read fell back to /proc, computed another way, and the agent took
the difference for a restart.

Then the real CPU vLLM beside the agent (sidecar mode): one of the life watch's /metrics
reads times out while the server runs (vLLM's own --middleware option delays that one
answer), and the pod stays SERVING, not re-warmed, no restart counted; a real restart on
the same port is still seen and warmed again.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.servers import free_port, http_get, stop_process, wait_until
from warmup_agent.server.kinds import BY_NAME
from warmup_agent.server.signals import ServerSignals

VLLM = BY_NAME["vllm"]            # its start time is the server's own figure in /metrics
LLAMACPP = BY_NAME["llamacpp"]    # no figure: the create time of the listening process

EXPOSE = ("import sys, time, prometheus_client; "
          "prometheus_client.start_http_server(int(sys.argv[1]), addr='127.0.0.1'); time.sleep(600)")


def start(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: http_get(f"http://127.0.0.1:{port}/", timeout=1)[0] in (200, 404), 30, what="server up")
    return proc


@pytest.fixture
def exposing():
    """A process serving prometheus_client's exposition (process_start_time_seconds included)."""
    port = free_port()
    proc = start([sys.executable, "-c", EXPOSE, str(port)], port)
    yield proc, f"http://127.0.0.1:{port}"
    os.kill(proc.pid, signal.SIGCONT)
    stop_process(proc)


def plain_server(port: int, folder) -> subprocess.Popen:
    return start([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(folder), str(port)],
                 port)


def test_the_servers_own_figure_is_its_process_create_time(exposing):
    proc, url = exposing
    started = ServerSignals(url, VLLM).identity()
    created = psutil.Process(proc.pid).create_time()
    print(f"/metrics says {started:.3f}, psutil says {created:.3f}: {abs(started - created) * 1000:.1f} ms apart")
    assert started is not None and abs(started - created) < 0.02


def test_a_metrics_read_that_times_out_is_unknown(exposing):
    """The listener stays visible in /proc meanwhile: the old fallback read it there."""
    proc, url = exposing
    signals = ServerSignals(url, VLLM, timeout=0.5)
    known = signals.identity()
    assert known is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        during = signals.identity()
        waited = time.monotonic() - t0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert waited >= 0.5, "the read did not time out"
    assert during is None, f"a timed-out read gave {during} (the server's figure is {known})"
    assert signals.identity() == known          # answering again: the same figure


@pytest.mark.parametrize("page", [None, "not an exposition {\n", "# HELP other x\nother 1.0\n"],
                         ids=["404", "garbage", "no_start_time"])
def test_a_metrics_page_without_the_figure_is_unknown(tmp_path, page):
    """A kind that exports its start time, but this server's page does not say it: unknown,
    never the listener's create time (two sources would be mixed between reads)."""
    if page is not None:
        (tmp_path / "metrics").write_text(page)
    port = free_port()
    server = plain_server(port, tmp_path)
    try:
        assert ServerSignals(f"http://127.0.0.1:{port}", VLLM).identity() is None
    finally:
        stop_process(server)


def test_without_a_figure_the_listeners_create_time_and_a_new_process_is_new(tmp_path):
    port = free_port()
    signals = ServerSignals(f"http://127.0.0.1:{port}", LLAMACPP)
    assert signals.identity() is None                       # nothing listens: unknown
    first = plain_server(port, tmp_path)
    try:
        created = psutil.Process(first.pid).create_time()
        assert signals.identity() == created
        os.kill(first.pid, signal.SIGSTOP)                  # a hung server: /proc still says
        try:
            assert signals.identity() == created
        finally:
            os.kill(first.pid, signal.SIGCONT)
    finally:
        stop_process(first)
    assert signals.identity() is None                       # gone: unknown
    second = plain_server(port, tmp_path)
    try:
        again = signals.identity()
        assert again == psutil.Process(second.pid).create_time() and again != created
    finally:
        stop_process(second)


# --- the real CPU vLLM under the agent (sidecar mode, as the chart runs it) ------------------

INTERVAL = 1.0        # readiness.watch_interval_seconds
READ_TIMEOUT = 2.0    # readiness.watch_probe_timeout_seconds: the life watch's reads wait as long
STALL = 4.0           # the one /metrics answer comes this late: the agent has given up by then

#: Loaded into vLLM with its own --middleware option: once the test creates the ARMED file,
#: the next /metrics request answers STALL seconds late; everything else is answered meanwhile.
MIDDLEWARE = '''
import asyncio, os, time

async def stall_one_metrics_read(request, call_next):
    if (request.url.path.startswith("/metrics") and os.path.exists(os.environ["STALL_ARMED"])
            and not os.path.exists(os.environ["STALL_STARTED"])):
        with open(os.environ["STALL_STARTED"], "w") as f:
            f.write(repr(time.time()))
        await asyncio.sleep(float(os.environ["STALL_SECONDS"]))
    return await call_next(request)
'''


def metric(url: str, name: str, **labels: str) -> float:
    text = http_get(url + "/metrics")[1]
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + sel + '}') if sel else ''} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def state(url: str) -> str:
    return json.loads(http_get(url + "/startupz", timeout=2)[1])["state"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_timed_out_metrics_read_leaves_vllm_serving_and_a_real_restart_is_still_seen(tmp_path, embedded_model,
                                                                                      data_dir):
    from tests.conftest import ROOT, agent_cmd
    from tests.helpers import vllm_server
    port, listen = free_port(), free_port()
    server_url, url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{listen}"
    (tmp_path / "middleware").mkdir()
    (tmp_path / "middleware" / "metrics_stall.py").write_text(MIDDLEWARE)
    armed, started = tmp_path / "armed", tmp_path / "stall-started"
    env = {k: v for k, v in vllm_server.server_env(str(tmp_path)).items() if not k.startswith("WARMUP_AGENT_")}
    server_env = dict(env, PYTHONPATH=str(tmp_path / "middleware"), STALL_ARMED=str(armed),
                      STALL_STARTED=str(started), STALL_SECONDS=str(STALL))
    cmd = vllm_server.server_command(embedded_model, port, "--middleware", "metrics_stall.stall_one_metrics_read")
    server_log = open(tmp_path / "server.log", "w")

    def start_server() -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=server_env, stdout=server_log, stderr=subprocess.STDOUT)
        wait_until(lambda: proc.poll() is not None or http_get(server_url + "/health", timeout=1)[0] == 200, 300,
                   what="vLLM /health")
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        return proc

    server = start_server()
    assert "process_start_time_seconds " in http_get(server_url + "/metrics")[1], "vLLM exports its start time"
    agent_env = dict(env, WARMUP_AGENT_OPENAI_URL=server_url, WARMUP_AGENT_OPENAI_MODEL=vllm_server.SERVED_NAME,
                     WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[16]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]",
                     WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS=str(INTERVAL),
                     WARMUP_AGENT_READINESS_WATCH_PROBE_TIMEOUT_SECONDS=str(READ_TIMEOUT))
    agent_log = tmp_path / "agent.log"
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                       "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}"),
                             cwd=ROOT, env=agent_env, stdout=open(agent_log, "w"), stderr=subprocess.STDOUT)
    primes = {"from": "PRELOAD", "to": "PRIME"}
    try:
        wait_until(lambda: agent.poll() is not None or state(url) == "SERVING", 300, what="SERVING")
        assert agent.poll() is None, agent_log.read_text()[-3000:]
        time.sleep(3 * INTERVAL)                  # the life watch has read the server's start time
        warmed = metric(url, "warmup_state_transitions_total", **primes)
        assert warmed == 1

        # --- one /metrics read times out while the server runs: same process, still warm ------
        armed.touch()
        wait_until(started.exists, 10 * INTERVAL, interval=0.05, what="the agent's next /metrics read")
        seen = set()
        until = time.monotonic() + STALL + 3 * INTERVAL
        while time.monotonic() < until:        # through the stall and the reads after it
            seen.add(state(url))
            time.sleep(0.05)
        print(f"states seen while one /metrics read of {READ_TIMEOUT} s waited {STALL} s: {sorted(seen)}")
        assert seen == {"SERVING"}, agent_log.read_text()[-3000:]
        assert metric(url, "warmup_state_transitions_total", **primes) == warmed, "re-warmed for nothing"
        for how in ("start_time", "came_back"):
            assert metric(url, "warmup_server_restarts_total", detected_by=how) == 0, how
        assert http_get(url + "/readyz")[0] == 200
        assert "the model server restarted" not in agent_log.read_text()

        # --- a real restart on the same port: a new process, warmed again ----------------------
        server.kill()
        server.wait()
        server = start_server()
        up = time.monotonic()
        wait_until(lambda: http_get(url + "/readyz", timeout=2)[0] == 200, 300, interval=0.2, what="SERVING again")
        print(f"restarted: /readyz 200 {time.monotonic() - up:.2f} s after vLLM's /health, after a re-warm")
        assert metric(url, "warmup_state_transitions_total", **primes) == warmed + 1
        assert metric(url, "warmup_server_restarts_total", detected_by="start_time") == 1
        assert metric(url, "warmup_server_restarts_total", detected_by="came_back") == 0
        text = agent_log.read_text()
        assert "the model server restarted (start time)" in text and "Traceback" not in text, text[-3000:]
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
        try:
            rc = agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()
            rc = agent.wait()
        stop_process(server)
    assert rc == 0, agent_log.read_text()[-3000:]
