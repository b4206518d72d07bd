"""The openai engine supervising a real `transformers serve` (CPU, embedded model).

A server unlike vLLM: text prompts only, no /tokenize, no metrics, unknown
request fields refused.  The agent must learn that by asking, warm it with chat
and completions of exact token lengths, mark every request, and reach SERVING
with the decode window filled.  A recording relay between agent and server
shows what went over the wire (transformers serve logs no request ids).
"""
from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest

from tests.helpers import transformers_server as ts
from tests.helpers.engines import openai_engine
from tests.helpers.servers import free_port, require_binary
from tests.helpers.warmup_record import controlled_tax, exported_pair, requests_in_record
from tests.http_relay import Relay
from warmup_agent import config
from warmup_agent.pipeline import Agent
from warmup_agent.stages import prewarm, profile_warmup
from warmup_agent.states import State

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not ts.available(), reason="needs transformers[serving] (make test-setup)")]

LENGTHS = [24, 48]
BATCHES = [1, 2]
PROBE_LEN = 20


@pytest.fixture(scope="module")
def served(tmp_path_factory, embedded_model):
    root = tmp_path_factory.mktemp("tserve")
    port = free_port()
    relay = Relay(port)
    cfg = config.load(env={"WARMUP_AGENT_DATA_DIR": str(root / "data"), "WARMUP_AGENT_ENGINE": "openai",
                           "WARMUP_AGENT_MODEL_PATH": embedded_model,
                           "WARMUP_AGENT_OPENAI_URL": relay.url,
                           "WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "300",
                           "WARMUP_AGENT_OPENAI_READY_TIMEOUT_SECONDS": "240",
                           "WARMUP_AGENT_OPENAI_DRAIN_SECONDS": "5",
                           "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": json.dumps(LENGTHS),
                           "WARMUP_AGENT_PREWARM_BATCH_SIZES": json.dumps(BATCHES),
                           "WARMUP_AGENT_PREWARM_BEHIND_USERS": "false",   # every path before SERVING
                           "WARMUP_AGENT_PREWARM_MAX_OUTPUT_TOKENS": "4",
                           "WARMUP_AGENT_READINESS_PROBE_MAX_TOKENS": "4",
                           "WARMUP_AGENT_READINESS_PROBE_PROMPT_LENGTH": str(PROBE_LEN),
                           "WARMUP_AGENT_READINESS_MIN_PROBES": "5",
                           # Decode on two shared cores is noisy: the gate's ratio stays loose here.
                           "WARMUP_AGENT_READINESS_TPOT_CONVERGENCE_RATIO": "4",
                           "WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "0",
                           # every path warmed, however slow the shared CPU is today
                           "WARMUP_AGENT_PREWARM_BUDGET_SECONDS": "300"})
    eng = openai_engine(cfg, server_command=ts.server_command(embedded_model, port),
                       base_env=ts.server_env(str(root)), model_path=embedded_model)
    agent = Agent(cfg, eng)
    state = agent.run()
    agent.stop()
    yield eng, agent, state, relay, port
    eng.close()
    relay.stop()


def test_reaches_serving_after_asking_what_the_server_answers(served):
    eng, agent, state, _, _ = served
    assert state == State.SERVING, (agent.sm.failure_reason, agent.sm.failure_message)
    assert eng.apis == ["chat", "completions"]
    assert eng.model == eng.model_dir               # served under the directory it was started on
    assert not eng.discovery.token_id_prompts                 # "prompt must be a string"
    assert "ignore_eos" in eng.client.rejected_fields      # "Unexpected fields in the request"
    # Default profile, warmed by measured benefit: the other family and API at the
    # longest length and batch 2; each until warm.  Nothing skipped for the budget.  The
    # probe family's lengths (no anchor path any more) get no call, with what the
    # per-length test said (timing-dependent on shared cores: any outcome is checked).
    detail = agent.stages[1].detail
    paths = {p["path"]: p for p in detail["paths"]}
    assert set(paths) == {"chat/sampled/batch1/len48", "chat/greedy/batch1/len48", "completions/greedy/batch1/len48",
                          "completions/sampled/batch1/len48", "chat/sampled/batch1/len24", "chat/sampled/batch2/len48"}
    for n in (24, 48):
        short = paths.pop(f"chat/sampled/batch1/len{n}")
        # the per-length test ran, so the profile's lengths are not worth a call, and the record says why
        assert short["result"] == "skipped" and short["calls"] == 0
        assert short["reason"] == profile_warmup.length_skip_reason(detail["warmup"]["per_length"]) is not None
    assert all(p["result"] in ("warm_on_first_call", "converged", "still_improving") and p["calls"] >= 1
               for p in paths.values())
    # every request sent is in the record: the paths' calls (batch 2 sends 2 at once),
    # the decode-coverage tiles (the per-length test's fresh length is the first probe pair),
    # the predecessors replayed before controls and the settle waves (prewarm's, and the
    # ready stage's before SERVING)
    warmup = detail["warmup"]
    assert agent.driver.warmup_requests == requests_in_record(detail, agent.stages[-1].detail)
    assert warmup["per_length"]["tested"] and warmup["budget"]["seconds"] == 300
    profile = detail["profile"]
    assert profile["families"] == ["greedy", "sampled"] and profile["endpoints"] == ["chat", "completions"]


