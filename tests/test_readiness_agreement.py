"""The run record and /metrics agree on the readiness thresholds in force (issue 17).

The record's `readiness_thresholds_seconds` and the scraped
`warmup_readiness_threshold_seconds` come from the same Readiness values, so they
agree whether the thresholds are static or re-fitted by readiness.adaptive; the
record also keeps the configured ceiling.  Each test scrapes a real ExporterServer
over HTTP and parses the exposition with prometheus_client's own parser.
"""
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.metrics import AgentMetrics
from exporter.server import ExporterServer
from tests.helpers.servers import http_get
from warmup_agent import config
from warmup_agent.engines.base import Engine
from warmup_agent.pipeline import Agent
from warmup_agent.states import State

P50, P90 = 0.85, 2.1


class NoEngine(Engine):
    """Never loaded or asked to generate: probes are fed through record_probe.
    An Engine subclass so the record reads the base's capability defaults."""
    name = "none"

    def _never(self, *args, **kwargs):
        raise AssertionError("never loaded or asked to generate in these tests")

    load_tokenizer = load_weights = facts = tokenize = generate = weight_fingerprint = _never


def scraped_thresholds(port: int) -> dict[str, float]:
    status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "warmup_readiness_threshold_seconds":
            out.update({s.labels["percentile"]: s.value for s in fam.samples})
    return out


@pytest.fixture
def served():
    """Build an agent for `env` and its exporter on a free port; stop both afterwards."""
    made = []

    def make(env: dict, engine=None) -> tuple[Agent, int]:
        agent = Agent(config.load(env=env), engine if engine is not None else NoEngine(), metrics=AgentMetrics())
        server = ExporterServer(agent, agent.metrics.registry, "127.0.0.1", 0).start()
        made.append((agent, server))
        return agent, server.port
    yield make
    for agent, server in made:
        agent.stop()
        server.stop()


ADAPTIVE = {"WARMUP_AGENT_READINESS_ADAPTIVE": "true", "WARMUP_AGENT_READINESS_ADAPTIVE_EVERY_SAMPLES": "5",
            "WARMUP_AGENT_READINESS_MIN_PROBES": "5", "WARMUP_AGENT_READINESS_ADAPTIVE_MARGIN": "2"}


def test_static_thresholds_agree_and_are_the_configured_ones(served):
    agent, port = served({})
    for ttft in (0.010, 0.012, 0.011):
        agent.context.record_probe(ttft)
    rec = agent.record()
    assert rec["readiness_thresholds_seconds"] == scraped_thresholds(port) == {"p50": P50, "p90": P90}
    assert rec["readiness_thresholds_configured_seconds"] == {"p50": P50, "p90": P90}


def test_adaptive_thresholds_in_force_agree_between_record_and_metrics(served):
    agent, port = served(ADAPTIVE)
    before = scraped_thresholds(port)
    assert before == agent.record()["readiness_thresholds_seconds"] == {"p50": P50, "p90": P90}
    # Ten probes through the agent's own path: two re-fits, to 2 x the observed quantiles.
    probes = [0.010, 0.020, 0.030, 0.040, 0.050, 0.012, 0.022, 0.032, 0.042, 0.052]
    for ttft in probes:
        agent.context.record_probe(ttft)
    assert agent.metrics.registry.get_sample_value("warmup_readiness_threshold_refits_total") == 2
    rec = agent.record()
    scraped = scraped_thresholds(port)
    # nearest-rank over the 10 samples: P50 is the 5th smallest, P90 the 9th
    want = {"p50": pytest.approx(2 * sorted(probes)[4]), "p90": pytest.approx(2 * sorted(probes)[8])}
    assert scraped == want
    assert rec["readiness_thresholds_seconds"] == scraped          # the record shows what /metrics shows
    assert rec["readiness_thresholds_seconds"] != {"p50": P50, "p90": P90}
    assert rec["readiness_thresholds_configured_seconds"] == {"p50": P50, "p90": P90}   # the ceiling is kept too
    # The gate judges against the same numbers.
    assert agent.readiness.thresholds_in_force() == rec["readiness_thresholds_seconds"]


def test_only_readiness_writes_the_window_and_threshold_gauges(served):
    """The window gauges follow the window after each sample, from readiness alone."""
    agent, port = served(ADAPTIVE)
    for ttft in (0.010, 0.030, 0.020):
        agent.context.record_probe(ttft)
        q = agent.readiness.window.quantiles()
        for label, quantile in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            got = agent.metrics.registry.get_sample_value("warmup_first_token_window_seconds", {"percentile": label})
            assert got == q[quantile]
    assert agent.readiness.window is agent.readiness.window


@pytest.mark.slow
def test_a_real_adaptive_warmup_records_what_metrics_show(served, embedded_model):
    """The whole pipeline on the embedded model with adaptive thresholds: the ready
    stage re-fits them, and after SERVING the record and a scrape agree."""
    from warmup_agent.engines.torch.engine import TorchEngine
    env = {**ADAPTIVE, "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
           "WARMUP_AGENT_READINESS_WINDOW_SIZE": "10", "WARMUP_AGENT_VALIDATION_ENABLED": "false"}
    cfg = config.load(env=env)
    agent, port = served(env, TorchEngine(embedded_model, dtype=cfg["model.dtype"], device=cfg["model.device"]))
    assert agent.run() == State.SERVING
    # A few more probes as the watch loop sends them (re-fits continue after SERVING).
    for _ in range(6):
        agent.context.probe(decode=False)
        time.sleep(0.01)
    assert agent.metrics.registry.get_sample_value("warmup_readiness_threshold_refits_total") >= 1
    rec = agent.record()
    assert rec["readiness_thresholds_seconds"] == scraped_thresholds(port)
    assert rec["readiness_thresholds_seconds"]["p90"] < P90      # tightened: the embedded model is fast
