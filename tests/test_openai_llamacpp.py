"""The openai engine supervising llama.cpp's real `llama-server` (CPU build, embedded model).

The second tested server that is not vLLM: a C++ server with its own loader, a GGUF
model (tools/gguf_convert.py) and its own idea of the OpenAI API.  Run as a user
would: `warmup-agent run --engine openai --model DIR -- llama-server -m DIR.gguf ...`;
the agent must reach SERVING, an outside client's first streamed, sampled chat request
must get tokens, and SIGTERM must drain to exit 0.  Timings are not asserted.

The binary comes from tools/build_llama_server.py's cache (`make test-setup` builds
it; the fixture builds it when missing, which takes tens of minutes on 2 cores).
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import psutil
import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers import llamacpp_server as ls
from tests.helpers.servers import free_port, http_get, wait_until
from tests.helpers.warmup_record import controlled_tax, controlled_total_tax, exported_pair, requests_in_record
from tools import build_llama_server as build

# The fixture may have to build llama-server first: 38 min on 2 busy cores, about 11 on idle ones.
SLOW = [pytest.mark.slow, pytest.mark.timeout(3600)]


def outside_chat_chunks(port: int, model: str) -> list[dict]:
    """A user's streamed, sampled chat request straight to the server: its choices'
    deltas with the time each arrived.  llama-server opens with a role chunk whose
    content is null, then sends one chunk per token with content a string, ends with a
    delta {} carrying finish_reason.  The string can be U+FFFD (one byte of a character
    split over tokens, seen here): count the chunks, not the text.  A token past the
    tokenizer's vocabulary (a [PADn] id, UNUSED in the GGUF) gets no chunk at all; the
    embedded model has none (gguf_convert.py --render-pad-tokens gives them text)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Is the server warm yet?"}],
            "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 7, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    chunks = []
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            for c in json.loads(line[5:]).get("choices") or ():
                chunks.append({"at": time.perf_counter() - t0, "delta": c.get("delta") or {},
                               "finish_reason": c.get("finish_reason")})
    return chunks


def no_orphans(marker: str) -> list[int]:
    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if marker in " ".join(p.info["cmdline"] or [])]


