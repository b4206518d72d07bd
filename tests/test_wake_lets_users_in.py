"""Which wakes let held users in before their warm-up (pipeline.Agent._users_first_on_rewarm,
issue 71); a restart lets them in by the first start's rule.  The real wake is in tests/test_server_sleep.py (CPU llama-server); here each
condition alone, with the agent's own objects and the golden check and let-in recorded."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from exporter.metrics import AgentMetrics
from warmup_agent import config
from warmup_agent.engines.torch.engine import TorchEngine
from warmup_agent.pipeline import Agent
from warmup_agent.server.kinds import BY_NAME


def _agent(kind: str, proxy: bool = True) -> tuple[Agent, list[str]]:
    env = {"WARMUP_AGENT_PROXY_LISTEN": "127.0.0.1:1"} if proxy else {}
    a = Agent(config.load(env=env), TorchEngine("/not/loaded"), metrics=AgentMetrics())
    calls: list[str] = []
    a.life = SimpleNamespace(signals=SimpleNamespace(kind=BY_NAME[kind]))        # type: ignore[assignment]
    a.golden = SimpleNamespace(answers=["recorded"])                             # type: ignore[assignment]
    a._check_golden = lambda: calls.append("golden")                             # type: ignore[method-assign]
    a.let_users_in = lambda why="": calls.append("let in") or (lambda: None)     # type: ignore[method-assign,assignment]
    return a, calls


def test_a_llamacpp_wake_lets_users_in_after_the_golden_answers_where_a_length_spares_nothing():
    a, calls = _agent("llamacpp")
    a.context.length_warmup_pays = False
    a._users_first_on_rewarm(wake=True)
    assert calls == ["golden", "let in"] and a.context.users_first is not None
    assert a.context.let_users_in is None            # once: not again at the first probe


@pytest.mark.parametrize("why", ["a warmed length pays", "vLLM wakes on its own call", "no proxy holds users",
                                 "no golden answers yet"])
def test_otherwise_users_wait_for_the_first_probe_or_the_gate(why):
    a, calls = _agent("vllm" if why.startswith("vLLM") else "llamacpp", proxy=why != "no proxy holds users")
    a.context.length_warmup_pays = why == "a warmed length pays"
    if why == "no golden answers yet":
        a.golden = None
    a._users_first_on_rewarm(wake=True)
    assert calls == [] and a.context.users_first is None
    if why == "no proxy holds users":
        assert a.context.let_users_in is None
    else:       # the first start's rule at the first probe, the golden answers checked first
        a.context.let_users_in()
        assert calls == ["golden", "let in"]


def test_a_restart_lets_users_in_by_the_first_starts_rule_after_the_golden_answers():
    a, calls = _agent("llamacpp")
    a.context.length_warmup_pays = False
    a._users_first_on_rewarm(wake=False)
    assert calls == [] and a.context.users_first is None      # not before its warm-up: a new process is cold
    a.context.let_users_in()                                  # the lone first probe agreed with the finding
    assert calls == ["golden", "let in"] and a.context.let_users_in is None