def test_every_agent_request_is_marked_on_the_wire(served):
    eng, agent, _, relay, _ = served
    posts = relay.posts()
    assert posts and all(p["warmup"] == "true" and p["request_id"].startswith("warmup-") for p in posts)
    # warmup + probes + 3 questions (chat? completions? token ids?) + the one retry
    # after the server refused ignore_eos.
    assert len(posts) == agent.driver.warmup_requests + len(agent.probes) + 3 + 1
    # Both families reached the server as sent, on both APIs; a warmup call answers
    # prewarm.warm_answer_tokens (2: the fewest that take the decode path).
    bodies = [json.loads(p["body"]) for p in posts]
    answer = agent.cfg.prewarm.warm_answer_tokens
    assert answer == 2
    for path in ("/v1/chat/completions", "/v1/completions"):
        sent = [b for p, b in zip(posts, bodies, strict=True) if p["path"] == path]
        assert any(b.get("temperature") == 0.7 and b.get("top_p") == 0.9 and b["max_tokens"] == answer for b in sent)
        assert any(b.get("temperature") == 0.0 for b in sent)


def wire_requests(relay, model_dir: str) -> list[tuple[str, int, dict]]:
    """(path, prompt tokens, body) of every warmup and probe request the relay saw, in
    order (not the "Hello" questions before warmup); lengths by transformers' own
    apply_chat_template and tokenizer, not the agent's renderer."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for p in relay.posts():
        b = json.loads(p["body"])
        if p["path"] == "/v1/chat/completions" and b["messages"][0]["content"] != "Hello":
            ids = tok.apply_chat_template(b["messages"], tokenize=True, add_generation_prompt=True)
            out.append((p["path"], len(ids["input_ids"] if hasattr(ids, "keys") else ids), b))
        elif p["path"] == "/v1/completions" and isinstance(b["prompt"], str) and b["prompt"] != "Hello":
            out.append((p["path"], len(tok(b["prompt"], add_special_tokens=False)["input_ids"]), b))
    return out


def test_prompts_have_exact_token_lengths_by_the_models_own_template(served, embedded_model):
    """Checked with transformers' own apply_chat_template, not the agent's renderer."""
    wire = wire_requests(served[3], embedded_model)
    chat = [n for path, n, _ in wire if path == "/v1/chat/completions"]
    text = [n for path, n, _ in wire if path == "/v1/completions"]
    # the profile's lengths, the per-length test's, the decode-coverage tiles, the settle
    # waves' short prompts and the probes'
    warmup = agent_warmup(served)
    probe_len = warmup["probe_length"]
    assert probe_len not in set(LENGTHS)                # a length no warmup used
    # the per-length test's fresh lengths are the probes' (a second where the first pair was cold)
    lengths = warmup["per_length"]["lengths"]
    assert lengths[-1] == probe_len and len(lengths) in (1, 2) and not set(lengths) & set(LENGTHS)
    assert chat and set(chat) <= (set(LENGTHS) | {probe_len} | set(warmup["per_length"]["lengths"])
                                  | set(warmup["decode_coverage"]["tiles"]) | {warmup["settle_prompt_tokens"]})
    assert probe_len in chat                          # probes are chat requests
    assert text and set(text) <= set(LENGTHS)


def test_the_decode_reach_the_first_answer_is_predicted_from_is_what_went_over_the_wire(served, embedded_model):
    """cold_decode's bookkeeping (prompt, prompt + answer per warmup request) against
    the relay's record of the requests, lengths counted by transformers' own template.
    On the wire after the warmup: the gate's probes (the warmup's last requests replayed
    between the first probe and its control where they were a harder predecessor), then
    the ready stage's settle request (short, 1 token) just before SERVING."""
    from warmup_agent.stages import ready
    _, agent, _, relay, _ = served
    ctx = agent.context
    ready_detail = agent.stages[-1].detail
    wire = [(n, n + b["max_tokens"]) for _, n, b in wire_requests(relay, embedded_model)]
    probes = len(agent.probes)
    settle = ready_detail["settle_requests"]
    replayed = sum(p["replayed_requests"] for p in ready_detail["first_probe_pairs"])
    settle_tokens = agent_warmup(served)["settle_prompt_tokens"]
    short = (settle_tokens, settle_tokens + 1)
    assert settle == 1 and wire[-settle:] == [short]
    pays = agent_warmup(served)["per_length"]["pays"]
    if pays:
        # (rare on the CPU) the gate's pair is a new one after decode coverage: every probe,
        # the discarded pair's too, is at the probes' length, and none is a warmup range
        assert sum(1 for n, _ in wire if n == ctx.probe_length) == probes
        assert all(a != ctx.probe_length for a, _ in ctx.decoded_ranges)
    else:
        # between the probes: the replays before controls and, where the first fresh length
        # paid in prefill, the length ladder and its settle request
        ladder = agent_warmup(served)["per_length"]["ladder"]
        between = replayed + len(ladder) + bool(ladder)
        tail = wire[-(probes + between + settle):-settle]
        # the first pairs (prewarm's per-length test: one, or two at fresh lengths where the
        # first was cold) answer prewarm.per_length_tokens, the probes after them
        # readiness.probe_max_tokens (4 here), at the last pair's length
        expected = [(n, n + ctx.cfg.prewarm.per_length_tokens) for n in agent_warmup(served)["per_length"]["lengths"]
                    for _ in range(2)]
        expected += [(ctx.probe_length, ctx.probe_length + 4)] * (probes - len(expected))
        assert [r for r in tail if r in set(expected)] == expected
        others = [r for r in tail if r not in set(expected)]
        assert len(others) == between and [n for n, _ in others if (n, n + 1) in {(m, m + 1) for m in ladder}] == ladder
        warmup = wire[:-(probes + between + settle)] + others + wire[-settle:]
        assert sorted(set(warmup)) == sorted(set(ctx.decoded_ranges))     # batch 2 sends a range twice
    assert short in ctx.decoded_ranges                                        # prewarm's settle request
    assert ctx.profile_lengths == LENGTHS
    # The prediction is wired exactly where the per-length test found that decode pays.
    predict = ready.cold_decode_of(ctx)
    assert (predict is not None) == pays
    record = agent.record()
    assert (record["first_request_cold_decode"] is not None) <= pays
    # the exported pair's first probe's whole answer less its control's, over the steady whole answer
    gate = len(agent.probe_log.gate_probes)     # after a discarded first pair (pays), the gate's own
    totals = agent.probe_totals[ready_detail["probes"] - gate:ready_detail["probes"]]
    first = exported_pair(ready_detail, agent.stages[1].detail)
    assert record["first_probe_total_tax_ratio"] == pytest.approx(controlled_tax(totals, first), rel=1e-12)


