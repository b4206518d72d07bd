"""The agent learns what its users send through its proxy (issue 72), end to end: a real
`warmup-agent run --proxy-listen ... -- llama-server` (CPU), users' chats with a marker in
their text, SIGTERM, and a second start with the same data dir.

No text reaches the disk, the metrics or the logs (grep for the marker: 0 hits); the
profile is in the data dir, reloaded at the next start and exported."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers import llamacpp_server as ls
from tests.helpers.servers import free_port, http_get, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MARKER = "walrus-indigo-5521"


def metric(url: str, name: str) -> float | None:
    for line in http_get(url + "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def chat(proxy: int, words: int, stream: bool) -> None:
    body = {"model": "m", "max_tokens": 8, "temperature": 0.7, "stream": stream,
            "messages": [{"role": "user", "content": " ".join([MARKER] * words)}]}
    req = urllib.request.Request(f"http://127.0.0.1:{proxy}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        r.read()


def start(tmp_path, name, data, embedded_model, command, env):
    listen, proxy = free_port(), free_port()
    record = tmp_path / f"{name}.record.json"
    log = open(tmp_path / f"{name}.log", "w")
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                       "--data-dir", str(data), "--listen", f"127.0.0.1:{listen}",
                                       "--proxy-listen", f"127.0.0.1:{proxy}", "--record", str(record), "--", *command),
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"
    wait_until(lambda: agent.poll() is not None or http_get(url + "/readyz")[0] == 200, 300, what="SERVING")
    assert agent.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
    return agent, url, proxy, log


def test_users_shapes_are_learned_kept_and_never_their_text(tmp_path, embedded_model, llama_server, gguf):
    data = tmp_path / "data"
    env = ls.server_env(str(tmp_path))
    command = ls.server_command(llama_server, gguf, free_port())
    agent, url, proxy, log = start(tmp_path, "first", data, embedded_model, command, env)
    scrapes = []
    try:
        for i in range(12):
            chat(proxy, 60 if i % 3 else 12, stream=bool(i % 2))
        wait_until(lambda: (metric(url, "warmup_learned_profile_requests") or 0) >= 12, 10, interval=0.05,
                   what="the users' requests, learned")
        scrapes.append(http_get(url + "/metrics")[1])
        assert metric(url, "warmup_learned_profile_shapes") >= 2
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
        log.close()
    files = [os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs]
    learned = [f for f in files if f.endswith("learned_profile.json")]
    assert len(learned) == 1, files
    kept = json.load(open(learned[0]))
    assert kept["seen"] == 12
    # a streamed answer without usage (llama-server's default) counts the prompt as the server
    # did (its timings), as an answer with usage does: the same lengths, not an estimate
    streamed = sorted({key[4] for key, _ in kept["bins"] if key[3]})
    assert streamed == sorted({key[4] for key, _ in kept["bins"] if not key[3]}), kept["bins"]

    # a new start with the same data dir warms what they sent: the profile is there at once
    agent, url, proxy, log = start(tmp_path, "second", data, embedded_model, command, env)
    try:
        assert metric(url, "warmup_learned_profile_requests") >= 11      # decayed a little, never lost
        wait_until(lambda: (tmp_path / "second.record.json").exists(), 30, what="the run record")
        record = json.loads((tmp_path / "second.record.json").read_text())
        profile = next(s for s in record["stages"] if s["name"] == "prewarm")["profile"]
        assert profile["source"].startswith("learned from 12 user request(s)"), profile
        # the users' two lengths (about 12 and 60 words), as the server counted them
        first = json.loads((tmp_path / "first.record.json").read_text())
        assert max(profile["prompt_lengths"]) > max(next(s for s in first["stages"] if s["name"] == "prewarm")
                                                    ["profile"]["prompt_lengths"] or [0])
        scrapes.append(http_get(url + "/metrics")[1])
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
        log.close()

    # never the text: not on disk, in the metrics or in the logs
    hits = [f for f in files if MARKER.encode() in open(f, "rb").read()]
    assert hits == [], hits
    assert not any(MARKER in s for s in scrapes)
    for name in ("first", "second"):
        assert MARKER not in (tmp_path / f"{name}.log").read_text()
