"""SIGTERM drains through the CLI even when the kernel hands the signal to a
thread other than the main one (what happened on the H200 hosts: the agent
never drained and was SIGKILLed after the grace period).

`tgkill` sends the signal to one chosen thread of the agent, reproducing on the
CPU what the GPU host's kernel did by chance.  With the old untimed
`Event.wait()` the main thread never ran the handler and this test timed out.
"""
import ctypes
import json
import os
import platform
import signal
import subprocess
import time

import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers.servers import free_port, http_get, wait_until

SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())


def tgkill(pid: int, tid: int, sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL, pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")


def signal_a_worker_thread(pid: int, sig: int) -> bool:
    """Send `sig` to one thread of `pid` other than the main one, newest first (a
    thread may end between the listing and the signal: the next one is tried).
    False when no worker thread took it (or tgkill's number is unknown here)."""
    if SYS_TGKILL is None:
        return False
    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    for tid in reversed(tids):
        try:
            tgkill(pid, tid, sig)
            return True
        except ProcessLookupError:
            continue
    return False


def start_agent(tmp_path, data_dir):
    port = free_port()
    log = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env.update(WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS="0.2")
    proc = subprocess.Popen(agent_cmd("run", "--no-progress", "--data-dir", data_dir, "--listen", f"127.0.0.1:{port}"),
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_get(url + "/readyz")[0] == 200 or proc.poll() is not None, 180, what="agent SERVING")
    assert proc.poll() is None, log.read_text()
    return proc, url, log


def watch_states(url: str, proc: subprocess.Popen, seen: set) -> None:
    """Poll /startupz until the process exits, collecting the states it reports."""
    while proc.poll() is None:
        try:
            code, body = http_get(url + "/startupz", timeout=1)
            if code in (200, 503):
                seen.add(json.loads(body)["state"])
        except OSError:
            pass
        time.sleep(0.02)


@pytest.mark.skipif(SYS_TGKILL is None, reason="tgkill number known for x86_64/aarch64 only")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_on_a_worker_thread_drains(tmp_path, data_dir, embedded_model, sig):
    import threading
    proc, url, log = start_agent(tmp_path, data_dir)
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
        assert tids, "the agent runs worker threads (exporter, probes)"
        seen: set = set()
        watcher = threading.Thread(target=watch_states, args=(url, proc, seen), daemon=True)
        watcher.start()
        t0 = time.monotonic()
        assert signal_a_worker_thread(proc.pid, sig), "every worker thread ended before the signal"
        rc = proc.wait(timeout=15)
        took = time.monotonic() - t0
        watcher.join(2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert rc == 0, text[-2000:]
    assert took < 5, f"drained in {took:.1f} s (Kubernetes' default grace period is 30 s; target 5 s)"
    assert f"signal {int(sig)}: draining" in text
    assert "state SERVING -> DRAINING" in text
    assert "Traceback" not in text


def test_sigterm_during_warmup_stops_the_run(tmp_path, data_dir, embedded_model):
    """A SIGTERM before SERVING (a rollout that gives up on a pod) ends the run
    with exit 0 and never reports SERVING afterwards."""
    port = free_port()
    log = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    proc = subprocess.Popen(agent_cmd("run", "--no-progress", "--data-dir", data_dir, "--listen", f"127.0.0.1:{port}"),
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "state INIT -> PRELOAD" in log.read_text() or proc.poll() is not None, 120,
                   what="agent in PRELOAD")
        if not signal_a_worker_thread(proc.pid, signal.SIGTERM):
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert rc == 0, text[-2000:]
    assert "-> DRAINING" in text, text[-2000:]
    assert "-> SERVING" not in text.split("-> DRAINING", 1)[1]


def test_sigterm_while_waiting_for_a_starting_server(tmp_path, data_dir, embedded_model):
    """SIGTERM during PRELOAD while the supervised server is still starting: the
    agent stops waiting for its /health (it used to wait out
    openai.ready_timeout_seconds, 600 s here), stops the server and exits 0."""
    import sys
    import uuid
    port, marker = free_port(), f"never-healthy-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env.update(WARMUP_AGENT_OPENAI_URL=f"http://127.0.0.1:{port}", WARMUP_AGENT_OPENAI_READY_TIMEOUT_SECONDS="600")
    # A "server" that never listens: its /health never answers.
    server = [sys.executable, "-c", "import time; time.sleep(600)", marker]
    proc = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                      "--data-dir", data_dir, "--listen", "127.0.0.1:0", "--", *server),
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def server_running() -> bool:
        return subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0
    try:
        wait_until(lambda: server_running() or proc.poll() is not None, 120, what="server started by the agent")
        time.sleep(1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["pkill", "-f", marker])
    text = log.read_text()
    assert rc == 0, text[-2000:]
    assert took < 5, f"exited {took:.1f} s after SIGTERM\n{text[-2000:]}"
    assert "-> DRAINING" in text and "-> FAILED" not in text, text[-2000:]
    wait_until(lambda: not server_running(), 5, what="the server process gone")
    assert "Traceback" not in text
