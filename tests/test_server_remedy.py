"""openai.apply_server_remedy: auto (issue 71, item 4): a supervised server with a known
per-length remedy gets it from the start after one that measured it paying per length
without it, and keeps it only while steady decode is no slower with it.

The decision arithmetic is checked on its own; then a real `transformers serve` (CPU,
embedded model) is started twice on one data dir: the first start goes without the remedy
and keeps what it measured, the second (told by that file that the server paid) starts
the server with it, as its process environment shows, and keeps its own steady decode
beside the first one's."""
from __future__ import annotations

import json
import os

import psutil
import pytest

from tests.helpers import transformers_server as ts
from tests.helpers.engines import openai_engine
from tests.helpers.servers import free_port
from warmup_agent import config
from warmup_agent.config import ConfigError
from warmup_agent.pipeline import Agent
from warmup_agent.server.command import remedy_plan
from warmup_agent.states import State
from warmup_agent.warmup import remedy


def _tfserve(folder) -> list[str]:
    folder.mkdir(exist_ok=True)
    return ["transformers", "serve", str(folder), "--port", "8000"]
ENV = "TORCH_CUDNN_SDPA_DEPRIORITIZED"


def test_auto_waits_for_a_measured_per_length_cost_then_for_steady_decode():
    assert remedy.decide("auto", {}).apply is False                        # never measured
    assert remedy.decide("auto", {"pays": False}).apply is False           # measured: nothing to take away
    assert remedy.decide("auto", {"pays": True}).apply is True             # paid without it: try it
    kept = {"pays": True, "verdict": "no_slower", "steady_tpot_with": 0.0101, "steady_tpot_without": 0.0100}
    assert remedy.decide("auto", kept).apply is True
    slower = {**kept, "verdict": "slower", "steady_tpot_with": 0.013}
    d = remedy.decide("auto", slower)
    assert d.apply is False and "13.00 ms against 10.00 ms" in d.why
    assert remedy.decide("always", slower).apply is True and remedy.decide("never", kept).apply is False


def test_learning_compares_steady_decode_with_and_without():
    first = remedy.learn({}, applied=False, pays=True, decode_tpots=[0.010, 0.011, 0.012])
    assert first == {"pays": True, "steady_tpot_without": 0.011}
    within = remedy.learn(first, applied=True, pays=False, decode_tpots=[0.0112, 0.0115])
    assert within["verdict"] == "no_slower" and within["pays"] is True     # the finding without it is kept
    beyond = remedy.learn(first, applied=True, pays=False, decode_tpots=[0.0120])
    assert beyond["verdict"] == "slower"                                   # 1.09x: past SLOWER_RATIO
    assert remedy.learn(first, applied=True, pays=None, decode_tpots=[]) == first   # nothing timed: nothing said
    assert "verdict" not in remedy.learn({}, applied=True, pays=None, decode_tpots=[0.01])  # nothing to compare


def test_the_plan_reads_the_data_dirs_verdicts(tmp_path):
    TFSERVE = _tfserve(tmp_path / "m")
    assert remedy_plan(["llama-server", "-m", "x.gguf"], "always", str(tmp_path)).env == {}   # no remedy known
    plan = remedy_plan(TFSERVE, "auto", str(tmp_path))
    assert plan.env == {} and plan.key and "not measured" in (plan.why or "")
    remedy.RemedyMemory(str(tmp_path)).put(plan.key, {"pays": True})
    assert remedy_plan(TFSERVE, "auto", str(tmp_path)).env == {ENV: "1"}
    other = _tfserve(tmp_path / "other")
    assert remedy_plan(other, "auto", str(tmp_path)).env == {}            # another model: measured on its own
    (tmp_path / remedy.FILENAME).write_text("{not json")
    assert remedy_plan(TFSERVE, "auto", str(tmp_path)).env == {}          # unreadable: measured again, no failure


def test_the_older_boolean_reads_as_always_or_never(tmp_path):
    cfg = config.load(env={"WARMUP_AGENT_OPENAI_APPLY_SERVER_REMEDY": "true"})
    assert cfg.openai.apply_server_remedy == "always"
    f = tmp_path / "c.yaml"
    f.write_text("openai:\n  apply_server_remedy: false\n")
    assert config.load(str(f), env={}).openai.apply_server_remedy == "never"
    assert config.load(env={}).openai.apply_server_remedy == "auto"
    with pytest.raises(ConfigError, match="apply_server_remedy.*one of auto, always, never"):
        config.load(env={"WARMUP_AGENT_OPENAI_APPLY_SERVER_REMEDY": "sometimes"})


