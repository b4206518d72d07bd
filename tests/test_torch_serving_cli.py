"""`warmup-agent run --proxy-listen` with the default torch engine serves users from
the embedded model (issue 41): the official `openai` client, sent while the agent
warms, is held by the proxy and answered once the agent is SERVING, with no retry
(issue 71); then answers, streamed and not.  One real agent process for the module."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import openai
import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers.servers import free_port, http_get, stop_process

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def agent(tmp_path_factory, embedded_model, data_dir):
    tmp = tmp_path_factory.mktemp("torch-serving-cli")
    port, proxy_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    err = open(tmp / "stderr", "w")
    record = tmp / "run.json"
    proc = subprocess.Popen(agent_cmd("run", "--no-progress", "--data-dir", data_dir, "--listen", f"127.0.0.1:{port}",
                                      "--proxy-listen", f"127.0.0.1:{proxy_port}", "--record", str(record)),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="unused", max_retries=0, timeout=60)
    held: dict = {}          # what a user sent while the agent warms got, and when

    def user_while_warming() -> None:
        while proc.poll() is None:
            try:
                held["answer"] = c.chat.completions.create(model="embedded-llama-v1", messages=MESSAGES, max_tokens=2)
                held["at"] = time.monotonic()
                return
            except openai.APIConnectionError:
                time.sleep(0.05)     # the proxy is not listening yet: not a refusal
            except openai.APIStatusError as e:
                held["error"] = e
                return
    user = threading.Thread(target=user_while_warming, daemon=True)
    try:
        user.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = http_get(f"http://127.0.0.1:{port}/readyz", timeout=2)[0] == 200
            except OSError:
                ready = False
            if ready:
                held["ready_at"] = time.monotonic()
                break
            time.sleep(0.05)
        assert ready, "never SERVING:\n" + (tmp / "stderr").read_text()[-3000:]
        scrape = http_get(f"http://127.0.0.1:{port}/metrics", timeout=5)[1]
        deadline = time.monotonic() + 30
        while not record.exists() and time.monotonic() < deadline:     # written once SERVING
            time.sleep(0.05)
        user.join(60)
        yield {"client": c, "held": held, "url": f"http://127.0.0.1:{port}", "stderr": tmp / "stderr", "proc": proc, "record": record,
               "scrape_at_ready": scrape}
    finally:
        stop_process(proc, timeout=30)
        err.close()


def test_a_user_who_arrives_while_warming_is_held_and_answered_at_serving(agent):
    held = agent["held"]
    assert "error" not in held, f"refused while warming: {held.get('error')}"
    assert held["answer"].choices[0].message.role == "assistant"
    # answered once the gate opened: at most a scrape's poll before /readyz was seen 200
    assert held["at"] >= held["ready_at"] - 0.5, (held["at"], held["ready_at"])
    scrape = http_get(agent["url"] + "/metrics", timeout=5)[1]
    served = [line for line in scrape.splitlines() if line.startswith('warmup_proxy_held_requests_total{outcome="served"}')]
    assert served and float(served[0].split()[-1]) >= 1, served


def test_one_request_ran_the_users_path_before_serving_and_counted_as_no_user(agent):
    """Before SERVING the ready stage sends one streamed chat request through the proxy's
    own listener, marked as warmup (proxy/user_path.py): the users' first request then
    finds the path from the listener to the model warm.  It is in the record, and the
    proxy counted no user request for it (the only user request before SERVING was
    the one it held, answered at SERVING)."""
    record = json.loads(agent["record"].read_text())
    sent = next(s for s in record["stages"] if s["name"] == "ready")["user_path_request"]
    assert sent["chunks"] >= 2 and 0 < sent["first_byte_seconds"] <= sent["seconds"]
    users = [line for line in agent["scrape_at_ready"].splitlines() if line.startswith("warmup_proxy_requests_total{")]
    main = [float(line.split()[-1]) for line in users if 'route="main"' in line]
    assert sum(main) <= 1, users


def test_after_serving_the_openai_client_gets_answers_streamed_and_not(agent):
    c = agent["client"]
    assert [m.id for m in c.models.list()] == ["embedded-llama-v1"]
    chat = c.chat.completions.create(model="embedded-llama-v1", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert (choice.finish_reason, chat.usage.completion_tokens) == ("length", 8) or choice.finish_reason == "stop"
    stream = c.chat.completions.create(model="embedded-llama-v1", messages=MESSAGES, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == choice.message.content
    assert chunks[-1].usage.model_dump() == chat.usage.model_dump()
    done = c.completions.create(model="embedded-llama-v1", prompt="hello", max_tokens=3, seed=5, temperature=1.0)
    again = c.completions.create(model="embedded-llama-v1", prompt="hello", max_tokens=3, seed=5, temperature=1.0)
    assert done.choices[0].text == again.choices[0].text


def test_a_bad_request_gets_an_openai_400(agent):
    with pytest.raises(openai.BadRequestError) as e:
        agent["client"].chat.completions.create(model="embedded-llama-v1", messages=[], max_tokens=2)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == "messages"
