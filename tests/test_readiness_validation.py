"""Three-dimensional validation before SERVING, on the real embedded model.

Each broken model is a real TorchEngine whose loaded model was damaged after
loading (what a bad patch, a bad adapter or bad hardware does in memory); the
agent must end FAILED with the named reason, never SERVING."""
import json

import pytest
import torch

from exporter.metrics import AgentMetrics
from warmup_agent import config
from warmup_agent.engines.torch.engine import TorchEngine
from warmup_agent.pipeline import Agent
from warmup_agent.states import State

FAST = {"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
        "WARMUP_AGENT_READINESS_MIN_PROBES": "5"}


class NaNLogitsEngine(TorchEngine):
    """The embedded model with one lm_head weight set to NaN after loading."""

    def load_weights(self):
        super().load_weights()
        with torch.no_grad():
            self.model.lm_head.weight[7, 0] = float("nan")


class HugeLogitsEngine(TorchEngine):
    """The embedded model with lm_head scaled 1e6x after loading: finite but absurd logits."""

    def load_weights(self):
        super().load_weights()
        with torch.no_grad():
            self.model.lm_head.weight.mul_(1e6)


class StrayParameterEngine(TorchEngine):
    """The embedded model with a parameter config.json knows nothing about."""

    def load_weights(self):
        super().load_weights()
        self.model.register_parameter("stray", torch.nn.Parameter(torch.zeros(3)))


def run(model, engine_cls=TorchEngine, env=None):
    cfg = config.load(env={**FAST, **(env or {})})
    agent = Agent(cfg, engine_cls(model, dtype=cfg["model.dtype"], device=cfg["model.device"]), metrics=AgentMetrics())
    state = agent.run()
    agent.stop()
    return agent, state


def sample(agent, name, labels=None):
    return agent.metrics.registry.get_sample_value(name, labels or {})


def test_healthy_model_passes_and_records_a_baseline_that_a_second_run_is_compared_with(embedded_model, tmp_path):
    path = tmp_path / "baseline.json"
    agent, state = run(embedded_model, env={"WARMUP_AGENT_VALIDATION_BASELINE_FILE": str(path)})
    assert state == State.SERVING
    v = agent.stages[-1].detail["validation"]
    assert v["structure"]["result"] == "passed" and v["numerics"]["result"] == "passed"
    # structure: independent parameter count of the loaded model
    assert v["structure"]["parameters"] == sum(p.numel() for p in agent.engine.model.parameters())
    assert v["performance"]["result"] == "recorded"
    entries = json.loads(path.read_text())
    assert len(entries) == 1
    (entry,) = entries.values()
    assert entry["p50_seconds"] == agent.readiness.window.quantile(0.5)
    for check, result in (("structure", "passed"), ("numerics", "passed"), ("performance", "recorded")):
        assert sample(agent, "warmup_validation_checks_total", {"check": check, "result": result}) == 1
    assert sample(agent, "warmup_validation_checks_total", {"check": "numerics", "result": "failed"}) == 0

    # A baseline 1000x faster than anything this machine can do: performance fails by name.
    key = next(iter(entries))
    path.write_text(json.dumps({key: {"p50_seconds": entry["p50_seconds"] / 1000}}))
    agent2, state2 = run(embedded_model, env={"WARMUP_AGENT_VALIDATION_BASELINE_FILE": str(path)})
    assert state2 == State.FAILED and agent2.sm.failure_reason == "validation_performance"
    assert "1.2x" in agent2.sm.failure_message and str(path) in agent2.sm.failure_message
    assert sample(agent2, "model_loading_failures_total", {"reason": "validation_performance"}) == 1
    assert State.SERVING not in [s for s, _ in agent2.sm.history]


@pytest.mark.parametrize("engine_cls, reason, words", [
    (NaNLogitsEngine, "validation_numerics", "NaN or infinite"),
    (HugeLogitsEngine, "validation_numerics", "validation.logits"),
    (StrayParameterEngine, "validation_structure", "unexpected"),
])
def test_damaged_model_never_serves_and_fails_with_the_named_reason(embedded_model, engine_cls, reason, words):
    agent, state = run(embedded_model, engine_cls)
    assert state == State.FAILED
    assert agent.sm.failure_reason == reason and words in agent.sm.failure_message
    assert State.SERVING not in [s for s, _ in agent.sm.history]
    assert sample(agent, "model_loading_failures_total", {"reason": reason}) == 1
    check = reason.removeprefix("validation_")
    assert sample(agent, "warmup_validation_checks_total", {"check": check, "result": "failed"}) == 1


def test_validation_can_be_disabled(embedded_model):
    agent, state = run(embedded_model, StrayParameterEngine, env={"WARMUP_AGENT_VALIDATION_ENABLED": "false"})
    assert state == State.SERVING
    assert "validation" not in agent.stages[-1].detail


def test_bad_validation_config_is_one_line():
    with pytest.raises(config.ConfigError) as e:
        config.load(env={"WARMUP_AGENT_VALIDATION_LOGITS_MEAN_MIN": "6"})
    assert str(e.value) == ("configuration: key 'validation.logits_mean_min': got 6.0; "
                            "expected less than validation.logits_mean_max (5.0)")
    with pytest.raises(config.ConfigError) as e:
        config.load(env={"WARMUP_AGENT_BREAKER_TRIP_AFTER": "0"})
    assert "breaker.trip_after" in str(e.value) and "\n" not in str(e.value)
