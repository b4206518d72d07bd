"""The one periodic daemon-thread loop (warmup_agent/periodic.py) and its three users.
Waits are on events with generous timeouts: nothing here depends on the machine's speed."""
from __future__ import annotations

import threading
import time

from warmup_agent.gpu.ramp import RampSampler
from warmup_agent.host.memory import MemorySampler
from warmup_agent.periodic import Periodic
from warmup_agent.states import State, StateMachine


def _counter(target: int):
    calls, reached = [], threading.Event()

    def fn():
        calls.append(threading.current_thread())
        if len(calls) >= target:
            reached.set()
    return calls, reached, fn


def test_calls_repeatedly_on_a_named_daemon_thread_and_stops():
    calls, reached, fn = _counter(3)
    p = Periodic(0.01, fn, name="test-loop")
    p.start()
    assert reached.wait(10), "fewer than 3 calls in 10 s"
    assert p.running
    p.stop()
    assert not p.running
    n = len(calls)
    time.sleep(0.1)  # ten intervals: a loop still running would call again
    assert len(calls) == n
    thread = calls[0]
    assert thread is not threading.main_thread() and thread.daemon and thread.name == "test-loop"
    assert not thread.is_alive()


def test_first_call_waits_one_interval():
    calls, _, fn = _counter(1)
    p = Periodic(60, fn, name="slow")
    p.start()
    p.stop()  # prompt: the wait is on an event, not a 60 s sleep
    assert calls == []


def test_restarts_after_stop_as_a_rewarm_does():
    calls, reached, fn = _counter(1)
    p = Periodic(0.01, fn, name="again")
    p.start()
    assert reached.wait(10)
    p.stop()
    calls.clear()
    reached.clear()
    p.start()
    assert reached.wait(10), "no call after the restart"
    p.stop()


def test_stop_before_start_and_from_inside_fn():
    Periodic(1, lambda: None, name="never").stop()
    done = threading.Event()
    holder: list[Periodic] = []

    def fn():
        holder[0].stop()  # joining its own thread would raise; it must not
        done.set()
    holder.append(Periodic(0.01, fn, name="self-stop"))
    holder[0].start()
    assert done.wait(10)
    time.sleep(0.05)
    assert not holder[0].running


def test_memory_sampler_samples_in_the_background():
    m = MemorySampler(interval=0.01, window=60)
    m.start()
    try:
        deadline = time.monotonic() + 10
        while len(m.samples()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(m.samples()) >= 3  # one at start, the rest from the loop
    finally:
        m.stop()
    n = len(m.samples())
    time.sleep(0.1)
    assert len(m.samples()) == n


def test_ramp_sampler_samples_until_stopped():
    class FakeNVML:  # a fake: no GPU on the test machine; only the loop is under test here
        def __init__(self):
            self.reads = 0

        def nvmlDeviceGetUtilizationRates(self, handle):
            self.reads += 1
            return type("U", (), {"gpu": 50})()
    nv = FakeNVML()
    s = RampSampler(nv, None, interval=0.01).start()
    deadline = time.monotonic() + 10
    while nv.reads < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    slope = s.stop()
    assert nv.reads >= 3 and len(s.samples) == nv.reads
    assert slope == 0.0  # constant 50 % utilisation
    n = nv.reads
    time.sleep(0.1)
    assert nv.reads == n


def test_state_watchdog_second_start_replaces_the_first():
    # (the deadline itself is covered in test_states.py)
    sm = StateMachine(deadlines={State.INIT: 3600})
    sm.start_watchdog(interval=0.01)
    sm.start_watchdog(interval=0.01)
    sm.stop_watchdog()
    alive = [t for t in threading.enumerate() if t.name == "state-deadline-watchdog"]
    assert alive == [] and sm.state == State.INIT
