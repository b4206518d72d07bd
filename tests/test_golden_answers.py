"""The same answers after a restart (issue 72, readiness/golden.py), with real processes:
llama.cpp's `llama-server` (CPU) beside `warmup-agent run` (sidecar: openai.url).

The server is killed and started again on the same port, under the same served name
(`--alias`): with the same GGUF the agent re-warms it and is SERVING again, its golden
check taking a few tens of milliseconds; with another GGUF (the embedded model with its
weights changed) the agent never returns to SERVING and names the reason."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess

import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers import llamacpp_server as ls
from tests.helpers.servers import free_port, http_get, stop_process, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ALIAS = "the-model"


def other_model(embedded_model: str, out) -> str:
    """The embedded model with different weights (the same shapes, names, tokenizer)."""
    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(embedded_model, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        gen = torch.Generator().manual_seed(72)
        changed = {k: (t + 0.5 * torch.randn(t.shape, generator=gen).to(t.dtype)) if t.dim() == 2 else t
                   for k, t in tensors.items()}
        save_file(changed, str(f), metadata={"format": "pt"})
    (out / ".complete").unlink(missing_ok=True)
    return ls.ensure_gguf(str(out))


def state(url: str) -> str:
    return json.loads(http_get(url + "/startupz")[1])["state"]


def failures(url: str, reason: str) -> float:
    m = re.search(rf'^model_loading_failures_total{{reason="{reason}"}} ([0-9.e+-]+)$', http_get(url + "/metrics")[1],
                  re.M)
    return float(m.group(1)) if m else float("nan")


def test_a_restart_must_answer_as_the_warmed_model(tmp_path, embedded_model, data_dir, llama_server, gguf):
    port, listen = free_port(), free_port()
    server_url = f"http://127.0.0.1:{port}"
    env = ls.server_env(str(tmp_path))
    other = other_model(embedded_model, tmp_path / "other-model")

    def serve(model_gguf: str, name: str) -> subprocess.Popen:
        proc = subprocess.Popen(ls.server_command(llama_server, model_gguf, port, extra=("--alias", ALIAS)), env=env,
                                stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT)
        wait_until(lambda: http_get(server_url + "/health", timeout=1)[0] == 200, 120, what=f"{name} /health")
        return proc

    server = serve(gguf, "server-1")
    agent_env = dict(env, WARMUP_AGENT_OPENAI_URL=server_url, WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[24]",
                     WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]", WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS="0.5")
    log = tmp_path / "agent.log"
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                       "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}"),
                             cwd=ROOT, env=agent_env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"
    try:
        wait_until(lambda: agent.poll() is not None or state(url) == "SERVING", 300, what="SERVING")
        assert agent.poll() is None, log.read_text()[-3000:]
        wait_until(lambda: "golden answers recorded" in log.read_text(), 30, what="the warmed model's answers")

        # the same GGUF again: re-warmed, the same answers, SERVING
        server.kill()
        server.wait()
        server = serve(gguf, "server-2")
        wait_until(lambda: "golden answers checked" in log.read_text(), 30, what="the golden check")
        wait_until(lambda: state(url) == "SERVING", 120, what="SERVING after the restart")
        took = [float(ms) for ms in re.findall(r"golden answers checked in (\d+) ms: as warmed", log.read_text())]
        print(f"golden check after a restart with the same model: {took} ms")
        assert took and max(took) <= 200, log.read_text()[-3000:]

        # another GGUF under the same name and port: never SERVING again, the reason named
        server.kill()
        server.wait()
        server = serve(other, "server-3")
        wait_until(lambda: state(url) == "FAILED", 120, what="FAILED on other answers")
        assert failures(url, "wrong_answer_after_restart") == 1
        assert http_get(url + "/readyz")[0] == 503
        text = log.read_text()
        assert "wrong_answer_after_restart" in text and "Traceback" not in text, text[-3000:]
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(60)
            except subprocess.TimeoutExpired:
                agent.kill()
        stop_process(server, 10)