def agent_warmup(served) -> dict:
    return served[1].stages[1].detail["warmup"]


def test_exported_decode_window_and_taxes_are_the_exact_figures(served):
    eng, agent, _, _, _ = served
    reg = agent.metrics.registry
    tpots = agent.probe_log.decode.values()
    gate = agent.stages[-1].detail["probes"]
    assert len(tpots) == len(agent.probes) == gate >= 2
    for q, label in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        exact = float(np.quantile(np.array(tpots), q, method="inverted_cdf"))
        assert reg.get_sample_value("warmup_time_per_output_token_window_seconds", {"percentile": label}) == exact
    totals = agent.probe_totals[:gate]
    # the first pair and any later probes each answered as many tokens as the others of its kind:
    # whole answers compare directly, the exported pair's first probe's less its control's, over the median of the probes
    # after that first; unless decode read "pays per length" on the shared cores (then the
    # prediction is exported)
    predicted = agent.probe_log.figures.cold_decode
    first = exported_pair(agent.stages[-1].detail, agent.stages[1].detail)
    assert reg.get_sample_value("warmup_first_request_total_tax_ratio") == pytest.approx(
        predicted["total_tax"] if predicted else controlled_tax(totals, first), rel=1e-12)
    # A probe's times against the wall clock around it: the first token comes
    # before the end, the end before the call returned; TPOT is the rest per token.
    t0 = time.perf_counter()
    ttft = agent.context.probe()
    wall = time.perf_counter() - t0
    total = agent.probe_totals[-1]
    assert 0 < ttft < total <= wall
    assert agent.probe_log.decode.values()[-1] == pytest.approx((total - ttft) / 3, rel=1e-9)   # 4 tokens out