@SLOW[0]
@SLOW[1]
def test_supervised_llama_server_reaches_serving_answers_an_outside_chat_and_drains(
        tmp_path, embedded_model, data_dir, llama_server, gguf):
    port, listen = free_port(), free_port()
    rec = tmp_path / "run.json"
    env = ls.server_env(str(tmp_path))
    env.update(WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[24]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]",
               WARMUP_AGENT_PREWARM_MAX_OUTPUT_TOKENS="4", WARMUP_AGENT_READINESS_PROBE_MAX_TOKENS="4",
               WARMUP_AGENT_READINESS_PROBE_PROMPT_LENGTH="20", WARMUP_AGENT_READINESS_MIN_PROBES="5",
               # decode on two shared cores is noisy: the gate's ratio stays loose here
               WARMUP_AGENT_READINESS_TPOT_CONVERGENCE_RATIO="4")
    server = ls.server_command(llama_server, gguf, port)
    log = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                       "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}", "--record", str(rec),
                                       "--", *server),
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"
    try:
        wait_until(lambda: http_get(url + "/readyz")[0] == 200 or agent.poll() is not None, 300, what="SERVING")
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
        models = json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])
        chunks = outside_chat_chunks(port, models["data"][0]["id"])
        tokens = [c for c in chunks if isinstance(c["delta"].get("content"), str)]
        assert 1 <= len(tokens) <= 8, chunks
        assert chunks[-1]["finish_reason"] in ("length", "stop"), chunks
    finally:
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(60)
    assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]
    record = json.loads(rec.read_text())
    assert [t["state"] for t in record["transitions"]][:4] == ["INIT", "PRELOAD", "PRIME", "SERVING"]
    caps = record["traffic_profile"]["capabilities"]
    assert caps["apis"] == ["chat", "completions"]
    # llama-server takes token-id prompts and accepts ignore_eos and stream_options
    assert caps["token_id_prompts"] is True and caps["rejected_fields"] == []
    assert caps["model"] == gguf                     # /v1/models: the -m path as given
    assert record["engine_facts"]["extra"]["server_spawn"]["early"] is True   # spawned before the agent's imports
    # the first request's figures exist (their size is not asserted: timings) and are the
    # exported pair's: 1 + (its first probe - its control; never below 0) / the median of
    # the probes after that first
    ours = [l for l in (tmp_path / "agent.log").read_text().splitlines() if "warmup_agent.server:" not in l]
    assert not any("Traceback" in l for l in ours)
    assert not no_orphans(f"--port {port}"), "the supervised server outlived the agent"
    ready = next(s for s in record["stages"] if s["name"] == "ready")
    prewarm = next(s for s in record["stages"] if s["name"] == "prewarm")
    gate = slice(ready["gate_first_probe"], ready["probes"])
    ttfts, totals = record["probes_seconds"][gate], record["probe_total_seconds"][gate]
    remembered = record["first_request_new_length_remembered"]
    if ready["first_probe_alone"]:
        # this server was measured before (the session's data directory) and each new length
        # paid: the gate's first probe went alone, and the figures are the remembered ones
        assert remembered and ready["first_probe_pairs"] == [] and len(ttfts) == 1
        assert prewarm["warmup"]["per_length"]["remembered"]["control"].startswith("skipped")
        assert record["first_request_seconds"] == ttfts[0] > 0
        assert record["first_request_tax_ratio"] == 1 + remembered["ttft"]
        assert record["first_request_total_tax_ratio"] == 1 + remembered["total"]
        assert record["first_request_output_tokens"] == 8 and record["first_probe_total_tax_ratio"] is None
        return
    first = exported_pair(ready, prewarm)
    assert record["first_request_seconds"] == ttfts[first] > 0
    assert record["first_request_tax_ratio"] == pytest.approx(
        1 + remembered["ttft"] if remembered else controlled_tax(ttfts, first), rel=1e-12)
    # llama-server honours ignore_eos: the first pair answers prewarm.per_length_tokens (8)
    # tokens where it is prewarm's per-length test, the profile's longest answer where the
    # gate sent a new one (decode pays per length); the gate's other probes 4
    pairs = len(ready["first_probe_pairs"])
    if ready["first_pairs_from_prewarm"]:
        tokens = [8] * 2 * ready["first_pairs_from_prewarm"]
    else:
        tokens = [record["traffic_profile"]["max_tokens"]] * 2
    tokens += [4] * (len(ttfts) - len(tokens))
    assert record["first_request_output_tokens"] == tokens[first] and pairs >= 1
    assert record["first_probe_total_tax_ratio"] == pytest.approx(controlled_total_tax(ttfts, totals, tokens, first),
                                                                  rel=1e-9)
    cold_decode = record["first_request_cold_decode"]
    assert record["first_request_total_tax_ratio"] == (
        cold_decode["total_tax"] if cold_decode else 1 + remembered["total"] if remembered
        else record["first_probe_total_tax_ratio"])


