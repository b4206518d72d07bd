"""A server that stops answering takes the pod out of its Service (issue 41).

Real processes only: llama.cpp's `llama-server` (the CPU build of
tools/build_llama_server.py, the embedded model as GGUF) started by the test on its
own, and the agent run as the CLI beside it in sidecar mode (`openai.url`), as the
chart's sidecar mode runs it.  Once SERVING:

  killed     the server is SIGKILLed: /readyz must turn 503 within one watch interval
             (polled), warmup_breaker_trips_total{reason="unreachable"} counts it, the
             agent logs one line (no traceback) however long the server stays down, and
             warmup_watch_probe_failures_total grows one per interval meanwhile;
             restarted on the same port, it is a new process and cold: the agent
             notices it (warmup_server_restarts_total) and warms it again (the state
             passes PRELOAD and PRIME) before /readyz is 200, without waiting out
             breaker.open_seconds.
  hung       the server is SIGSTOPped (it accepts connections, answers nothing): the
             probe times out (readiness.watch_probe_timeout_seconds), reason timeout;
             SIGCONT, and it is back within one watch interval + 1 s, with no re-warm
             (the same process, still warm).

The freeze and the intervals are short through the config; the time bounds have
slack for a loaded 2-core machine, and each measured time is printed.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers import llamacpp_server as ls
from tests.helpers.servers import free_port, http_get, stop_process, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

INTERVAL = 1.0        # readiness.watch_interval_seconds
OPEN = 4.0            # breaker.open_seconds (the freeze of every cause but unreachable)
PROBE_TIMEOUT = 1.5   # readiness.watch_probe_timeout_seconds
SLACK = 0.6           # a loaded 2-core machine: the poll, a scheduling delay


def metric(url: str, name: str, **labels: str) -> float:
    text = http_get(url + "/metrics")[1]
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + sel + '}') if sel else ''} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def poll(predicate, timeout: float) -> float:
    """Seconds until predicate() held (polled every 20 ms); TimeoutError past `timeout`."""
    t0 = time.monotonic()
    wait_until(predicate, timeout, interval=0.02, what="condition")
    return time.monotonic() - t0


def readyz(url: str) -> int:
    return http_get(url + "/readyz", timeout=2)[0]


def test_a_dead_or_hung_sidecar_server_takes_the_pod_out_and_back(tmp_path, embedded_model, data_dir,
                                                                  llama_server, gguf):
    port, listen = free_port(), free_port()
    env = ls.server_env(str(tmp_path))
    server_cmd = ls.server_command(llama_server, gguf, port)
    server_log = open(tmp_path / "server.log", "w")

    def start_server() -> subprocess.Popen:
        proc = subprocess.Popen(server_cmd, env=env, stdout=server_log, stderr=subprocess.STDOUT)
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200, 120,
                   what="llama-server /health")
        return proc

    server = start_server()
    agent_env = dict(env, WARMUP_AGENT_OPENAI_URL=f"http://127.0.0.1:{port}",
                     WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[24]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]",
                     WARMUP_AGENT_READINESS_MIN_PROBES="5",
                     WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS=str(INTERVAL),
                     WARMUP_AGENT_READINESS_WATCH_PROBE_TIMEOUT_SECONDS=str(PROBE_TIMEOUT),
                     WARMUP_AGENT_BREAKER_OPEN_SECONDS=str(OPEN))
    agent_log = tmp_path / "agent.log"
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                       "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}"),
                             cwd=ROOT, env=agent_env, stdout=open(agent_log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"
    try:
        wait_until(lambda: readyz(url) == 200 or agent.poll() is not None, 300, what="SERVING")
        assert agent.poll() is None, agent_log.read_text()[-3000:]
        time.sleep(2 * INTERVAL)                       # watch probes after SERVING are under way
        assert readyz(url) == 200 and metric(url, "warmup_breaker_trips_total", reason="unreachable") == 0

        # --- killed: out within one watch interval -----------------------------------------
        server.kill()
        server.wait()
        out = poll(lambda: readyz(url) == 503, INTERVAL + SLACK)
        print(f"killed: /readyz 503 after {out:.2f} s (watch interval {INTERVAL} s)")
        assert metric(url, "warmup_breaker_trips_total", reason="unreachable") == 1
        assert metric(url, "warmup_breaker_trips_total", reason="slow") == 0
        assert metric(url, "warmup_breaker_state", state="open") == 1
        failures = metric(url, "warmup_watch_probe_failures_total", reason="unreachable")
        time.sleep(4 * INTERVAL)                       # stays down: probed once an interval, quietly
        more = metric(url, "warmup_watch_probe_failures_total", reason="unreachable") - failures
        assert 2 <= more <= 6, more
        assert readyz(url) == 503
        text = agent_log.read_text()
        assert text.count("breaker tripped (unreachable)") == 1, text[-3000:]
        assert "Traceback" not in text and "probe after SERVING failed" not in text, text[-3000:]

        # --- restarted on the same port: a new process, warmed again ------------------------
        primes = metric(url, "warmup_state_transitions_total", **{"from": "PRELOAD", "to": "PRIME"})
        server = start_server()
        up, up_wall = time.monotonic(), time.time()
        poll(lambda: readyz(url) == 200, 120)
        print(f"restarted: /readyz 200 {time.monotonic() - up:.2f} s after the server's /health, after a re-warm")
        # seen at once, not at the next watch tick: the down server's /health is polled between ticks
        line = [x for x in agent_log.read_text().splitlines() if "re-warm (the server is cold)" in x][-1]
        seen = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000 - up_wall
        print(f"restarted: the re-warm began {seen:.2f} s after the server's /health")
        assert seen <= 0.3, line
        assert metric(url, "warmup_state_transitions_total", **{"from": "PRELOAD", "to": "PRIME"}) == primes + 1, \
            "SERVING again without a re-warm"
        restarts = sum(metric(url, "warmup_server_restarts_total", detected_by=d) for d in ("start_time", "came_back"))
        assert restarts == 1
        assert metric(url, "warmup_breaker_state", state="closed") == 1
        text = agent_log.read_text()
        assert "the model server restarted" in text and "Traceback" not in text, text[-3000:]

        # --- hung: the probe times out; back within one interval of answering again -----------
        time.sleep(2 * INTERVAL)
        os.kill(server.pid, signal.SIGSTOP)
        out = poll(lambda: readyz(url) == 503, INTERVAL + PROBE_TIMEOUT + SLACK)
        print(f"hung: /readyz 503 after {out:.2f} s (interval {INTERVAL} s + probe timeout {PROBE_TIMEOUT} s)")
        assert metric(url, "warmup_breaker_trips_total", reason="timeout") == 1
        assert metric(url, "warmup_watch_probe_failures_total", reason="timeout") >= 1
        time.sleep(OPEN)                               # hung longer than the breaker's freeze
        primes = metric(url, "warmup_state_transitions_total", **{"from": "PRELOAD", "to": "PRIME"})
        os.kill(server.pid, signal.SIGCONT)
        back = poll(lambda: readyz(url) == 200, INTERVAL + 1 + SLACK)
        print(f"hung then resumed: /readyz 200 {back:.2f} s after SIGCONT (watch interval {INTERVAL} s)")
        assert metric(url, "warmup_state_transitions_total", **{"from": "PRELOAD", "to": "PRIME"}) == primes, \
            "a paused server was warmed again"
        assert metric(url, "warmup_breaker_trips_total", reason="slow") == 0, "the late answer was judged"
        text = agent_log.read_text()
        assert text.count("breaker tripped (timeout)") == 1 and "Traceback" not in text, text[-3000:]
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
        try:
            rc = agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()
            rc = agent.wait()
        try:
            os.kill(server.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        stop_process(server)
    assert rc == 0, agent_log.read_text()[-3000:]
