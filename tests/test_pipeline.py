"""The four stages on the embedded model, in process: measurement truth."""
import json
import threading
import time
import urllib.request

import pytest

from exporter.collectors import register_default_collectors
from exporter.metrics import AgentMetrics
from exporter.server import ExporterServer
from tests.helpers.warmup_record import controlled_tax, exported_pair
from warmup_agent import config
from warmup_agent.engines.torch.engine import TorchEngine
from warmup_agent.pipeline import STAGES, Agent
from warmup_agent.states import State

FAST = {"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8, 32]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1, 2]",
        "WARMUP_AGENT_READINESS_MIN_PROBES": "5"}


def make_agent(model_path, env=None, metrics=None):
    cfg = config.load(env={**FAST, **(env or {})})
    return Agent(cfg, TorchEngine(model_path, dtype=cfg["model.dtype"], device=cfg["model.device"]),
                 metrics=metrics or AgentMetrics())


@pytest.fixture(scope="module")
def served(embedded_model):
    """One agent run to SERVING with its exporter up; wall clock measured around run()."""
    import torch  # noqa: F401 - import cost outside the measured window, as in a process that started
    metrics = AgentMetrics()
    register_default_collectors(metrics.registry)
    agent = make_agent(embedded_model, metrics=metrics)
    server = ExporterServer(agent, metrics.registry, "127.0.0.1", 0).start()
    at_serving = []
    agent.sm.on_change(lambda frm, to: at_serving.append(time.perf_counter()) if to == State.SERVING else None)
    t0 = time.perf_counter()
    state = agent.run()
    wall = at_serving[0] - t0   # wall clock from the call to the SERVING transition
    yield agent, server, state, wall
    server.stop()
    agent.stop()


