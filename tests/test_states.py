"""The state machine: legal table, the seed's seven illegal jumps, deadlines, fingerprint."""
import itertools

import pytest

from exporter.metrics import AgentMetrics
from exporter.recorder import Recorder
from warmup_agent.states import SEED_ILLEGAL, TRANSITIONS, State, StateMachine


class FakeClock:
    """A clock the test moves by hand, so deadlines are tested without sleeping."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def machine_in(state: State, metrics=None, deadlines=None, clock=None) -> StateMachine:
    sm = StateMachine(Recorder(metrics) if metrics is not None else None, deadlines=deadlines, clock=clock or FakeClock())
    path = {State.INIT: [], State.PRELOAD: [State.PRELOAD], State.PRIME: [State.PRELOAD, State.PRIME],
            State.SERVING: [State.PRELOAD, State.PRIME, State.SERVING],
            State.SLEEPING: [State.PRELOAD, State.PRIME, State.SERVING, State.SLEEPING]}[state]
    for s in path:
        assert sm.transition(s)
    return sm


def counter(m: AgentMetrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("frm,to", SEED_ILLEGAL, ids=lambda s: s.name)
def test_seed_illegal_transition_is_rejected_logged_and_counted(frm, to, caplog):
    m = AgentMetrics()
    sm = machine_in(frm, m)
    before = counter(m, "warmup_state_transitions_total", **{"from": frm.name, "to": to.name})
    assert sm.transition(to) is False
    assert sm.state == frm, "an illegal transition must never be applied"
    assert counter(m, "warmup_illegal_transitions_total", **{"from": frm.name, "to": to.name}) == 1.0
    assert counter(m, "warmup_state_transitions_total", **{"from": frm.name, "to": to.name}) == before
    assert f"{frm.name} -> {to.name}" in caplog.text
    assert m.registry.get_sample_value("warmup_state", {"state": frm.name}) == 1.0


def test_the_seven_seed_jumps_are_exactly_the_illegal_pairs_among_the_warmup_states():
    warm = (State.INIT, State.PRELOAD, State.PRIME, State.SERVING)
    illegal = {(a, b) for a, b in itertools.permutations(warm, 2) if b not in TRANSITIONS[a]}
    assert illegal == set(SEED_ILLEGAL) and len(illegal) == 7


def test_every_pair_follows_the_table():
    for frm, to in itertools.product(State, State):
        if frm in (State.DEGRADED, State.DRAINING, State.FAILED):
            continue  # reached below through their own paths
        sm = machine_in(frm)
        assert sm.transition(to) is (to in TRANSITIONS[frm]), (frm, to)


def test_terminal_states_have_no_way_out():
    for terminal in (State.DRAINING, State.FAILED):
        assert terminal.terminal and TRANSITIONS[terminal] == frozenset()
        for to in State:
            sm = StateMachine(clock=FakeClock())
            sm.transition(terminal)
            assert sm.transition(to) is False
    assert not any(s.terminal for s in (State.INIT, State.PRELOAD, State.PRIME, State.SERVING, State.DEGRADED))


def test_gauge_shows_exactly_one_state():
    m = AgentMetrics()
    machine_in(State.PRIME, m)
    values = {s.name: m.registry.get_sample_value("warmup_state", {"state": s.name}) for s in State}
    assert values == {s.name: (1.0 if s == State.PRIME else 0.0) for s in State}
    assert counter(m, "warmup_state_transitions_total", **{"from": "PRELOAD", "to": "PRIME"}) == 1.0


def test_deadline_fires_with_named_reason():
    clock, m = FakeClock(), AgentMetrics()
    sm = machine_in(State.PRELOAD, m, deadlines={State.PRELOAD: 30.0}, clock=clock)
    clock.now += 29.9
    assert sm.check_deadline() is None and sm.state == State.PRELOAD
    assert sm.deadline_remaining() == pytest.approx(0.1)
    clock.now += 0.2
    assert sm.check_deadline() == "preload_deadline_exceeded"
    assert sm.state == State.FAILED
    assert sm.failure_reason == "preload_deadline_exceeded"
    assert counter(m, "warmup_state_deadline_exceeded_total", state="PRELOAD") == 1.0
    assert counter(m, "model_loading_failures_total", reason="preload_deadline_exceeded") == 1.0


def test_deadline_restarts_with_each_state_and_zero_disables():
    clock = FakeClock()
    sm = StateMachine(deadlines={State.INIT: 10.0, State.PRELOAD: 0}, clock=clock)
    clock.now += 9
    sm.transition(State.PRELOAD)
    clock.now += 1000
    assert sm.check_deadline() is None and sm.deadline_remaining() is None


def wait_for_failure(sm: StateMachine, timeout: float = 60.0) -> None:
    """Poll until the watchdog has failed the machine (or the timeout passes)."""
    import time
    deadline = time.monotonic() + timeout
    while sm.state != State.FAILED and time.monotonic() < deadline:
        time.sleep(0.01)


def test_watchdog_thread_fails_a_stuck_state():
    sm = StateMachine(deadlines={State.INIT: 0.05})
    sm.start_watchdog(interval=0.01)
    try:
        wait_for_failure(sm)
    finally:
        sm.stop_watchdog()
    assert sm.state == State.FAILED and sm.failure_reason == "init_deadline_exceeded"


def test_serving_requires_the_preload_fingerprint():
    m = AgentMetrics()
    sm = machine_in(State.PRIME, m)
    sm.record_fingerprint("a" * 64)
    assert sm.serve("b" * 64) is False
    assert sm.state == State.FAILED and sm.failure_reason == "weight_fingerprint_mismatch"
    ok = machine_in(State.PRIME)
    ok.record_fingerprint("a" * 64)
    assert ok.serve("a" * 64) is True and ok.state == State.SERVING


def test_watchdog_can_be_started_again_after_a_stop():
    sm = StateMachine(deadlines={State.PRELOAD: 0.05})
    sm.start_watchdog(interval=0.01)
    sm.stop_watchdog()
    sm.transition(State.PRELOAD)
    sm.start_watchdog(interval=0.01)   # as a re-warm does
    try:
        wait_for_failure(sm)
    finally:
        sm.stop_watchdog()
    assert sm.failure_reason == "preload_deadline_exceeded"
