"""Users held at a first start go to the server before SERVING where the warm-up can spare
them nothing more (issue 71: "serve them as soon as a request of their shape would be
answered warm; the rest of the warm-up continues after them").

On a server remembered to pay once at each new prompt length and not per decode length
(llama.cpp's finding), discovery's first request paid the start's one-time cost and no
warm-up request makes a user's own length warm.  Real processes: `warmup-agent run
--proxy-listen ... -- llama-server` (CPU), a user sent the moment the proxy's address
accepts, /readyz polled every 5 ms.  The finding is written with the agent's own
`findings.Findings` under the key the agent computes for this server.
"""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.request

import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers import llamacpp_server as ls
from tests.helpers.servers import free_port, http_get, stop_process
from tests.test_user_at_spawn import accepts
from warmup_agent.warmup import findings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def first_token_here(tmp_path, llama_server, gguf) -> float:
    """This machine's time to a first token of a fresh ~60-token chat prompt (median of
    three after a first), so that the finding's kept time agrees with the agent's lone
    probe (findings.still_holds) on a fast machine and a slow one alike."""
    port = free_port()
    server = subprocess.Popen(ls.server_command(llama_server, gguf, port), env=ls.server_env(str(tmp_path)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    times = []
    try:
        deadline = time.monotonic() + 60
        while not accepts(port) or http_get(f"http://127.0.0.1:{port}/health", timeout=1)[0] != 200:
            assert time.monotonic() < deadline, "llama-server never answered /health"
            time.sleep(0.02)
        for i in range(4):
            body = json.dumps({"model": "m", "max_tokens": 1, "messages": [
                {"role": "user", "content": f"{i}. " + "users wait for the first answer of a cold server " * 6}]})
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
            times.append(time.monotonic() - t0)
    finally:
        stop_process(server, 30)
    return sorted(times[1:])[1]


def remember_llamacpp_finding(data_dir: str, gguf: str, first_ttft: float) -> None:
    """What two probe pairs measured on an earlier start: each new length paid in prefill."""
    key = findings.server_key("llamacpp", gguf, 4, [], {})
    outcome = {"pays": False, "prefill_pays_each_new_length": True,
               findings.EXCESS: {"ttft": 0.4, "total": 0.2, findings.FIRST_TTFT: first_ttft}}
    findings.Findings(data_dir).put(key, outcome, {"server": "llamacpp", "model": gguf})


def start_with_a_held_user(tmp_path, name, llama_server, gguf, embedded_model, data_dir) -> dict:
    port, proxy, listen = free_port(), free_port(), free_port()
    env = ls.server_env(str(tmp_path))
    log_path = tmp_path / f"{name}.log"
    out: dict = {}
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                           "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}",
                                           "--proxy-listen", f"127.0.0.1:{proxy}", "--",
                                           *ls.server_command(llama_server, gguf, port)),
                                 cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def user() -> None:
            while not accepts(proxy):
                time.sleep(0.005)
            body = json.dumps({"model": "embedded",
                               "messages": [{"role": "user", "content": "Are you there yet?"}], "max_tokens": 24}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{proxy}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                out["status"] = r.status
                r.read()
            out["answered"] = time.monotonic() - t0
        thread = threading.Thread(target=user, daemon=True)
        thread.start()
        try:
            while time.monotonic() - t0 < 120 and agent.poll() is None:
                try:
                    if http_get(f"http://127.0.0.1:{listen}/readyz", timeout=1)[0] == 200:
                        out["ready"] = time.monotonic() - t0
                        break
                except OSError:
                    pass
                time.sleep(0.005)
            thread.join(60)
        finally:
            stop_process(agent, 60)
    out["log"] = log_path.read_text()
    assert "ready" in out and out.get("status") == 200, out["log"][-3000:]
    return out


def test_a_held_user_is_answered_before_serving_where_the_warm_up_spares_them_nothing(
        tmp_path, llama_server, gguf, embedded_model):
    data_dir = str(tmp_path / "data")
    here = first_token_here(tmp_path, llama_server, gguf)
    # the agent's lone probe (streamed, a shorter prompt) read 0.5-0.7 of `here`: half of it
    # puts the probe near the middle of the 0.5-3x band the finding is checked against
    remember_llamacpp_finding(data_dir, gguf, here / 2)
    out = start_with_a_held_user(tmp_path, "remembered", llama_server, gguf, embedded_model, data_dir)
    assert "held: let in before SERVING" in out["log"], out["log"][-3000:]
    assert out["answered"] < out["ready"], out      # answered before the gate opened
    # ... alone on the server: the first task after the let-in is the user's (the agent's
    # next request waits for it), and no other starts before it is released
    lines = out["log"].splitlines()
    after = lines[next(i for i, ln in enumerate(lines) if "let in before SERVING" in ln):]
    launches = [i for i, ln in enumerate(after) if "launch_slot_" in ln]
    task = re.search(r"\| task (\d+) \|", after[launches[0]]).group(1)
    released = next(i for i, ln in enumerate(after) if "release:" in ln and f"| task {task} |" in ln)
    assert len(launches) > 1 and launches[1] > released, "\n".join(after[:40])
    print(f"a held user answered {out['answered']:.3f} s after the spawn, /readyz 200 at {out['ready']:.3f} s "
          f"(a first token here: {here * 1e3:.1f} ms)")


def test_without_the_finding_a_held_user_waits_for_the_gate(tmp_path, llama_server, gguf, embedded_model):
    out = start_with_a_held_user(tmp_path, "fresh", llama_server, gguf, embedded_model, str(tmp_path / "data"))
    assert "let in before SERVING" not in out["log"]
    assert out["answered"] > out["ready"] - 0.005, out     # held until SERVING (the poll is 5 ms)