@SLOW[0]
@SLOW[1]
def test_prompt_lengths_are_not_warmed_when_fresh_lengths_prefill_no_slower_than_their_controls(
        tmp_path, embedded_model, data_dir, llama_server, gguf):
    """With a tolerance no timing can miss, the per-length test's fresh lengths
    prefill no slower than their controls (the same lengths again, after the same
    predecessor): the profile's other lengths then get no call, each recorded as
    skipped with that reason (they got one call each before)."""
    from warmup_agent.stages import profile_warmup
    from warmup_agent.stages.profile_warmup import NEW_LENGTHS_WARM
    port, listen = free_port(), free_port()
    rec = tmp_path / "run.json"
    env = ls.server_env(str(tmp_path))
    env.update(WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[16, 24, 40]", WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]",
               WARMUP_AGENT_PREWARM_BEHIND_USERS="false",      # every path before SERVING, as recorded
               WARMUP_AGENT_PREWARM_MAX_OUTPUT_TOKENS="4", WARMUP_AGENT_PREWARM_CONVERGE_TOLERANCE="1000",
               # decode on busy cores can read "pays per length": no coverage tiles in the count below
               WARMUP_AGENT_PREWARM_DECODE_COVERAGE="never",
               # this start's own per-length test is checked below: nothing remembered from
               # another test's start in the session's shared data directory
               WARMUP_AGENT_PREWARM_REMEMBER_FINDINGS="false",
               WARMUP_AGENT_OPENAI_API="chat", WARMUP_AGENT_READINESS_TPOT_CONVERGENCE_RATIO="1000",
               WARMUP_AGENT_READINESS_P50_THRESHOLD_SECONDS="60", WARMUP_AGENT_READINESS_P90_THRESHOLD_SECONDS="60")
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                       "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}", "--record", str(rec),
                                       "--", *ls.server_command(llama_server, gguf, port)),
                             cwd=ROOT, env=env, stdout=open(tmp_path / "agent.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: http_get(f"http://127.0.0.1:{listen}/readyz")[0] == 200 or agent.poll() is not None, 300,
                   what="SERVING")
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    prewarm = next(s for s in json.loads(rec.read_text())["stages"] if s["name"] == "prewarm")
    per_length = prewarm["warmup"]["per_length"]
    # the gate's first probe pair, at a fresh length, is the test; a second (another fresh
    # length) only where that was cold.  No anchor path before it: the server's first real
    # request is discovery's; on this server a new length costs nothing, so no length is
    # worth a call
    assert per_length["tested"] and "anchor_pair" not in per_length and len(per_length["lengths"]) in (1, 2)
    assert len(per_length["pairs"]) == len(per_length["lengths"])
    assert per_length["prefill_pays_each_new_length"] is False
    reason = profile_warmup.length_skip_reason(per_length)
    assert reason in (NEW_LENGTHS_WARM, profile_warmup.ONE_TIME_COST)
    # llama-server times its own prefill (timings.prompt_ms), the first's and its control's: that clock decided
    assert len(per_length["server_prefill_ms"]) == len(per_length["pairs"])
    assert all(len(pair) == 2 and min(pair) > 0 for pair in per_length["server_prefill_ms"])
    paths = {p["path"]: p for p in prewarm["paths"]}
    for n in (16, 24, 40):      # the probe family's lengths, the longest too: no anchor path
        p = paths[f"chat/sampled/batch1/len{n}"]
        assert p["result"] == "skipped" and p["calls"] == 0 and p["reason"] == reason, p
    # every request the warmup sent is a path's (the greedy family: a first call and its
    # control), a replayed predecessor's or the settle request's; the per-length test's fresh
    # length is the gate's first probe pair (probes, not warmup requests)
    warmup = prewarm["warmup"]
    assert paths["chat/greedy/batch1/len40"]["calls"] == 2
    assert all(p["calls"] == 2 for n, p in paths.items() if not n.startswith("chat/sampled/"))
    # one short request, alone; again after a length ladder (where the first fresh length paid)
    assert warmup["settle_requests"] == 1 + bool(per_length["ladder"]) and warmup["at_once"] >= 1
    assert warmup["settled_by_discovery"] is False      # the greedy path's calls went before the probes
    assert warmup["ladder_requests"] == len(per_length["ladder"])
    assert per_length["lengths"][-1] == warmup["probe_length"] and per_length["probe_pair"]
    assert prewarm["requests"] == requests_in_record(prewarm)
    # `requests` counts the sends: each path call, each replay, each settle request and rung
    assert warmup["requests"] == (sum(p["calls"] for p in paths.values()) + warmup["replays"]
                                  + warmup["settle_requests"] + warmup["ladder_requests"])


def _fake(bin_dir, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)


