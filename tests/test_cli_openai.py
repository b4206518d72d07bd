"""`warmup-agent run --engine openai -- <server command>` end to end through the CLI:
the agent starts the real CPU vLLM server, warms it, reaches SERVING, and leaves
no process behind; a server command that cannot start is exit code 3 with a reason."""
import json

import psutil
import pytest

from tests.conftest import run_agent
from tests.servers import free_port
from tests.vllm_server import server_command, server_env


def no_orphans(marker: str) -> list:
    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if marker in " ".join(p.info["cmdline"] or [])]


def test_supervised_vllm_server_reaches_serving_and_exits_clean(tmp_path, embedded_model, data_dir):
    port = free_port()
    rec = tmp_path / "run.json"
    env = server_env(str(tmp_path))
    env.update(WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[16, 64]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1, 2]")
    r = run_agent("run", "--once", "--no-progress", "--engine", "openai", "--data-dir", data_dir,
                  "--listen", "127.0.0.1:0", "--record", str(rec), "--", *server_command(embedded_model, port),
                  env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(rec.read_text())
    assert record["final_state"] == "SERVING" and record["engine"] == "openai"
    assert [t["state"] for t in record["transitions"]] == ["INIT", "PRELOAD", "PRIME", "SERVING"]
    assert record["warmup_requests"] == 6  # grid [16, 64] x [1, 2]
    ours = [l for l in r.stderr.splitlines() if "warmup_agent.server:" not in l]  # the server's own log is relayed
    assert not any("Traceback" in l for l in ours)
    assert not no_orphans(f"--port {port}"), "the supervised server outlived the agent"


@pytest.mark.slow  # an agent process
def test_server_command_that_cannot_start_is_exit_3(tmp_path, data_dir):
    rec = tmp_path / "run.json"
    r = run_agent("run", "--once", "--no-progress", "--engine", "openai", "--data-dir", data_dir,
                  "--listen", "127.0.0.1:0", "--record", str(rec), "--", "/nonexistent/server", "--port", str(free_port()),
                  timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    record = json.loads(rec.read_text())
    assert record["final_state"] == "FAILED" and record["failure_reason"]
    errors = [l for l in r.stderr.splitlines() if " ERROR " in l]
    assert errors and record["failure_reason"] in errors[-1], r.stderr[-2000:]


def test_killed_server_drops_readiness_restarts_and_serves_again(tmp_path, embedded_model, data_dir):
    import signal
    import subprocess
    import time

    from tests.conftest import ROOT, agent_cmd
    from tests.servers import http_get, wait_until
    port, listen = free_port(), free_port()
    env = server_env(str(tmp_path))
    env = {k: v for k, v in env.items() if not k.startswith("WARMUP_AGENT_")}
    env.update(WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[16]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]",
               WARMUP_AGENT_OPENAI_RESTART_BACKOFF_INITIAL_SECONDS="0.2")
    log = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--data-dir", data_dir,
                                       "--listen", f"127.0.0.1:{listen}", "--", *server_command(embedded_model, port)),
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"
    try:
        wait_until(lambda: http_get(url + "/readyz")[0] == 200, 300, what="SERVING")
        server = [p for p in psutil.Process(agent.pid).children(recursive=True)
                  if f"--port {port}" in " ".join(p.cmdline())][0]
        killed_at = time.monotonic()
        server.send_signal(signal.SIGKILL)
        wait_until(lambda: http_get(url + "/readyz")[0] == 503, 10, interval=0.05, what="readiness drops")
        assert time.monotonic() - killed_at < 2.0, "readiness must drop at once, not at the next probe"
        status = json.loads(http_get(url + "/startupz")[1])
        assert status["state"] == "PRELOAD"
        wait_until(lambda: http_get(url + "/readyz")[0] == 200, 300, what="SERVING again after restart")
        _, text = http_get(url + "/metrics")
        assert 'model_loading_failures_total{reason="server_crashed"} 1.0' in text
        assert 'warmup_state_transitions_total{from="SERVING",to="PRELOAD"} 1.0' in text
    finally:
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(60)
    assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]
    assert not no_orphans(f"--port {port}")
