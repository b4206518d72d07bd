"""The users' real first request (issue 41): Readiness.user_answer, the figures of
readiness/first_user.py, the two gauges, and their reset at a re-warm's gate.

The figures are checked against an independent computation (numpy medians over
the same answers, written out here), not against first_user.py's own helpers.
"""
from __future__ import annotations

import numpy as np
import pytest

from exporter.metrics import AgentMetrics
from exporter.recorder import Recorder
from warmup_agent import config
from warmup_agent.readiness.first_user import FirstUserRequest, UserAnswer
from warmup_agent.readiness.runtime import Readiness
from warmup_agent.states import State, StateMachine

# (ttft, total, output tokens): a first answer that was slow to its first token and
# decoded a bit slower, then six steady answers of different lengths.
FIRST = (0.420, 0.420 + 31 * 0.021, 32)
LATER = [(0.101, 0.101 + 15 * 0.0150, 16), (0.097, 0.097 + 63 * 0.0160, 64), (0.105, 0.105 + 7 * 0.0148, 8),
         (0.099, 0.099 + 31 * 0.0152, 32), (0.120, 0.120 + 3 * 0.0170, 4), (0.098, 0.098 + 15 * 0.0155, 16)]


def serving(steady: int = 5, **env: str) -> tuple[Readiness, StateMachine, AgentMetrics]:
    cfg = config.load(env={"WARMUP_AGENT_READINESS_FIRST_USER_STEADY_REQUESTS": str(steady), **env})
    metrics = AgentMetrics()
    sm = StateMachine(Recorder(metrics))
    rd = Readiness(cfg.readiness, cfg.breaker, sm, Recorder(metrics))
    for s in (State.PRELOAD, State.PRIME, State.SERVING):
        assert sm.transition(s)
    return rd, sm, metrics


def gauges(metrics: AgentMetrics) -> tuple[float | None, float | None]:
    reg = metrics.registry
    return (reg.get_sample_value("warmup_first_user_request_tax_ratio"),
            reg.get_sample_value("warmup_first_user_request_total_tax_ratio"))


def independent(first, later) -> tuple[float, float]:
    """TTFT over the later answers' median TTFT; whole answer over median TTFT +
    (first's tokens - 1) x the later answers' median time per output token."""
    ttfts = np.array([a[0] for a in later])
    tpots = np.array([(a[1] - a[0]) / (a[2] - 1) for a in later])
    steady_ttft = float(np.median(ttfts))
    return first[0] / steady_ttft, first[1] / (steady_ttft + (first[2] - 1) * float(np.median(tpots)))


def test_the_first_users_figures_equal_an_independent_computation():
    rd, _, metrics = serving(steady=5)
    assert gauges(metrics) == (0.0, 0.0)                     # 0: not measured yet
    rd.user_answer(*FIRST[:2], output_tokens=FIRST[2])
    for a in LATER[:4]:
        rd.user_answer(a[0], a[1], output_tokens=a[2])
    assert gauges(metrics) == (0.0, 0.0)                     # held until 5 answers after it are in
    rd.user_answer(LATER[4][0], LATER[4][1], output_tokens=LATER[4][2])
    ttft_tax, total_tax = independent(FIRST, LATER[:5])
    got = gauges(metrics)
    assert got[0] == pytest.approx(ttft_tax, rel=1e-12) and got[1] == pytest.approx(total_tax, rel=1e-12)
    assert 4.0 < got[0] < 4.3 and 1.8 < got[1] < 1.95       # sanity: a cold first token, then its decode
    rd.user_answer(LATER[5][0], LATER[5][1], output_tokens=LATER[5][2])
    assert gauges(metrics) == got                            # computed once


def test_without_token_counts_the_whole_answer_is_not_compared():
    rd, _, metrics = serving(steady=3)
    rd.user_answer(FIRST[0], FIRST[1])
    for a in LATER[:3]:
        rd.user_answer(a[0], a[1])
    ttft = gauges(metrics)[0]
    assert ttft == pytest.approx(FIRST[0] / float(np.median([a[0] for a in LATER[:3]])), rel=1e-12)
    assert gauges(metrics)[1] == 0.0
    assert rd.first_user_request.figures is not None and rd.first_user_request.figures.total_tax is None