def test_cuda_auto_needs_nvcc_and_a_gpu_that_nvidia_smi_lists(tmp_path, monkeypatch):
    """This machine and CI have nvcc but no GPU: auto must build for the CPU there."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not build.want_cuda("auto") and build.want_cuda("on") and not build.want_cuda("off")
    _fake(tmp_path, "nvcc", "exit 0")
    assert not build.want_cuda("auto")                                     # no nvidia-smi
    _fake(tmp_path, "nvidia-smi", "echo 'NVIDIA-SMI has failed because it could not communicate'; exit 9")
    assert not build.want_cuda("auto")
    _fake(tmp_path, "nvidia-smi", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'")
    assert build.want_cuda("auto")
    (tmp_path / "nvcc").unlink()
    assert not build.want_cuda("auto")                                     # a GPU, no toolkit
    assert build.variant_name(True, "90") == f"{build.VERSION}-cuda-sm90"


def test_stripped_tree_keeps_what_the_server_target_needs():
    for path in ("models/ggml-vocab-llama.gguf", "docs/build.md", "examples/simple/simple.cpp", "tests/test-c.c",
                 "tools/ui/src/app.html", "tools/server/tests/unit/test_basic.py", ".git"):
        assert build._stripped(path), path
    for path in ("CMakeLists.txt", "tools/ui/CMakeLists.txt", "tools/server/server.cpp", "tools/mtmd/mtmd.cpp",
                 "scripts/ui-assets.cmake", "ggml/src/ggml-cuda/ggml-cuda.cu", "convert_hf_to_gguf.py", "gguf-py/gguf/gguf.py",
                 "models_extra.txt"):
        assert not build._stripped(path), path


def test_data_dir_follows_the_agents_rule(monkeypatch, tmp_path):
    from warmup_agent import config
    monkeypatch.delenv("WARMUP_AGENT_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert str(build.default_data_dir()) == config._default_data_dir() == str(tmp_path / "warmup-agent")
    monkeypatch.setenv("WARMUP_AGENT_DATA_DIR", str(tmp_path / "d"))
    assert build.default_data_dir() == tmp_path / "d"


def _chat_of_tokens(text, tokens: int, words: list[str], **params) -> dict:
    """A chat request body whose rendered prompt is `tokens` long, or the first word more."""
    content: list[str] = []
    while text.count_chat([{"role": "user", "content": " ".join(content)}]) < tokens:
        content.append(words[len(content) % len(words)])
    return {"model": "m", "messages": [{"role": "user", "content": " ".join(content)}], **params}


@SLOW[0]
@SLOW[1]
def test_a_requests_file_of_600_token_prompts_fits_the_context_its_4_slots_share(
        tmp_path, embedded_model, data_dir, llama_server, gguf):
    """Issue 72, part 3: traffic of 600-token prompts, warmed at batch sizes 1, 2 and 4,
    against `llama-server -c 2048` (its 4 automatic slots share that one pool).  4 such
    prompts at once overflow it ("Context size has been exceeded": the start failed with
    request_failed).  The agent reads the server's context (/props: each slot 2048, 4
    slots; the command line: -c 2048 shared), sends the batch of 4 at the length they fit
    together, and reaches SERVING."""
    from warmup_agent.bench.traffic import WORDS
    from warmup_agent.engines.text_prompts import TextPrompts
    from warmup_agent.server.context import SPARE
    text = TextPrompts.from_model_dir(embedded_model, "")
    bodies = [_chat_of_tokens(text, 600 + i, list(WORDS[i * 7:]) + list(WORDS), max_tokens=16,
                              **({"temperature": 0.7, "top_p": 0.9} if i % 2 else {"temperature": 0.0}))
              for i in range(4)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    port, listen = free_port(), free_port()
    rec = tmp_path / "run.json"
    env = ls.server_env(str(tmp_path))
    env.update(WARMUP_AGENT_PREWARM_REQUESTS_FILE=str(requests), WARMUP_AGENT_PREWARM_BATCH_SIZES="[1, 2, 4]",
               WARMUP_AGENT_PREWARM_BEHIND_USERS="false",      # the batch of 4 before SERVING, as recorded
               # about fitting the context, not the budget: every path gets its calls on busy cores
               WARMUP_AGENT_PREWARM_BUDGET_SECONDS="300", WARMUP_AGENT_PREWARM_REMEMBER_FINDINGS="false",
               WARMUP_AGENT_OPENAI_API="chat", WARMUP_AGENT_READINESS_TPOT_CONVERGENCE_RATIO="1000",
               WARMUP_AGENT_READINESS_P50_THRESHOLD_SECONDS="60", WARMUP_AGENT_READINESS_P90_THRESHOLD_SECONDS="60")
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                       "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}", "--record", str(rec),
                                       "--", *ls.server_command(llama_server, gguf, port)),
                             cwd=ROOT, env=env, stdout=open(tmp_path / "agent.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"

    def state() -> str | None:
        try:
            return json.loads(http_get(url + "/startupz", timeout=2)[1]).get("state")
        except Exception:  # noqa: BLE001 - not listening yet
            return None
    try:
        # a failed start stays up in FAILED (it keeps serving its metrics): stop waiting there
        wait_until(lambda: state() in ("SERVING", "FAILED") or agent.poll() is not None, 600, what="SERVING")
        assert agent.poll() is None and state() == "SERVING", (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(60)
    assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]
    record = json.loads(rec.read_text())
    assert [t["state"] for t in record["transitions"]][:4] == ["INIT", "PRELOAD", "PRIME", "SERVING"]
    prewarm = next(s for s in record["stages"] if s["name"] == "prewarm")
    assert min(prewarm["profile"]["prompt_lengths"]) >= 600
    fit = prewarm["warmup"]["server_context"]
    assert fit["per_request_tokens"] == 2048 and fit["shared_tokens"] == 2048, fit
    assert fit["source"] == "the server and its command line" and fit["dropped_lengths"] == []
    # the batch of 4 was sent, each prompt with its answer within a quarter of the pool;
    # the batch of 2 at the traffic's longest prompt
    paths = {p["path"]: p for p in prewarm["paths"]}
    four = [p for name, p in paths.items() if "/batch4/" in name]
    assert len(four) == 1 and four[0]["calls"] >= 1, paths
    longest = max(prewarm["profile"]["prompt_lengths"])
    assert int(next(iter(n for n in paths if "/batch4/" in n)).rsplit("len", 1)[1]) == 2048 // 4 - SPARE - 2
    assert any(f"/batch2/len{longest}" in n and p["calls"] >= 1 for n, p in paths.items()), paths
