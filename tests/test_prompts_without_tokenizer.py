"""Warm-up prompts where the agent has no tokenizer of its own: `warmup-agent run --engine
openai -- llama-server -m model.gguf` (no --model), the README's first example.

The agent then counts tokens with the server's /tokenize, which llama.cpp reads from
"content" (it answered [] for vLLM's "prompt": every token-id prompt was token 0 repeated),
and words its chat prompts itself.  They used to be one fixed text, answered from
llama.cpp's prompt cache after the first: one token of prefill, so every probe read warm
and a user's first request paid what none of them had.  Checked on the real CPU
llama-server through its own log: after discovery, every request's prefill evaluates
more than the chat template's opening.  Each request is matched by its task id, not by
where its line falls: the server's lines reach the agent's log through a pipe and, on a
loaded machine, a discovery request's line came after discovery's own summary.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers import llamacpp_server as ls
from tests.helpers.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TASK = re.compile(r"task +(\d+) \| +(prompt eval time|eval time|stop processing)\D+?([\d.]+ ms /\s+)?(\d+)")


def test_every_warm_up_request_is_prefilled_when_the_agent_has_no_tokenizer(tmp_path, llama_server, gguf):
    port = free_port()
    r = subprocess.run(agent_cmd("run", "--once", "--no-progress", "--engine", "openai", "--data-dir",
                                 str(tmp_path / "data"), "--listen", f"127.0.0.1:{free_port()}", "--",
                                 *ls.server_command(llama_server, gguf, port)),
                       cwd=ROOT, env=ls.server_env(str(tmp_path)), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    tasks: dict[str, dict[str, int]] = {}
    for m in TASK.finditer(r.stderr):
        tasks.setdefault(m.group(1), {})[m.group(2)] = int(m.group(4))
    done = {t: v for t, v in tasks.items() if len(v) == 3}
    # prompt = tokens in the slot at the end less those generated; evaluated = its prefill
    prompts = {t: (v["stop processing"] - v["eval time"], v["prompt eval time"]) for t, v in done.items()}
    assert sum(n > 40 for n, _ in prompts.values()) >= 2, r.stderr[-3000:]
    # the template's opening (its first few tokens) may come from the cache; the rest may not
    assert all(evaluated >= n - 8 for n, evaluated in prompts.values()), prompts