def get(server, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_reaches_serving_through_the_four_stages_in_order(served):
    agent, _, state, _ = served
    assert state == State.SERVING
    assert [s.name for s in agent.stages] == list(STAGES)
    assert [s for s, _ in agent.sm.history] == [State.INIT, State.PRELOAD, State.PRIME, State.SERVING]
    assert all(s.status == "ok" for s in agent.stages)


def test_stage_durations_add_up_to_wall_clock_within_2_percent(served):
    agent, _, _, wall = served
    total = sum(s.duration for s in agent.stages)
    assert abs(total - wall) <= 0.02 * wall, (total, wall)
    # contiguous: each stage starts where the previous ended
    for a, b in zip(agent.stages, agent.stages[1:], strict=False):
        assert b.start == pytest.approx(a.end, abs=1e-9)
    assert agent.record()["time_to_ready_seconds"] == pytest.approx(total, rel=0.01)


def test_warmup_traffic_covers_the_grid_and_is_counted(served):
    agent, _, _, _ = served
    # grid [8, 32] x [1, 2]: every shape at least once, each until warm (measured
    # benefit, warmup_agent/warmup/shapes.py): the first shape at least twice
    paths = next(s for s in agent.stages if s.name == "prewarm").detail["paths"]
    assert [p["path"] for p in paths] == ["generate/greedy/batch1/len8", "generate/greedy/batch1/len32",
                                          "generate/greedy/batch2/len8", "generate/greedy/batch2/len32"]
    assert all(p["calls"] >= 1 for p in paths) and paths[0]["calls"] >= 2
    calls = sum(p["calls"] for p in paths)
    prompts = sum(p["calls"] * (1 if "batch1" in p["path"] else 2) for p in paths)
    # the last shape re-sent before the first probe's control, where it was a harder predecessor
    pairs = agent.stages[-1].detail["first_probe_pairs"]
    replayed = sum(p["replayed_requests"] for p in pairs)
    calls += sum(1 for p in pairs if p["replayed_requests"])
    prompts += replayed
    assert agent.driver.warmup_requests == prompts
    assert agent.metrics.registry.get_sample_value("warmup_requests_total", {"kind": "warmup"}) == prompts
    assert agent.metrics.registry.get_sample_value("warmup_requests_total", {"kind": "probe"}) == len(agent.probes)
    assert agent.metrics.registry.get_sample_value("warmup_first_token_latency_seconds_count", {"kind": "warmup"}) == calls


def test_window_quantile_gauges_equal_exact_quantiles_of_the_probes(served):
    import numpy as np
    agent, _, _, _ = served
    for q in (0.5, 0.9, 0.99):
        exact = float(np.quantile(np.array(agent.probes), q, method="inverted_cdf"))
        label = {0.5: "p50", 0.9: "p90", 0.99: "p99"}[q]
        assert agent.metrics.registry.get_sample_value("warmup_first_token_window_seconds", {"percentile": label}) == exact


def test_startupz_agrees_with_metrics(served):
    agent, server, _, _ = served
    code, body = get(server, "/startupz")
    assert code == 200
    status = json.loads(body)
    from prometheus_client.parser import text_string_to_metric_families
    _, text = get(server, "/metrics")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert status["state"] == "SERVING"
    assert samples[("warmup_state", (("state", "SERVING"),))] == 1.0
    for name, st in status["stages"].items():
        assert samples[("model_loading_phase_duration_seconds", (("phase", name),))] == pytest.approx(st["duration_seconds"], rel=1e-9)
    assert samples[("warmup_time_to_ready_seconds", ())] == pytest.approx(status["time_to_ready_seconds"], rel=1e-9)
    for q, v in status["first_token_window_seconds"].items():
        assert samples[("warmup_first_token_window_seconds", (("percentile", q),))] == pytest.approx(v)
    assert get(server, "/readyz")[0] == 200 and get(server, "/healthz")[0] == 200


def test_memory_jitter_gauge_matches_its_samples(served):
    import psutil
    agent, _, _, _ = served
    agent.memory.stop()  # freeze the window so the gauge and this test see the same samples
    samples = agent.memory.samples()
    assert len(samples) >= 2, "sampled every 100 ms through the warmup"
    independent = (max(samples) - min(samples)) / (sum(samples) / len(samples))
    assert agent.metrics.registry.get_sample_value("warmup_memory_jitter_ratio") == pytest.approx(independent, rel=1e-12)
    # the samples are this process's RSS, as psutil reads it independently
    assert agent.memory.sample() == pytest.approx(psutil.Process().memory_info().rss, rel=0.05)


def test_cost_ratio_is_engine_seconds_over_uptime(served):
    agent, _, _, _ = served
    busy = sum(agent.metrics.registry.get_sample_value("warmup_engine_seconds_total", {"kind": k}) or 0
               for k in ("warmup", "solidify", "probe"))
    before = agent.clock() - agent.started
    ratio = agent.metrics.registry.get_sample_value("warmup_cost_ratio")
    after = agent.clock() - agent.started
    assert busy / after <= ratio <= busy / before
    assert 0 < ratio < 1


def test_fingerprint_mismatch_never_serves(embedded_model):
    agent = make_agent(embedded_model)
    real = agent.engine.weight_fingerprint
    calls = {"n": 0}

    def tampered():
        calls["n"] += 1
        if calls["n"] == 2:  # the re-check before SERVING: change a weight in memory first
            import torch
            with torch.no_grad():
                next(agent.engine.model.parameters()).add_(1.0)
        return real()
    agent.engine.weight_fingerprint = tampered
    assert agent.run() == State.FAILED
    assert agent.sm.failure_reason == "weight_fingerprint_mismatch"
    assert State.SERVING not in [s for s, _ in agent.sm.history]


def test_readiness_thresholds_not_met_fails_with_reason(embedded_model):
    agent = make_agent(embedded_model, env={"WARMUP_AGENT_READINESS_P50_THRESHOLD_SECONDS": "0.000001",
                                            "WARMUP_AGENT_READINESS_P90_THRESHOLD_SECONDS": "0.000001",
                                            "WARMUP_AGENT_READINESS_MAX_PROBES": "8"})
    assert agent.run() == State.FAILED
    assert agent.sm.failure_reason == "readiness_thresholds_not_met"
    assert len(agent.probes) == 8
    assert agent.metrics.registry.get_sample_value("model_loading_failures_total", {"reason": "readiness_thresholds_not_met"}) == 1


def test_preload_deadline_fails_the_run(embedded_model):
    """PRELOAD's deadline fails the run, and no machine is fast enough to meet it:
    the first thing PRELOAD does, loading the weights, waits until the state machine
    has failed.  Were the deadline not enforced, the wait would end after 60 s, the
    run would go on to SERVING, and the test would fail."""
    agent = make_agent(embedded_model, env={"WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "0.1"})
    failed = threading.Event()
    agent.sm.on_change(lambda frm, to: failed.set() if to == State.FAILED else None)
    load_weights, waited = agent.engine.load_weights, []

    def load_weights_after_the_failure() -> None:
        waited.append(failed.wait(timeout=60))
        load_weights()
    agent.engine.load_weights = load_weights_after_the_failure
    assert agent.run() == State.FAILED
    assert waited == [True], "PRELOAD's deadline did not fail the run while the weights loaded"
    assert agent.sm.failure_reason == "preload_deadline_exceeded"
    assert agent.stages[-1].name == "prewarm" and agent.stages[-1].status == "failed"
    assert agent.metrics.registry.get_sample_value("warmup_state_deadline_exceeded_total", {"state": "PRELOAD"}) == 1


def test_first_request_tax_gauge_is_the_first_probe_less_its_control_over_median_of_the_rest(served):
    """1 + (first probe - its control, never below 0) / median of the probes after the first (readiness/probes.py)."""
    agent, _, _, _ = served
    probes = agent.probes[:agent.stages[-1].detail["probes"]]   # the gate's probes, before any watch probe
    expected = controlled_tax(probes, exported_pair(agent.stages[-1].detail))
    assert agent.metrics.registry.get_sample_value("warmup_first_request_tax_ratio") == pytest.approx(expected, rel=1e-12)


def test_reserve_steps_are_in_the_record_and_the_metrics(served):
    """Stage 1's sub-steps (issue 13): each in the run record and as
    warmup_reserve_step_duration_seconds{step} with the same value; together
    no longer than the stage.  On a CPU host there is no CUDA step."""
    agent, _, _, _ = served
    reserve = next(s for s in agent.record()["stages"] if s["name"] == "reserve")
    steps = reserve["steps_seconds"]
    assert {"host_facts", "model_check"} <= set(steps) and not {"cuda_init", "cuda_context"} & set(steps)
    reg = agent.metrics.registry
    for name, seconds in steps.items():
        assert reg.get_sample_value("warmup_reserve_step_duration_seconds", {"step": name}) == pytest.approx(seconds, abs=1e-6)
    assert 0 < sum(steps.values()) <= reserve["duration_seconds"]


def test_reserve_step_is_logged(caplog):
    import logging
    from types import SimpleNamespace

    from exporter.recorder import Recorder
    from warmup_agent.stages.reserve import Steps
    metrics = AgentMetrics()
    detail = {}
    with caplog.at_level(logging.INFO, logger="warmup_agent.coldstart"):
        with Steps(SimpleNamespace(recorder=Recorder(metrics)), detail)("torch_import"):
            time.sleep(0.01)
    assert detail["steps_seconds"]["torch_import"] >= 0.01
    assert any("[COLDSTART] phase1 reserve step step=torch_import duration=" in r.getMessage() for r in caplog.records)


def test_the_torch_engine_warms_the_prompt_lengths_of_the_requests_file(tmp_path, embedded_model):
    """Issue 41: an in-process engine serving users warms the lengths its users send
    (prewarm.requests_file, templated), so solidify captures a prefill for them and a
    user's prompt pads up to a warmed length.  The lengths are counted here with
    transformers' own chat template, independently of the agent's counter."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(embedded_model)
    words = "the warmed model answers every user the same way on the first request and the thousandth "
    bodies = [{"messages": [{"role": "user", "content": (words * k).strip()}], "max_tokens": 4} for k in (2, 5)]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    expected = {len(tok(tok.apply_chat_template(b["messages"], add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)["input_ids"]) for b in bodies}
    assert not expected & {8, 32}                       # lengths the grid would not have warmed anyway
    agent = make_agent(embedded_model, env={"WARMUP_AGENT_PREWARM_REQUESTS_FILE": str(path)})
    try:
        assert agent.run() == State.SERVING
        prewarm = next(s for s in agent.stages if s.name == "prewarm")
        assert set(prewarm.detail["lengths"]) == {8, 32} | expected
        assert {n for n, _ in agent.context.warmed_shapes} >= expected
    finally:
        agent.stop()
