"""The torch engine's in-process OpenAI responder (engines/torch/serving.py) and its
batching scheduler (engines/torch/batcher.py), driven directly on the embedded
model on the CPU: `await backend.request(...)` as the routing proxy calls it.

Random weights give degenerate text, so the assertions are on structure, token
counts, repeatability and the scheduler's own counters; never on what the text says.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from warmup_agent.engines.torch.batcher import Detokenizer


@pytest.fixture(scope="module")
def engine(embedded_model):
    from warmup_agent.engines.torch.engine import TorchEngine
    e = TorchEngine(embedded_model, device="cpu")
    e.load_weights()
    e.load_tokenizer()
    e.solidify([(16, 1), (16, 2), (16, 4)])    # the warmed batch sizes: 1, 2, 4
    yield e
    e.close()


@pytest.fixture
def backend(engine):
    b = engine.openai_backend()
    b.batcher.window = 0.003
    return b


def call(backend, path, payload=None, method="POST", raw: bytes | None = None):
    """(status, headers, [body chunks]) of one request."""
    async def go():
        body = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else b"")
        r = await backend.request(method, path, body, {})
        return r.status, r.headers, [c async for c in r.body]
    return asyncio.run(go())


def answer(backend, path, payload):
    status, _, chunks = call(backend, path, payload)
    assert status == 200, chunks
    return json.loads(b"".join(chunks))


def events(chunks: list[bytes]) -> list:
    """The SSE events of a stream, one per chunk; [DONE] last."""
    out = []
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n"), c
        data = c[6:-2].decode()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat_prompt_ids(engine, messages) -> list[int]:
    """The prompt as transformers renders the model's chat template (the reference)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(engine.model_path)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def wait_idle(batcher, timeout=30):
    deadline = time.monotonic() + timeout
    while not batcher.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.idle


def last_batch(backend):
    """The last batch's record, once it is written (a request's answer ends before its batch does)."""
    wait_idle(backend.batcher)
    return backend.batcher.counters.recent[-1]


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there, how are you"}]


def test_models_lists_the_served_name(backend, engine):
    status, headers, chunks = call(backend, "/v1/models", method="GET")
    body = json.loads(b"".join(chunks))
    assert status == 200 and headers["content-type"] == "application/json"
    assert [m["id"] for m in body["data"]] == ["embedded-llama-v1"] and body["object"] == "list"
    assert body["data"][0]["max_model_len"] == 2048


