"""The torch engine's users' path over HTTP: the routing proxy (proxy.py) in front of the
in-process backend (engines/torch/serving.py), asked by the official `openai` client.

The proxy and the loaded embedded model run in this process, so the tests read the
backend's own counters: two requests sent at once ran as one batch, and a client
that hung up mid-stream freed its row.  The whole agent through the CLI:
tests/test_torch_serving_cli.py.
"""
from __future__ import annotations

import threading
import time

import openai
import pytest

from exporter.metrics import AgentMetrics
from warmup_agent import config
from warmup_agent.pipeline import Agent
from warmup_agent.proxy import RoutingProxy
from warmup_agent.states import State


@pytest.fixture(scope="module")
def engine(embedded_model):
    from warmup_agent.engines.torch.engine import TorchEngine
    e = TorchEngine(embedded_model, device="cpu")
    e.load_weights()
    e.load_tokenizer()
    e.solidify([(16, 1), (16, 2), (16, 4)])
    yield e
    e.close()


@pytest.fixture(scope="module")
def served(engine):
    """(agent, proxy, backend): an agent walked to SERVING, its proxy in front of the engine's backend."""
    agent = Agent(config.load(env={}), engine, metrics=AgentMetrics())
    for s in (State.PRELOAD, State.PRIME, State.SERVING):
        assert agent.sm.transition(s)
    backend = engine.openai_backend()
    proxy = RoutingProxy(agent, backend, retry_after_seconds=7).start()
    yield agent, proxy, backend
    proxy.stop()


def client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(batcher, timeout=30):
    deadline = time.monotonic() + timeout
    while not batcher.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.idle


def test_openai_client_chat_and_completions_streamed_and_not(served):
    _, proxy, _ = served
    c = client(proxy)
    assert [m.id for m in c.models.list()] == ["embedded-llama-v1"]
    chat = c.chat.completions.create(model="embedded-llama-v1", messages=[{"role": "user", "content": "hello"}],
                                     max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.completion_tokens <= 6 and chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    chunks = list(c.chat.completions.create(model="embedded-llama-v1", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.model_dump() == chat.usage.model_dump() and chunks[-1].choices == []
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == chat.choices[0].message.content
    text = c.completions.create(model="embedded-llama-v1", prompt="hello there", max_tokens=5, temperature=0)
    streamed = list(c.completions.create(model="embedded-llama-v1", prompt="hello there", max_tokens=5,
                                         temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == text.choices[0].text


def test_two_requests_at_once_are_one_batch(served):
    _, proxy, backend = served
    backend.batcher.window = 0.5          # two client threads on a busy 2-core machine: well inside it
    try:
        wait_idle(backend.batcher)
        before = backend.batcher.counters.batches
        results: list = []

        def ask(prompt):
            results.append(client(proxy).completions.create(model="embedded-llama-v1", prompt=prompt, max_tokens=4))
        threads = [threading.Thread(target=ask, args=(p,)) for p in ("hello there", "how are you today friend")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        wait_idle(backend.batcher)
    finally:
        backend.batcher.window = 0.003
    assert len(results) == 2 and all(r.choices[0].finish_reason in ("length", "stop") for r in results)
    assert backend.batcher.counters.batches == before + 1
    record = backend.batcher.counters.recent[-1]
    assert (record.size, record.padded) == (2, 2)


def test_a_client_that_hangs_up_mid_stream_frees_its_row(served):
    _, proxy, backend = served
    counters = backend.batcher.counters
    wait_idle(backend.batcher)
    cancelled = counters.cancelled
    stream = client(proxy).completions.create(model="embedded-llama-v1", prompt="hello", max_tokens=1500,
                                              temperature=0, stream=True)
    it = iter(stream)
    next(it)
    next(it)
    stream.close()                          # the client goes away
    deadline = time.monotonic() + 30
    while counters.cancelled == cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    wait_idle(backend.batcher)
    assert counters.cancelled == cancelled + 1 and counters.running == 0
    assert counters.recent[-1].cancelled == 1 and counters.recent[-1].steps < 1499
    # the engine is free for the next user
    again = client(proxy).completions.create(model="embedded-llama-v1", prompt="hello", max_tokens=2)
    assert again.usage.completion_tokens >= 1


def test_a_bad_request_is_an_openai_400(served):
    _, proxy, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client(proxy).chat.completions.create(model="embedded-llama-v1", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=100000)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client(proxy).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"


def test_before_serving_the_proxy_answers_503_with_retry_after_and_never_the_engine(engine):
    from warmup_agent.engines.torch.serving import TorchOpenAIBackend
    warming = Agent(config.load(env={}), engine, metrics=AgentMetrics())
    assert warming.sm.transition(State.PRELOAD)
    backend = TorchOpenAIBackend(engine, engine.lock, window=0.003)   # its own: stop() closes it
    proxy = RoutingProxy(warming, backend, retry_after_seconds=7).start()
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client(proxy).chat.completions.create(model="embedded-llama-v1", messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "7"
    finally:
        proxy.stop()
    assert backend.batcher.counters.requests == 0
