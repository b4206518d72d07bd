"""`warmup-agent run --proxy-listen` with the default torch engine serves users from
the embedded model (issue 41): the official `openai` client gets a 503 with
Retry-After while the agent warms, and answers, streamed and not, once it is
SERVING.  One real agent process for the module."""
from __future__ import annotations

import json
import os
import subprocess
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
    warming: list = []       # what a user got before SERVING
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = http_get(f"http://127.0.0.1:{port}/readyz", timeout=2)[0] == 200
            except OSError:
                ready = False
            if ready:
                break
            if not warming:
                try:
                    c.chat.completions.create(model="embedded-llama-v1", messages=MESSAGES, max_tokens=2)
                except openai.APIStatusError as e:
                    warming.append(e)
                except openai.APIConnectionError:
                    pass             # the proxy is not listening yet
            time.sleep(0.05)
        assert ready, "never SERVING:\n" + (tmp / "stderr").read_text()[-3000:]
        scrape = http_get(f"http://127.0.0.1:{port}/metrics", timeout=5)[1]
        deadline = time.monotonic() + 30
        while not record.exists() and time.monotonic() < deadline:     # written once SERVING
            time.sleep(0.05)
        yield {"client": c, "warming": warming, "stderr": tmp / "stderr", "proc": proc, "record": record,
               "scrape_at_ready": scrape}
    finally:
        stop_process(proc, timeout=30)
        err.close()


def test_before_serving_a_user_gets_503_with_retry_after(agent):
    assert agent["warming"], "no request reached the proxy before SERVING"
    e = agent["warming"][0]
    assert e.status_code == 503 and int(e.response.headers["retry-after"]) >= 1


def test_one_request_ran_the_users_path_before_serving_and_counted_as_no_user(agent):
    """Before SERVING the ready stage sends one streamed chat request through the proxy's
    own listener, marked as warmup (proxy/user_path.py): the users' first request then
    finds the path from the listener to the model warm.  It is in the record, and the
    proxy counted no user request for it (the only user request before SERVING was the
    one answered 503)."""
    record = json.loads(agent["record"].read_text())
    sent = next(s for s in record["stages"] if s["name"] == "ready")["user_path_request"]
    assert sent["chunks"] >= 2 and 0 < sent["first_byte_seconds"] <= sent["seconds"]
    users = [line for line in agent["scrape_at_ready"].splitlines() if line.startswith("warmup_proxy_requests_total{")]
    assert not [line for line in users if 'route="main"' in line and not line.endswith(" 0.0")], users


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