def _start(data_dir: str, scratch: str, model: str):
    cfg = config.load(env={"WARMUP_AGENT_DATA_DIR": data_dir, "WARMUP_AGENT_ENGINE": "openai",
                           "WARMUP_AGENT_MODEL_PATH": model,
                           "WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "300",
                           "WARMUP_AGENT_OPENAI_READY_TIMEOUT_SECONDS": "240",
                           "WARMUP_AGENT_OPENAI_DRAIN_SECONDS": "5",
                           "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[24]",
                           "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
                           "WARMUP_AGENT_PREWARM_MAX_OUTPUT_TOKENS": "4",
                           "WARMUP_AGENT_READINESS_PROBE_MAX_TOKENS": "4",
                           "WARMUP_AGENT_READINESS_TPOT_CONVERGENCE_RATIO": "4",
                           "WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "0"})
    eng = openai_engine(cfg, server_command=ts.server_command(model, free_port()), base_env=ts.server_env(scratch),
                        model_path=model)
    return Agent(cfg, eng), eng


def _remembered(data_dir: str) -> dict:
    with open(os.path.join(data_dir, remedy.FILENAME), encoding="utf-8") as f:
        entries = json.load(f)
    assert len(entries) == 1, entries
    return next(iter(entries.values()))


@pytest.mark.slow
@pytest.mark.skipif(not ts.available(), reason="needs transformers[serving] (make test-setup)")
def test_two_starts_of_transformers_serve_measure_then_apply_the_remedy(tmp_path, embedded_model):
    data = str(tmp_path / "data")
    agent, eng = _start(data, str(tmp_path), embedded_model)
    try:
        assert agent.run() == State.SERVING
        pid = eng.server.supervisor.pid
        assert ENV not in psutil.Process(pid).environ()                  # never measured: as the user wrote it
        detail = agent.stages[-1].detail["server_remedy"]
        per_length = agent.stages[1].detail["warmup"]["per_length"]
        decode = sorted(agent.probe_log.decode.values())
    finally:
        agent.stop()
        eng.close()
    first = _remembered(data)
    assert detail["applied"] is False and first["pays"] == per_length["pays"]
    assert first["steady_tpot_without"] == pytest.approx(decode[len(decode) // 2] if len(decode) % 2
                                                         else sum(decode[len(decode) // 2 - 1:][:2]) / 2)
    # As if the first had paid per length (on two CPU cores it seldom does): the next start tries the remedy.
    key = remedy_plan(eng.server.command, "auto", data).key
    assert key is not None
    remedy.RemedyMemory(data).put(key, {**first, "pays": True})
    agent, eng = _start(data, str(tmp_path), embedded_model)
    try:
        assert agent.run() == State.SERVING
        assert psutil.Process(eng.server.supervisor.pid).environ().get(ENV) == "1"
        assert agent.metrics.registry.get_sample_value("warmup_server_remedy_applied_info", {"remedy": f"{ENV}=1"}) == 1
        detail = agent.stages[-1].detail["server_remedy"]
    finally:
        agent.stop()
        eng.close()
    second = _remembered(data)
    assert detail["applied"] is True and second["steady_tpot_with"] > 0
    ratio = second["steady_tpot_with"] / second["steady_tpot_without"]
    assert second["verdict"] == ("no_slower" if ratio <= remedy.SLOWER_RATIO else "slower")
    assert remedy.decide("auto", second).apply is (second["verdict"] == "no_slower")


def test_a_start_with_the_remedy_measures_the_per_length_cost_again():
    """The per-length finding remembered without the remedy would skip the test that tells
    whether the remedy took the cost away: the remedy is part of the finding's key."""
    from warmup_agent.warmup.findings import server_key
    plain = server_key("transformers", "m", 1, ["NVIDIA H100"])
    assert plain == server_key("transformers", "m", 1, ["NVIDIA H100"], {})
    assert plain != server_key("transformers", "m", 1, ["NVIDIA H100"], {ENV: "1"})
