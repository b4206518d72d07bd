"""`warmup-agent run --engine openai -- <server command>` end to end through the CLI:
the agent starts the real CPU vLLM server, warms it, reaches SERVING, and leaves
no process behind; a server command that cannot start is exit code 3 with a reason."""
import json

import psutil
import pytest

from tests.conftest import run_agent
from tests.helpers.servers import free_port
from tests.helpers.vllm_server import server_command, server_env
from tests.helpers.warmup_record import requests_in_record


def outside_chat(port: int, model: str) -> str:
    """A user's streamed, sampled chat request straight to the server; its text."""
    import urllib.request
    body = {"model": model, "messages": [{"role": "user", "content": "Is the server warm yet?"}],
            "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        lines = [l[5:] for l in r.read().splitlines() if l.startswith(b"data:") and b"[DONE]" not in l]
    return "".join((c.get("delta") or {}).get("content") or "" for l in lines for c in json.loads(l).get("choices", []))


def no_orphans(marker: str) -> list:
    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if marker in " ".join(p.info["cmdline"] or [])]


def test_supervised_vllm_server_reaches_serving_and_exits_clean(tmp_path, embedded_model, data_dir):
    port = free_port()
    rec = tmp_path / "run.json"
    env = server_env(str(tmp_path))
    # every path before SERVING (--once ends there; the default warms the others behind the users)
    env.update(WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[16, 64]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1, 2]",
               WARMUP_AGENT_PREWARM_BEHIND_USERS="false")
    r = run_agent("run", "--once", "--no-progress", "--engine", "openai", "--data-dir", data_dir,
                  "--listen", "127.0.0.1:0", "--record", str(rec), "--", *server_command(embedded_model, port),
                  env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(rec.read_text())
    assert record["final_state"] == "SERVING" and record["engine"] == "openai"
    assert [t["state"] for t in record["transitions"]] == ["INIT", "PRELOAD", "PRIME", "SERVING"]
    # warmed by measured benefit: what the record lists is what was sent, and both APIs
    # and both families were warmed
    prewarm = next(s for s in record["stages"] if s["name"] == "prewarm")
    ready = next(s for s in record["stages"] if s["name"] == "ready")
    assert record["warmup_requests"] == requests_in_record(prewarm, ready)
    assert {p["path"].rsplit("/", 2)[0] for p in prewarm["paths"] if p["calls"]} >= {
        "chat/sampled", "chat/greedy", "completions/sampled", "completions/greedy"}
    assert record["traffic_profile"]["capabilities"]["token_id_prompts"] is True
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

    from tests.conftest import ROOT, agent_cmd
    from tests.helpers.servers import http_get, wait_until
    port, listen = free_port(), free_port()
    env = server_env(str(tmp_path))
    env = {k: v for k, v in env.items() if not k.startswith("WARMUP_AGENT_")}
    # No probes after SERVING (watch interval 0): readiness can then drop only because the
    # supervisor saw the server exit, not at a later probe, however slow the machine.
    env.update(WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[16]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]",
               WARMUP_AGENT_OPENAI_RESTART_BACKOFF_INITIAL_SECONDS="0.2",
               WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS="0")
    log = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--data-dir", data_dir,
                                       "--listen", f"127.0.0.1:{listen}", "--", *server_command(embedded_model, port)),
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"
    try:
        wait_until(lambda: http_get(url + "/readyz")[0] == 200, 300, what="SERVING")
        assert outside_chat(port, "tiny")             # a user's first chat request is answered
        server = [p for p in psutil.Process(agent.pid).children(recursive=True)
                  if f"--port {port}" in " ".join(p.cmdline())][0]
        server.send_signal(signal.SIGKILL)
        wait_until(lambda: http_get(url + "/readyz")[0] == 503, 60, interval=0.05,
                   what="readiness drops when the server exits (no probe runs after SERVING)")
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