def test_outside_clients_first_chat_request_is_answered(served):
    _, agent, state, _, port = served
    assert state == State.SERVING
    body = {"model": agent.engine.model, "messages": [{"role": "user", "content": "What is a warm start?"}],
            "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        events = [json.loads(l[5:]) for l in r.read().splitlines() if l.startswith(b"data:") and b"[DONE]" not in l]
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))
    assert text


def test_first_request_tax_on_time_to_first_token_is_exported_exactly(served):
    """1 + (the exported pair's first probe - its control, never below 0) / median TTFT of
    the probes after that first."""
    _, agent, _, _, _ = served
    reg = agent.metrics.registry
    figures = agent.probe_log.figures
    probes = agent.probes[:agent.stages[-1].detail["probes"]]
    first = exported_pair(agent.stages[-1].detail, agent.stages[1].detail)
    assert figures.ttft_seconds == probes[first] and figures.control is not None
    assert figures.control.ttft == probes[first + 1]
    assert reg.get_sample_value("warmup_first_request_tax_ratio") == pytest.approx(
        controlled_tax(probes, first), rel=1e-12)


def test_requests_file_profile_warms_its_families_and_skips_what_the_server_refuses(tmp_path, embedded_model):
    """A gateway log with chat only: sampled, penalties, stop and top_k (which
    transformers serve refuses: 'Unexpected fields').  The agent warms chat only,
    each family it accepts at each batch size, records top_k as refused, serves.
    Discovery asks only the API the file uses."""
    chat = lambda c, **kw: json.dumps({"model": "m", "messages": [{"role": "user", "content": c}], "max_tokens": 3, **kw})  # noqa: E731
    log = tmp_path / "requests.jsonl"
    log.write_text("\n".join([chat("bazo kite lumo", temperature=0.7, top_p=0.9),
                              chat("rasivu tenapo", temperature=0.7, presence_penalty=0.5),
                              chat("kite lumo", temperature=0, stop=["\n\n"]),
                              chat("lumo", temperature=0.7, top_k=20)]) + "\n")
    port = free_port()
    relay = Relay(port)
    cfg = config.load(env={"WARMUP_AGENT_DATA_DIR": str(tmp_path / "data"), "WARMUP_AGENT_ENGINE": "openai",
                           "WARMUP_AGENT_MODEL_PATH": embedded_model, "WARMUP_AGENT_OPENAI_URL": relay.url,
                           "WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "300",
                           # about families, not the budget: 0.3 x a CPU start-up runs out on busy cores
                           "WARMUP_AGENT_PREWARM_BUDGET_SECONDS": "300",
                           "WARMUP_AGENT_PREWARM_REQUESTS_FILE": str(log),
                           "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[24]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1, 2]",
                           "WARMUP_AGENT_READINESS_PROBE_MAX_TOKENS": "3", "WARMUP_AGENT_READINESS_PROBE_PROMPT_LENGTH": "20",
                           "WARMUP_AGENT_READINESS_MIN_PROBES": "4", "WARMUP_AGENT_READINESS_TPOT_CONVERGENCE_RATIO": "4",
                           "WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "0"})
    eng = openai_engine(cfg, server_command=ts.server_command(embedded_model, port),
                       base_env=ts.server_env(str(tmp_path)), model_path=embedded_model)
    try:
        agent = Agent(cfg, eng)
        state = agent.run()
        agent.stop()
        assert state == State.SERVING, (agent.sm.failure_reason, agent.sm.failure_message)
        profile = agent.stages[1].detail["profile"]
        assert profile["endpoints"] == ["chat"] and profile["max_tokens"] == 3 and profile["requests_seen"] == 4
        assert profile["families"] == ["penalties", "sampled", "stop"]
        assert "top_k" in profile["refused_families"] and "Unexpected fields" in profile["refused_families"]["top_k"]
        # a warmup call answers prewarm.warm_answer_tokens (2, under the file's longest answer of 3)
        answer = cfg.prewarm.warm_answer_tokens
        assert answer == 2
        warm = [json.loads(p["body"]) for p in relay.posts()
                if p["path"] == "/v1/chat/completions" and json.loads(p["body"])["max_tokens"] == answer]
        # each accepted family warmed (at batch 1: its decode path)
        assert sum(b.get("presence_penalty") == 0.5 for b in warm) >= 1
        assert sum(b.get("stop") == ["\n\n"] for b in warm) >= 1
        paths = {p["path"]: p for p in agent.stages[1].detail["paths"]}
        assert any(name.startswith("chat/top_k/") and p["result"] == "skipped" and "refuses" in p["reason"]
                   for name, p in paths.items()) or "top_k" in profile["refused_families"]
        # the file's traffic is chat only: /v1/completions is neither warmed nor even asked
        assert not [p for p in relay.posts() if p["path"] == "/v1/completions"]
        assert agent.stages[1].detail["profile"]["capabilities"]["apis"] == ["chat"]
    finally:
        eng.close()
        relay.stop()


def test_probes_after_serving_ask_for_one_token(served):
    """The watch probes after SERVING time the first token only: decoding
    readiness.probe_max_tokens on every one of them took 12.5 % of a
    transformers-serve H200 pod's engine time and kept WarmupAgentCostRatioHigh
    firing on a healthy pod (bench/results/gpu_acceptance_h200_run2.json)."""
    import time
    eng, agent, state, relay, _ = served
    assert state == State.SERVING
    from warmup_agent.readiness import golden
    before = len(relay.posts())

    def probes() -> list[dict]:
        # the golden answers asked once at the watch's start (readiness/golden.py) are not probes
        sent = [json.loads(p["body"]) for p in relay.posts()[before:]]
        return [b for b in sent if b.get("prompt") not in golden.PROMPTS]
    agent.watch(0.05)                # the fixture stopped the agent; watch again for a moment
    deadline = time.monotonic() + 60
    while len(probes()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    agent.stop()
    after = probes()
    assert len(after) >= 2, "the watch sent probes"
    assert all(b["max_tokens"] == 1 for b in after), [b["max_tokens"] for b in after]
    # The probes before SERVING asked for readiness.probe_max_tokens (decode timed).
    assert agent.probe_log.decode.quantiles((0.5,)), "the gate's probes timed decode"


def test_startupz_and_metrics_say_what_was_warmed_and_the_per_length_finding(served):
    """/startupz's warmup summary is the record's; the exported figures are the record's."""
    _, agent, _, _, _ = served
    detail = agent.stages[1].detail
    assert agent.status()["warmup"] == detail["warmup"]
    reg = agent.metrics.registry
    per_length = detail["warmup"]["per_length"]
    assert reg.get_sample_value("warmup_per_length_decode_ratio") == min(per_length["ratios"])
    remedy = [m for m in reg.collect() if m.name == "warmup_per_length_remedy_info"][0].samples
    assert bool(remedy) == per_length["pays"]          # a series only when the server pays per length
    assert reg.get_sample_value("warmup_budget_seconds") == detail["warmup"]["budget"]["seconds"]
    assert reg.get_sample_value("warmup_budget_spent_seconds") == detail["warmup"]["budget"]["spent_seconds"] > 0
    counts: dict[str, int] = {}
    for p in detail["paths"]:
        counts[p["result"]] = counts.get(p["result"], 0) + 1
    for result in ("warm_on_first_call", "converged", "still_improving", "skipped"):
        assert reg.get_sample_value("warmup_paths", {"result": result}) == counts.get(result, 0)


def test_promtool_finds_nothing_to_fix_in_the_openai_scrape(served):
    """The series only a served profile exports (paths, budget, per-length finding)
    pass `promtool check metrics`: a gauge named `_total` (warmup_paths_total, flagged
    on the H200 acceptance run) fails it."""
    _, agent, _, _, _ = served
    import subprocess

    import prometheus_client
    text = prometheus_client.generate_latest(agent.metrics.registry).decode()
    assert "warmup_paths{" in text and "warmup_budget_seconds" in text
    r = subprocess.run([require_binary("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def no_budget_agent(tmp_path, model: str, lengths: list[int]):
    """(config, engine) of an agent over `transformers serve` whose warmup budget is
    smaller than one request: nothing is warmed, the probes still gate SERVING."""
    cfg = config.load(env={"WARMUP_AGENT_DATA_DIR": str(tmp_path / "data"), "WARMUP_AGENT_ENGINE": "openai",
                           "WARMUP_AGENT_MODEL_PATH": model,
                           "WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "300",
                           "WARMUP_AGENT_PREWARM_BUDGET_SECONDS": "0.000001",
                           "WARMUP_AGENT_PREWARM_BEHIND_USERS": "false",
                           "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": json.dumps(lengths),
                           "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
                           "WARMUP_AGENT_PREWARM_MAX_OUTPUT_TOKENS": "4",
                           "WARMUP_AGENT_READINESS_PROBE_MAX_TOKENS": "4",
                           "WARMUP_AGENT_READINESS_TPOT_CONVERGENCE_RATIO": "4",
                           "WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "0"})
    eng = openai_engine(cfg, server_command=ts.server_command(model, free_port()),
                       base_env=ts.server_env(str(tmp_path)), model_path=model)
    return cfg, eng


def test_a_budget_that_runs_out_skips_paths_and_the_probes_still_decide(tmp_path, embedded_model, caplog):
    """prewarm.budget_seconds smaller than one request: every path is skipped with
    reason budget, one warning says so, and the readiness probes still gate SERVING
    (the first-request figures then show what was left cold)."""
    cfg, eng = no_budget_agent(tmp_path, embedded_model, LENGTHS)
    try:
        agent = Agent(cfg, eng)
        with caplog.at_level("WARNING", logger="warmup_agent.stages.prewarm"):
            state = agent.run()
        agent.stop()
        assert state == State.SERVING, (agent.sm.failure_reason, agent.sm.failure_message)
        detail = agent.stages[1].detail
        # every path skipped for the budget; the probe family's lengths are skipped with what
        # the per-length test (the gate's first probe pair, sent whatever the budget) said
        per_length = detail["warmup"]["per_length"]
        short = [p for p in detail["paths"] if p["reason"] != "budget"]
        assert sorted(int(p["path"].rsplit("/len", 1)[1]) for p in short) == sorted(LENGTHS)
        assert len({p["path"].rsplit("/len", 1)[0] for p in short}) == 1       # one path: the probes'
        assert all(p["reason"] == profile_warmup.length_skip_reason(per_length) is not None for p in short)
        assert all(p["result"] == "skipped" and p["reason"] == "budget" and p["calls"] == 0
                   for p in detail["paths"] if p not in short)
        assert all(p["calls"] == 0 for p in short) and len(detail["paths"]) > len(short)
        # no path sent, so discovery's short request stands in for prewarm's settle request:
        # the only warmup requests are a settle request before the first probe's control
        # (its first followed discovery's) and the ready stage's before SERVING, all in the record
        ready = agent.stages[-1].detail
        replayed = sum(p["replayed_requests"] for p in ready["first_probe_pairs"])
        assert detail["warmup"]["settle_requests"] == 0 and ready["settle_requests"] == 1 and replayed >= 1
        assert detail["warmup"]["settled_by_discovery"] is True
        assert agent.driver.warmup_requests == requests_in_record(detail, ready) == 1 + replayed
        # no anchor pair: the probe pair alone cannot say that decode pays per length; a
        # second pair follows only where the first was cold
        assert per_length["tested"] and "anchor_pair" not in per_length
        assert per_length["pays"] is False or len(per_length["pairs"]) == 2
        assert detail["warmup"]["budget"]["exhausted"] is True
        assert any("warmup budget" in r.getMessage() and "not warmed" in r.getMessage() for r in caplog.records)
        assert len(agent.probes) >= cfg["readiness.min_probes_server"]
        assert agent.probe_log.figures is not None and agent.probe_log.figures.ttft_tax is not None
    finally:
        eng.close()


def test_a_server_engines_gpu_ramp_starts_once_the_server_is_healthy(tmp_path, embedded_model, monkeypatch):
    """The ramp measures warmup traffic; a server's own start-up is not warmup, and NVML
    read every 50 ms beside its CUDA start buys nothing (stages/prewarm.py). The sampler
    itself needs a GPU: here the call is checked for when it happens."""
    cfg, eng = no_budget_agent(tmp_path, embedded_model, [24])
    seen: list[float | None] = []
    real = prewarm._start_ramp
    monkeypatch.setattr(prewarm, "_start_ramp", lambda ctx: (seen.append(eng.server_start_seconds), real(ctx))[1])
    try:
        agent = Agent(cfg, eng)
        state = agent.run()
        agent.stop()
        assert state == State.SERVING, (agent.sm.failure_reason, agent.sm.failure_message)
        assert len(seen) == 1 and seen[0] is not None and seen[0] > 0, seen   # after the server's first 200
    finally:
        eng.close()
