"""Warm-up prompts where the agent has no tokenizer of its own: `warmup-agent run --engine
openai -- llama-server -m model.gguf` (no --model), the README's first example.

The agent then counts tokens with the server's /tokenize, which llama.cpp reads from
"content" (it answered [] for vLLM's "prompt": every token-id prompt was token 0 repeated),
and words its chat prompts itself.  They used to be one fixed text, answered from
llama.cpp's prompt cache after the first: one token of prefill, so every probe read warm
and a user's first request paid what none of them had.  Checked on the real CPU
llama-server through its own log: after discovery, every request's prefill evaluates
more than the chat template's opening.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers import llamacpp_server as ls
from tests.helpers.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PREFILL = re.compile(r"prompt eval time =\s+[\d.]+ ms /\s+(\d+) tokens")


def test_every_warm_up_request_is_prefilled_when_the_agent_has_no_tokenizer(tmp_path, llama_server, gguf):
    port = free_port()
    r = subprocess.run(agent_cmd("run", "--once", "--no-progress", "--engine", "openai", "--data-dir",
                                 str(tmp_path / "data"), "--listen", f"127.0.0.1:{free_port()}", "--",
                                 *ls.server_command(llama_server, gguf, port)),
                       cwd=ROOT, env=ls.server_env(str(tmp_path)), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    start = next(i for i, ln in enumerate(lines) if "token-id prompts" in ln)
    assert "token-id prompts True" in lines[start]
    evaluated = [int(m.group(1)) for ln in lines[start:] if (m := PREFILL.search(ln))]
    assert len(evaluated) >= 2, "\n".join(lines[-60:])
    # the template's opening (its first few tokens) may come from the cache; the rest may not
    assert min(evaluated) > 8, evaluated
