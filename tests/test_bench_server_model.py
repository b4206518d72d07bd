"""The GPU server bench's model, made small here, streams from the real `transformers serve`
as a real Qwen2 model does: token by token, no echo of the prompt.

Before `qwen_chat_tokenizer`, the bench's qwen2 model had a trained tokenizer with a "<s>role"
chat format. `transformers serve` parses a qwen2 model's answer with Qwen's response
template, never found its anchor, and streamed the rendered prompt as the first chunk. The
bench then timed that echo as the time to first token. The control below keeps that
failure visible, so the test is known to tell the two apart.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

from bench.gpu_model import QWEN_SPECIALS, qwen_chat_tokenizer
from tests.helpers import transformers_server as ts

VOCAB = 151936   # Qwen2-1.5B's, as the bench model's


def tiny_bench_model(path: str) -> str:
    """The bench model's recipe (bench_gpu_cold_start.make_model) at a tiny size, on the CPU."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from warmup_agent.model.embedded import _train_tokenizer
    os.makedirs(path, exist_ok=True)
    _train_tokenizer(path)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def test_the_tokenizer_covers_the_vocabulary_and_speaks_qwen_chat(tmp_path):
    from transformers import AutoTokenizer
    model = tiny_bench_model(str(tmp_path / "m"))
    before = AutoTokenizer.from_pretrained(model)
    text = "A customer asks why their order has not arrived yet."
    ids_before = before(text)["input_ids"]
    qwen_chat_tokenizer(model)
    tok = AutoTokenizer.from_pretrained(model)
    assert len(tok) == VOCAB
    assert tok(text)["input_ids"] == ids_before            # encoding unchanged
    for t, i in QWEN_SPECIALS.items():
        assert tok.convert_tokens_to_ids(t) == i
    assert tok.decode([5000, 100000]) == " w5000 w100000"  # every id has text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with open(os.path.join(model, "generation_config.json")) as f:
        gen = json.load(f)
    assert gen["do_sample"] is True and gen["eos_token_id"] == QWEN_SPECIALS["<|im_end|>"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream_chunks(model: str, scratch: str) -> list[str]:
    """The content chunks of one streamed chat answer from a fresh `transformers serve`."""
    port = _free_port()
    log = open(os.path.join(scratch, f"serve-{port}.log"), "w")
    proc = subprocess.Popen(ts.server_command(model, port), env=ts.server_env(scratch), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, open(log.name).read()[-2000:]
                time.sleep(0.3)
        body = {"model": model, "messages": [{"role": "user", "content": "Where is my order from last week?"}],
                "max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        chunks = []
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                if raw.startswith(b"data:") and b"[DONE]" not in raw:
                    for c in json.loads(raw[5:]).get("choices", []):
                        if (c.get("delta") or {}).get("content"):
                            chunks.append(c["delta"]["content"])
        return chunks
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.mark.skipif(not ts.available(), reason="transformers serve needs fastapi and uvicorn")
def test_transformers_serve_streams_the_bench_model_token_by_token(tmp_path):
    control = tiny_bench_model(str(tmp_path / "control"))
    from warmup_agent.model.embedded import add_chat_template
    add_chat_template(control)                 # the old recipe: "<s>role" chat format
    echoed = _stream_chunks(control, str(tmp_path))
    assert echoed and echoed[0].startswith("<s>user"), echoed     # the echo, still there

    model = tiny_bench_model(str(tmp_path / "qwen"))
    qwen_chat_tokenizer(model)
    chunks = _stream_chunks(model, str(tmp_path))
    assert not any("<s>" in c or "<|im_start|>" in c for c in chunks), chunks
    # token by token: the Qwen parser holds a token's leading space until the next token
    # comes, so 12 tokens stream as at least 10 chunks
    assert len(chunks) >= 10, chunks