def test_supervised_transformers_serve_reaches_serving_and_answers_an_outside_chat(tmp_path, embedded_model, data_dir):
    """`warmup-agent run --engine openai --model DIR -- transformers serve DIR`: the
    command the issue saw fail with no_model_served now warms and serves."""
    import signal

    import pytest

    from tests.helpers import transformers_server as ts
    from tests.helpers.servers import http_get, wait_until
    if not ts.available():
        pytest.skip("needs transformers[serving] (make test-setup)")
    port, listen = free_port(), free_port()
    rec = tmp_path / "run.json"
    agent = ts.start_agent(str(tmp_path), embedded_model, data_dir, port, listen, str(rec))
    url = f"http://127.0.0.1:{listen}"
    try:
        wait_until(lambda: http_get(url + "/readyz")[0] == 200 or agent.poll() is not None, 300, what="SERVING")
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
        assert outside_chat(port, embedded_model)
        _, text = http_get(url + "/metrics")
        assert 'warmup_time_per_output_token_window_seconds{percentile="p90"}' in text
        assert "warmup_first_request_total_tax_ratio " in text
    finally:
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(60)
    assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]
    record = json.loads(rec.read_text())
    assert [t["state"] for t in record["transitions"]][:4] == ["INIT", "PRELOAD", "PRIME", "SERVING"]
    prewarm = next(s for s in record["stages"] if s["name"] == "prewarm")
    ready = next(s for s in record["stages"] if s["name"] == "ready")
    assert record["warmup_requests"] == requests_in_record(prewarm, ready) > 0
    assert record["traffic_profile"]["capabilities"]["apis"] == ["chat", "completions"]
    # spawned by cli.main before the agent's imports (server/early_spawn.py) and adopted
    spawn = record["engine_facts"]["extra"]["server_spawn"]
    assert spawn["early"] is True and spawn["early_replaced_because"] is None, spawn
    assert 0 < spawn["after_process_start_seconds"] < record["startup_seconds"], (spawn, record["startup_seconds"])
    assert not no_orphans(f"--port {port}")


def _static_server(tmp_path, files: dict[str, str]):
    """A real HTTP server (python -m http.server) that answers GETs of these files
    and nothing else: POSTs get 501."""
    import subprocess
    import sys

    from tests.helpers.servers import http_get, wait_until
    root = tmp_path / "www"
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, 30, what="static server")
    return proc, port


def test_server_answering_none_of_the_apis_is_exit_3_with_its_reason(tmp_path, embedded_model, data_dir):
    proc, port = _static_server(tmp_path, {"health": "ok"})
    rec = tmp_path / "run.json"
    try:
        r = run_agent("run", "--once", "--no-progress", "--engine", "openai", "--model", embedded_model,
                      "--data-dir", data_dir, "--listen", "127.0.0.1:0", "--record", str(rec),
                      env={"WARMUP_AGENT_OPENAI_URL": f"http://127.0.0.1:{port}", "WARMUP_AGENT_OPENAI_MODEL": "m"},
                      timeout=120)
    finally:
        proc.terminate()
        proc.wait(10)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    record = json.loads(rec.read_text())
    assert record["final_state"] == "FAILED" and record["failure_reason"] == "no_openai_api"
    assert "/v1/chat/completions: HTTP 501" in record["failure_message"] and "/v1/completions: HTTP 501" in record["failure_message"]


def test_no_model_name_anywhere_is_exit_3_naming_the_key(tmp_path, data_dir):
    proc, port = _static_server(tmp_path, {"health": "ok", "v1/models": json.dumps({"object": "list", "data": []})})
    rec = tmp_path / "run.json"
    try:
        r = run_agent("run", "--once", "--no-progress", "--engine", "openai", "--data-dir", data_dir,
                      "--listen", "127.0.0.1:0", "--record", str(rec),
                      env={"WARMUP_AGENT_OPENAI_URL": f"http://127.0.0.1:{port}"}, timeout=120)
    finally:
        proc.terminate()
        proc.wait(10)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    record = json.loads(rec.read_text())
    assert record["failure_reason"] == "no_model_name"
    assert "openai.model" in record["failure_message"] and "\n" not in record["failure_message"]