def test_chat_uses_the_tokenizers_template_and_counts_usage(backend, engine):
    out = answer(backend, "/v1/chat/completions", {"model": "embedded-llama-v1", "messages": MESSAGES,
                                                   "max_tokens": 7, "temperature": 0})
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["model"] == "embedded-llama-v1"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(chat_prompt_ids(engine, MESSAGES))
    # "length" is 7 tokens; an EOS ends it sooner ("stop") and counts as one.
    assert (choice["finish_reason"], usage["completion_tokens"]) == ("length", 7) or \
        (choice["finish_reason"] == "stop" and usage["completion_tokens"] <= 7)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completion_greedy_matches_the_engines_own_generate(backend, engine):
    """temperature 0 through the scheduler gives the tokens TorchEngine.generate gives."""
    prompt = "patujasuli lora zurobi hute"
    ids = engine.tokenize(prompt)
    with engine.lock:
        engine.generate([ids], max_new_tokens=6)
        expected = engine.last_output[0].tolist()
    out = answer(backend, "/v1/completions", {"model": engine.model_path, "prompt": ids, "max_tokens": 6,
                                              "temperature": 0})
    assert out["object"] == "text_completion" and out["usage"] == {
        "prompt_tokens": len(ids), "completion_tokens": out["usage"]["completion_tokens"],
        "total_tokens": len(ids) + out["usage"]["completion_tokens"]}
    if out["choices"][0]["finish_reason"] == "length":
        assert out["choices"][0]["text"] == engine.tokenizer.decode(expected)
    # A string prompt is the same prompt.
    again = answer(backend, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert again["choices"][0]["text"] == out["choices"][0]["text"]
    assert again["usage"]["prompt_tokens"] == len(ids)


def test_stream_chunks_in_openai_format_with_usage(backend):
    payload = {"messages": MESSAGES, "max_tokens": 9, "temperature": 0}
    whole = answer(backend, "/v1/chat/completions", payload)
    status, headers, chunks = call(backend, "/v1/chat/completions",
                                   {**payload, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"] == "text/event-stream"
    evs = events(chunks)
    assert evs[-1] == "[DONE]"
    body = evs[:-1]
    assert {e["object"] for e in body} == {"chat.completion.chunk"} and len({e["id"] for e in body}) == 1
    assert body[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk, finish_chunk, deltas = body[-1], body[-2], body[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert finish_chunk["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(e["usage"] is None for e in body[:-1])
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in deltas)
    assert text == whole["choices"][0]["message"]["content"]

    # Without include_usage: no usage field, no usage chunk.
    _, _, chunks = call(backend, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "stream": True})
    evs = events(chunks)
    assert evs[-1] == "[DONE]" and all("usage" not in e for e in evs[:-1])
    assert {e["object"] for e in evs[:-1]} == {"text_completion"}
    assert evs[-2]["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_strings_end_the_answer_before_them(backend):
    base = {"prompt": "hello there", "max_tokens": 24, "temperature": 0}
    full = answer(backend, "/v1/completions", base)["choices"][0]["text"]
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    cut = full[:full.index(stop)]
    for stops in (stop, ["zzzz-never", stop]):
        out = answer(backend, "/v1/completions", {**base, "stop": stops})
        assert out["choices"][0] == {**out["choices"][0], "text": cut, "finish_reason": "stop"}
        assert out["usage"]["completion_tokens"] < 24
        # streamed: the same text, and the stop string never reaches the client
        _, _, chunks = call(backend, "/v1/completions", {**base, "stop": stops, "stream": True})
        streamed = "".join(e["choices"][0]["text"] for e in events(chunks)[:-1])
        assert streamed == cut


def test_seed_repeats_a_sampled_answer(backend):
    payload = {"prompt": "hello there", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9}
    a = answer(backend, "/v1/completions", {**payload, "seed": 1234})["choices"][0]["text"]
    b = answer(backend, "/v1/completions", {**payload, "seed": 1234})["choices"][0]["text"]
    others = {answer(backend, "/v1/completions", {**payload, "seed": s})["choices"][0]["text"] for s in range(4)}
    assert a == b
    assert len(others | {a}) > 1      # sampling samples: other seeds give other answers


def test_requests_that_arrive_together_run_as_one_batch_on_a_warmed_size(backend, engine):
    backend.batcher.window = 0.5       # this test's requests come from one loop: well inside it

    async def together(n):
        async def one(i):
            r = await backend.request("POST", "/v1/completions", json.dumps(
                {"prompt": "hello " * (i + 1), "max_tokens": 5, "temperature": 0}).encode(), {})
            return json.loads(b"".join([c async for c in r.body]))
        return await asyncio.gather(*(one(i) for i in range(n)))

    wait_idle(backend.batcher)
    before = backend.batcher.counters.batches
    outs = asyncio.run(together(2))
    record = last_batch(backend)
    assert backend.batcher.counters.batches == before + 1
    assert (record.size, record.padded) == (2, 2)
    assert [o["usage"]["prompt_tokens"] for o in outs] == [len(engine.tokenize("hello " * n)) for n in (1, 2)]
    asyncio.run(together(3))
    record = last_batch(backend)
    assert (record.size, record.padded, record.path) == (3, 4, "eager")   # padded to the warmed size 4


def test_a_prompt_answers_the_same_alone_and_in_a_mixed_batch(backend):
    """Left padding is masked: a request's greedy answer does not depend on its neighbours."""
    backend.batcher.window = 0.5
    payload = {"prompt": "patujasuli lora zurobi", "max_tokens": 8, "temperature": 0}
    alone = answer(backend, "/v1/completions", payload)["choices"][0]["text"]

    async def mixed():
        async def one(p):
            r = await backend.request("POST", "/v1/completions", json.dumps(p).encode(), {})
            return json.loads(b"".join([c async for c in r.body]))["choices"][0]["text"]
        return await asyncio.gather(one(payload), one({**payload, "prompt": "hute viloci " * 5}))
    together = asyncio.run(mixed())
    assert last_batch(backend).size == 2
    assert together[0] == alone


def test_the_static_decoder_path_answers_as_the_eager_path(engine, backend):
    """The GPU path (the engine's static decoders, graphs.py) run without capture on
    the CPU: prompts of one length whose answer fits go through it, token for token
    the same as the eager path."""
    from warmup_agent.gpu import graphs
    payload = {"prompt": "hello there friend", "max_tokens": 6, "temperature": 0}
    eager = answer(backend, "/v1/completions", payload)
    assert last_batch(backend).path == "eager"
    with engine.lock:
        decoders, reason = graphs.build(engine.model, [1, 2], 64, engine.device, capture=False,
                                        prefill_lengths={1: [16], 2: [16]})
    assert reason is None
    engine._decoders = decoders
    try:
        static = answer(backend, "/v1/completions", payload)
        assert last_batch(backend).path == "static"
        assert static["choices"][0]["text"] == eager["choices"][0]["text"]
        assert decoders[1].prefills[16].served >= 1    # the padded prefill served it
        # An answer that would not fit the static cache (64) goes the eager way.
        answer(backend, "/v1/completions", {**payload, "max_tokens": 100})
        assert last_batch(backend).path == "eager"
    finally:
        engine._decoders = {}


BAD = [
    (b"{not json", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_json"),
    ({"model": "gpt-4o", "messages": MESSAGES}, "model", "model_not_found"),
    ({}, "messages", "missing_required_parameter"),
    ({"messages": "hello"}, "messages", "invalid_type"),
    ({"messages": [{"content": "no role"}]}, "messages[0]", "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "invalid_type"),
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature", "invalid_type"),
    ({"messages": MESSAGES, "temperature": 3}, "temperature", "invalid_value"),
    ({"messages": MESSAGES, "top_p": 0}, "top_p", "invalid_value"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": MESSAGES, "max_tokens": 1.5}, "max_tokens", "invalid_type"),
    ({"messages": MESSAGES, "max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ({"messages": MESSAGES, "max_completion_tokens": 2048}, "max_completion_tokens", "context_length_exceeded"),
    ({"messages": MESSAGES, "stop": 5}, "stop", "invalid_type"),
    ({"messages": MESSAGES, "seed": "x"}, "seed", "invalid_type"),
    ({"messages": MESSAGES, "n": 2}, "n", "invalid_value"),
    ({"messages": MESSAGES, "stream": "yes"}, "stream", "invalid_type"),
]


@pytest.mark.parametrize(("payload", "param", "code"), BAD)
def test_bad_chat_requests_get_openai_error_bodies(backend, payload, param, code):
    raw = payload if isinstance(payload, bytes) else None
    status, headers, chunks = call(backend, "/v1/chat/completions", None if raw else payload, raw=raw)
    body = json.loads(b"".join(chunks))
    assert status == 400 and headers["content-type"] == "application/json"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == ("invalid_request_error", param, code)
    assert body["error"]["message"]


@pytest.mark.parametrize(("payload", "param"), [
    ({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1, 99999]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"), ({"prompt": "x " * 2100}, "prompt"),
])
def test_bad_completion_requests_get_openai_error_bodies(backend, payload, param):
    status, _, chunks = call(backend, "/v1/completions", payload)
    body = json.loads(b"".join(chunks))
    assert status == 400 and body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"


def test_unknown_paths_and_methods(backend):
    assert call(backend, "/v1/embeddings", {})[0] == 404
    assert call(backend, "/v1/completions", method="GET")[0] == 405
    status, _, chunks = call(backend, "/v1/models?x=1", method="GET")
    assert status == 200


def test_a_client_that_goes_away_mid_stream_frees_its_slot(backend):
    counters = backend.batcher.counters

    async def go():
        r = await backend.request("POST", "/v1/completions", json.dumps(
            {"prompt": "hello", "max_tokens": 1500, "temperature": 0, "stream": True}).encode(), {})
        it = r.body.__aiter__()
        first = [await it.__anext__(), await it.__anext__()]
        await r.body.aclose()               # what the proxy does when the client disconnects
        return first
    wait_idle(backend.batcher)
    cancelled = counters.cancelled
    first = asyncio.run(go())
    assert all(c.startswith(b"data: {") for c in first)
    deadline = time.monotonic() + 30
    while (counters.cancelled == cancelled or counters.running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counters.cancelled == cancelled + 1 and counters.running == 0
    record = last_batch(backend)
    assert record.cancelled == 1 and record.steps < 1499   # the batch ended early, not at max_tokens
    # and the engine serves the next request
    assert answer(backend, "/v1/completions", {"prompt": "hello", "max_tokens": 2})["usage"]["completion_tokens"] >= 1


def test_a_request_closed_before_it_runs_never_runs(backend, engine):
    counters = backend.batcher.counters

    async def go():
        r = await backend.request("POST", "/v1/completions", json.dumps(
            {"prompt": "hello", "max_tokens": 50, "stream": True}).encode(), {})
        await r.body.aclose()
    wait_idle(backend.batcher)
    batches, cancelled = counters.batches, counters.cancelled
    with engine.lock:                      # the engine is busy (a probe, say)
        asyncio.run(go())
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while counters.cancelled == cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    wait_idle(backend.batcher)
    assert counters.cancelled == cancelled + 1 and counters.running == 0
    # Dropped when the batch was formed, or at the prefill's token: never decoded.
    assert counters.batches in (batches, batches + 1)
    if counters.batches == batches + 1:
        assert (counters.recent[-1].cancelled, counters.recent[-1].steps) == (1, 0)


def test_user_batches_and_the_agents_calls_share_the_engine_lock(backend, engine):
    """The driver takes the engine's lock, and a user batch waits while the agent holds it."""
    from exporter.metrics import AgentMetrics
    from exporter.recorder import Recorder
    from warmup_agent.driver import EngineDriver
    driver = EngineDriver(engine, Recorder(AgentMetrics()), 8)
    assert driver.lock is engine.lock is backend.batcher.lock
    result = {}

    def user():
        result["out"] = answer(backend, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    with driver.busy():
        t = threading.Thread(target=user)
        t.start()
        t.join(0.5)
        assert t.is_alive() and "out" not in result     # waiting for the lock, not running beside the agent
    t.join(30)
    assert result["out"]["usage"]["completion_tokens"] >= 1
    # and the agent's watch probes pause while users are served (Engine.others_served_within)
    age = engine.others_served_within(60)
    assert age is not None and 0 <= age < 60


def test_detokenizer_withholds_partial_characters_and_stop_prefixes():
    pieces = {1: "ab", 2: "c", 3: "\ufffd", 4: "é", 5: "STO", 6: "P!", 7: "x"}

    def decode(ids):
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffdé", "é")     # 3 then 4: one character in two tokens
    d = Detokenizer(decode, ["STOP"], frozenset({9}))
    assert d.add(1) == ("", False)             # the last 3 characters are held: they may start "STOP"
    assert d.add(2) == ("", False)
    assert d.add(9) == ("", False)             # a hidden token adds nothing
    assert d.add(3) == ("", False)             # an incomplete character waits
    out, stopped = d.add(4)
    assert (out, stopped) == ("a", False)      # "abcé": all but the last 3
    out, stopped = d.add(5)                    # "abcéSTO": "STO" may start "STOP"
    assert (out, stopped) == ("bcé", False)
    out, stopped = d.add(6)                    # "STOP" found: cut before it
    assert (out, stopped) == ("", True) and d.text == "abcé"


def test_the_transformers_implementation_serves_the_same_way(embedded_model):
    """model.implementation transformers: AutoTokenizer and AutoModelForCausalLM behind the same responder."""
    from warmup_agent.engines.torch.engine import TorchEngine
    e = TorchEngine(embedded_model, device="cpu", implementation="transformers")
    try:
        e.load_weights()
        e.load_tokenizer()
        e.solidify([(16, 1), (16, 2)])
        b = e.openai_backend()
        out = answer(b, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "temperature": 0})
        assert out["usage"]["prompt_tokens"] == len(chat_prompt_ids(e, MESSAGES))
        _, _, chunks = call(b, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "temperature": 0,
                                                        "stream": True})
        text = "".join(ev["choices"][0]["delta"].get("content", "") for ev in events(chunks)[:-1])
        assert text == out["choices"][0]["message"]["content"]
    finally:
        e.close()
