"""Supervisor and openai-engine start-up errors, with real child processes.

The "server" here is a few lines of Python serving /health (http.server), so
these run in seconds; tests/test_openai_engine.py does the same against the
real vLLM server.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.helpers.engines import openai_engine
from tests.helpers.servers import free_port, wait_until
from warmup_agent import config
from warmup_agent.engines.base import EngineError
from warmup_agent.server.command import fix_command, option
from warmup_agent.server.supervisor import Supervisor

# A tiny health server.  It starts a grandchild (`sleep`) to prove that the whole
# process group goes, writes its pids to PIDFILE, and on SIGTERM writes DRAINED
# before exiting (unless IGNORE_TERM is set, to prove the SIGKILL fallback).
HEALTH_SERVER = textwrap.dedent("""
    import http.server, os, signal, subprocess, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    d = os.environ["STATE_DIR"]
    child = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(d, "pids"), "a") as f:
        f.write(f"{os.getpid()} {child.pid}\\n")
    def term(*_):
        open(os.path.join(d, "drained"), "w").write("yes")
        sys.exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("IGNORE_TERM") else term)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): print("request", self.path, flush=True)
    print("health server up", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def _pids(state_dir) -> list[int]:
    path = os.path.join(state_dir, "pids")
    if not os.path.exists(path):
        return []
    return [int(p) for line in open(path) for p in line.split()]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _no_orphans(state_dir) -> None:
    pids = _pids(state_dir)
    wait_until(lambda: not any(_alive(p) for p in pids), 10, what="server processes gone")


def _supervisor(tmp_path, port, **kw) -> Supervisor:
    env = dict(os.environ, STATE_DIR=str(tmp_path), **kw.pop("extra_env", {}))
    return Supervisor([sys.executable, "-c", HEALTH_SERVER, "--port", str(port)],
                      f"http://127.0.0.1:{port}/health", env=env, port=port, **kw)


def test_start_is_healthy_and_stop_drains_with_sigterm(tmp_path):
    port = free_port()
    sup = _supervisor(tmp_path, port, drain_seconds=5)
    sup.start()
    assert sup.healthy()
    assert "health server up" in sup.last_lines
    sup.stop()
    assert (tmp_path / "drained").read_text() == "yes"   # SIGTERM reached it, it drained
    _no_orphans(tmp_path)


def test_stop_kills_a_server_that_ignores_sigterm(tmp_path):
    port = free_port()
    sup = _supervisor(tmp_path, port, drain_seconds=0.5, extra_env={"IGNORE_TERM": "1"})
    sup.start()
    sup.stop()
    assert not (tmp_path / "drained").exists()
    _no_orphans(tmp_path)


def test_crash_restarts_with_backoff_and_calls_back(tmp_path):
    port = free_port()
    exits, readies = [], []
    sup = _supervisor(tmp_path, port, backoff_initial=0.2, backoff_max=0.4,
                      on_server_exit=exits.append, on_server_ready=lambda: readies.append(sup.pid))
    sup.start()
    try:
        first = sup.pid
        assert readies == [first]
        for crash in (1, 2):
            old = sup.pid
            os.kill(old, signal.SIGKILL)
            wait_until(lambda: len(exits) == crash, 10, what="on_server_exit")  # noqa: B023 - polled at once
            assert exits[-1] == -signal.SIGKILL
            wait_until(lambda: len(readies) == crash + 1, 20, what="on_server_ready after restart")  # noqa: B023
            assert readies[-1] != old and sup.healthy()
        assert sup.restarts == 2
    finally:
        sup.stop()
    _no_orphans(tmp_path)   # the crashed servers' grandchildren went with their group too


def test_never_healthy_is_named_and_leaves_nothing(tmp_path):
    port = free_port()
    script = ("import os, subprocess, time; c = subprocess.Popen(['sleep', '600']); "
              "open(os.environ['STATE_DIR'] + '/pids', 'w').write(f'{os.getpid()} {c.pid}'); time.sleep(600)")
    sup = Supervisor([sys.executable, "-c", script, "--port", str(port)], f"http://127.0.0.1:{port}/health",
                     env=dict(os.environ, STATE_DIR=str(tmp_path)), port=port, ready_timeout=1.5)
    with pytest.raises(EngineError) as e:
        sup.start()
    assert e.value.reason == "server_never_healthy"
    assert "/health" in e.value.message and "1.5 s" in e.value.message
    _no_orphans(tmp_path)


def test_server_that_exits_is_named_with_its_last_line(tmp_path):
    port = free_port()
    sup = Supervisor([sys.executable, "-c", "import sys; print('model file is corrupt'); sys.exit(3)", "--port", str(port)],
                     f"http://127.0.0.1:{port}/health", port=port)
    with pytest.raises(EngineError) as e:
        sup.start()
    assert e.value.reason == "server_exited"
    assert "code 3" in e.value.message and "model file is corrupt" in e.value.message


def _cfg(tmp_path, **env):
    return config.load(env={"WARMUP_AGENT_DATA_DIR": str(tmp_path / "data"), **env})


def test_bad_server_command_is_named(tmp_path):
    eng = openai_engine(_cfg(tmp_path), server_command=["no-such-model-server", "--port", str(free_port())])
    with pytest.raises(EngineError) as e:
        eng.load_weights()
    assert e.value.reason == "server_command_not_found"
    assert "no-such-model-server" in e.value.message
    eng.close()


def test_port_in_use_is_named_and_nothing_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        eng = openai_engine(_cfg(tmp_path), server_command=[sys.executable, "-c", HEALTH_SERVER, "--port", str(port)],
                           base_env=dict(os.environ, STATE_DIR=str(tmp_path)))
        with pytest.raises(EngineError) as e:
            eng.load_weights()
        assert e.value.reason == "port_in_use" and str(port) in e.value.message
        assert _pids(tmp_path) == []      # refused before starting anything
        eng.close()


def test_no_command_and_no_url_is_a_named_error(tmp_path):
    with pytest.raises(EngineError) as e:
        openai_engine(_cfg(tmp_path))
    assert e.value.reason == "server_command_missing"


def test_server_dies_with_the_agent_even_on_sigkill(tmp_path):
    """PR_SET_PDEATHSIG: an agent killed -9 cannot run stop(), yet its server goes."""
    port = free_port()
    agent = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from warmup_agent.server.supervisor import Supervisor
        Supervisor([sys.executable, "-c", {HEALTH_SERVER!r}, "--port", "{port}"], "http://127.0.0.1:{port}/health",
                   env=dict(os.environ, STATE_DIR={str(tmp_path)!r}), port={port}).start()
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        server = _pids(tmp_path)[0]
        assert _alive(server)
        proc.kill()
        proc.wait()
        wait_until(lambda: not _alive(server), 10, what="server killed with its parent")
    finally:
        proc.kill()
        for p in _pids(tmp_path):       # the grandchild `sleep` is the server's, not ours to
            if _alive(p):               # rely on: clean up so the suite leaves nothing behind
                os.kill(p, signal.SIGKILL)


def test_vllm_serve_is_rewritten_to_the_server_module():
    cmd = fix_command(["vllm", "serve", "/models/x", "--port", "8001"])
    assert cmd[1:4] == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]
    assert cmd[4] == "/models/x" and option(cmd, "--port") == "8001"
    assert fix_command(["python", "-m", "x"]) == ["python", "-m", "x"]