def test_a_one_token_first_answer_is_compared_with_the_steady_first_token():
    fu = FirstUserRequest(2)
    fu.add(UserAnswer(0.3, 0.3, 1))
    fu.add(UserAnswer(0.1, 0.5, 9))
    f = fu.add(UserAnswer(0.2, 0.6, 9))
    assert f is not None and f.total_tax == pytest.approx(0.3 / 0.15) and f.ttft_tax == pytest.approx(0.3 / 0.15)


def test_a_rewarms_gate_starts_again_and_zeroes_the_gauges():
    rd, sm, metrics = serving(steady=1)
    rd.user_answer(0.5, 0.5, output_tokens=1)
    rd.user_answer(0.1, 0.1, output_tokens=1)
    assert gauges(metrics)[0] == pytest.approx(5.0)
    assert sm.transition(State.PRELOAD)                      # POST /admin/rewarm
    assert gauges(metrics)[0] == pytest.approx(5.0)          # still the last gate's until the new one opens
    assert sm.transition(State.PRIME) and sm.transition(State.SERVING)
    assert gauges(metrics) == (0.0, 0.0)
    rd.user_answer(0.2, 0.2, output_tokens=1)                # the new gate's first request
    rd.user_answer(0.1, 0.1, output_tokens=1)
    assert gauges(metrics)[0] == pytest.approx(2.0)


def test_the_breaker_closing_is_not_a_new_gate():
    rd, sm, metrics = serving(steady=1)
    rd.user_answer(0.3, 0.3, output_tokens=1)
    assert sm.transition(State.DEGRADED) and sm.transition(State.SERVING)
    rd.user_answer(0.1, 0.1, output_tokens=1)
    assert gauges(metrics)[0] == pytest.approx(3.0)


def test_an_answer_in_before_the_state_listener_belongs_to_the_new_gate():
    """/readyz and the proxy see SERVING before the listeners run; an answer reported in
    that moment (here: by a listener that runs first) is the new gate's first request."""
    cfg = config.load(env={"WARMUP_AGENT_READINESS_FIRST_USER_STEADY_REQUESTS": "5"})
    metrics = AgentMetrics()
    sm = StateMachine(Recorder(metrics))
    early = []
    sm.on_change(lambda frm, to: early.append(rd.user_answer(FIRST[0], FIRST[1], output_tokens=FIRST[2]))
                 if to == State.SERVING else None)
    rd = Readiness(cfg.readiness, cfg.breaker, sm, Recorder(metrics))
    for _ in range(7):      # users let in before any gate opened: not a first request after a warm-up
        rd.user_answer(9.9, 9.9, output_tokens=1)
    assert gauges(metrics) == (0.0, 0.0) and rd.first_user_request.first is None
    for s in (State.PRELOAD, State.PRIME, State.SERVING):
        assert sm.transition(s)
    assert early
    for a in LATER[:5]:
        rd.user_answer(a[0], a[1], output_tokens=a[2])
    assert rd.first_user_request.figures is not None
    assert rd.first_user_request.figures.first.ttft == FIRST[0]
    assert gauges(metrics)[0] == pytest.approx(independent(FIRST, LATER[:5])[0], rel=1e-12)


def test_users_let_in_before_the_gate_are_not_its_samples():
    """The gate judges its own probes; a user let in before SERVING waited in the hold."""
    cfg = config.load()
    metrics = AgentMetrics()
    sm = StateMachine(Recorder(metrics))
    rd = Readiness(cfg.readiness, cfg.breaker, sm, Recorder(metrics))
    assert sm.transition(State.PRELOAD)
    rd.users_let_in = True
    assert rd.main_open()
    rd.first_tokens([5.0, 5.0])
    assert len(rd.window) == 0
    rd.first_token(0.01)                   # a probe's
    assert len(rd.window) == 1
    assert sm.transition(State.PRIME) and rd.users_let_in and sm.transition(State.SERVING)
    assert not rd.users_let_in
    rd.first_tokens([0.02])                # users after SERVING are
    assert len(rd.window) == 2
    for to in (State.PRELOAD, State.FAILED):   # a re-warm, a failure: held again / refused
        rd.users_let_in = True
        assert sm.transition(to) and not rd.users_let_in
    assert not rd.main_open()
