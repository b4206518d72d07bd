"""A user who arrives the moment the pod starts (issue 71): scale from zero, nobody else
serves them.  Real processes: `warmup-agent run --proxy-listen ... -- SERVER` with the
CPU llama-server and the CPU vLLM, and the official `openai` client with its default
settings (2 retries, backoff 0.5-8 s).

The client is sent as soon as the proxy's address accepts a connection (bound at the
early spawn, before the agent's imports: server/listener.py), and it must get its answer
with no retry: the proxy holds it until the gate opens, where it used to answer 503 and
make the client wait out its backoff (5.5 s on a pod ready in about 1 s).  The same client
against the server alone, sent at its spawn, is the figure it is printed beside.

Then `warmup-agent bench --conditions spawn-alone,spawn-agent` on the llama-server:
the user at the spawn meets no 503 through the agent, and the bench's JSON has the
figures of issue 71 (spawn_arrival_agent_over_alone, spawn_arrival_503).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import openai
import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers import llamacpp_server as ls
from tests.helpers import vllm_server
from tests.helpers.servers import free_port, stop_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MESSAGES = [{"role": "user", "content": "Are you there yet?"}]


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def user_at_spawn(proc: subprocess.Popen, port: int, model: str, spawned: float, log) -> dict:
    """The official client, default settings, sent once `port` listens: its answer, the
    retries it took and the seconds from the spawn."""
    while not accepts(port):
        assert proc.poll() is None, f"exited {proc.returncode} before listening:\n{open(log.name).read()[-3000:]}"
        assert time.monotonic() - spawned < 120, "never listened"
        time.sleep(0.005)
    sent = time.monotonic() - spawned
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")   # the defaults
    raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=4)
    answer = raw.parse()
    return {"seconds": time.monotonic() - spawned, "sent": sent, "retries": raw.retries_taken,
            "role": answer.choices[0].message.role}


def servers(tmp_path, kind, llama_server=None, gguf=None, model_dir=None):
    port = free_port()
    if kind == "llama":
        return ls.server_command(llama_server, gguf, port), ls.server_env(str(tmp_path)), port, "embedded"
    return (vllm_server.server_command(model_dir, port), vllm_server.server_env(str(tmp_path)), port,
            vllm_server.SERVED_NAME)


def run_case(tmp_path, kind, command, env, port, model, embedded_model, data_dir) -> dict:
    env = {k: v for k, v in env.items() if not k.startswith("WARMUP_AGENT_")}
    out: dict = {}
    # alone: the same client at the server's spawn
    with open(tmp_path / f"{kind}-alone.log", "w") as log:
        spawned = time.monotonic()
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out["alone"] = user_at_spawn(server, port, model, spawned, log)
        finally:
            stop_process(server, 30)
    # under the agent, through its proxy
    proxy = free_port()
    with open(tmp_path / f"{kind}-agent.log", "w") as log:
        spawned = time.monotonic()
        agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                           "--data-dir", data_dir, "--listen", f"127.0.0.1:{free_port()}",
                                           "--proxy-listen", f"127.0.0.1:{proxy}", "--", *command),
                                 cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out["agent"] = user_at_spawn(agent, proxy, model, spawned, log)
        finally:
            stop_process(agent, 60)
    # the agent's own lines (the server's, relayed, may hold its own shutdown traceback: vLLM's does)
    ours = [ln for ln in (tmp_path / f"{kind}-agent.log").read_text().splitlines() if "warmup_agent.server:" not in ln]
    assert not any("Traceback" in ln for ln in ours), "\n".join(ours[-40:])
    print(f"{kind}: a user at the spawn answered after {out['alone']['seconds']:.2f} s alone "
          f"({out['alone']['retries']} retries), {out['agent']['seconds']:.2f} s through the agent's proxy "
          f"(sent {out['agent']['sent']:.2f} s after the spawn, {out['agent']['retries']} retries)")
    return out


def test_the_official_client_at_the_spawn_is_answered_with_no_retry_llama(tmp_path, embedded_model, data_dir,
                                                                          llama_server, gguf):
    command, env, port, model = servers(tmp_path, "llama", llama_server, gguf)
    out = run_case(tmp_path, "llama", command, env, port, model, embedded_model, data_dir)
    assert out["agent"]["retries"] == 0 and out["agent"]["role"] == "assistant", out


def test_the_official_client_at_the_spawn_is_answered_with_no_retry_vllm(tmp_path, embedded_model, data_dir):
    model_dir = vllm_server.tiny_model(data_dir)
    command, env, port, model = servers(tmp_path, "vllm", model_dir=model_dir)
    out = run_case(tmp_path, "vllm", command, env, port, model, embedded_model, data_dir)
    # vLLM takes tens of seconds to start here: two retries would not have covered it
    assert out["agent"]["retries"] == 0 and out["agent"]["role"] == "assistant", out


def test_the_bench_measures_a_user_at_the_spawn(tmp_path, embedded_model, data_dir, llama_server, gguf):
    out = tmp_path / "bench"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    r = subprocess.run([sys.executable, "-m", "warmup_agent", "bench", "--no-progress", "--starts", "2",
                        "--conditions", "spawn-alone,spawn-agent", "--seed", "71", "--max-context", "512", "--out", str(out),
                        "--agent-model", embedded_model, "--",
                        *ls.server_command(llama_server, gguf, 0)[:-2], "--port", "{port}"],
                       cwd=ROOT, env=dict(env, **ls.server_env(str(tmp_path))), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    arrival = result["spawn_arrival"]
    print(f"bench: {arrival}")
    assert arrival["spawn_arrival_503"] == 0
    assert arrival["spawn_arrival_agent_over_alone"] > 0
    for rec in result["starts"]:
        assert rec["spawn_arrival"]["seconds"] >= rec["spawn_arrival"]["ttft_seconds"] > 0
        assert rec["ready_seconds"] > 0 and rec["sigterm"]["orphans"] == 0
