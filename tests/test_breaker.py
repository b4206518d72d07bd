"""The breaker on the real embedded engine with real injected latency.

`DelayedTorchEngine` is the torch engine with a forward pre-hook that sleeps:
the delay happens inside the model's forward, so the engine's own time-to-
first-token measurement sees it, exactly like a slow GPU would.  The agent
warms it to SERVING, then the watch loop probes; the test injects latency and
checks, against an independent replay of the measured samples, that the
breaker trips on exactly the third consecutive over-threshold window P90, that
nothing reaches the engine while it is open, that half-open probes re-open on
a slow probe and close after good ones, and that /readyz and the metrics follow.
"""
import logging
import threading
import time

import numpy as np
import pytest

from exporter.metrics import AgentMetrics
from exporter.recorder import Recorder
from exporter.server import ExporterServer
from tests.helpers.servers import http_get, wait_until
from warmup_agent import config
from warmup_agent.engines.torch.engine import TorchEngine
from warmup_agent.errors import EngineError
from warmup_agent.pipeline import Agent
from warmup_agent.readiness.breaker import Breaker, BreakerState
from warmup_agent.readiness.runtime import Readiness, failure_cause
from warmup_agent.states import State, StateMachine

P90 = 0.3          # tail threshold (s); the embedded model answers in a few ms
DELAY = 0.45       # injected latency (s), well over P90
OPEN = 0.6         # freeze (s)
WINDOW = 10


class DelayedTorchEngine(TorchEngine):
    """TorchEngine with injectable latency inside the forward pass; also logs
    when each batch entered the engine (agent clock)."""

    def __init__(self, *a, clock, **kw):
        super().__init__(*a, **kw)
        self.delay = 0.0
        self.calls: list[float] = []
        self._clock = clock

    def load_weights(self):
        super().load_weights()
        self.model.register_forward_pre_hook(lambda module, args: time.sleep(self.delay) if self.delay else None)

    def generate(self, prompts, max_new_tokens=1, warmup=False):
        self.calls.append(self._clock())
        return super().generate(prompts, max_new_tokens, warmup)


@pytest.fixture
def agent(embedded_model):
    cfg = config.load(env={
        "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
        "WARMUP_AGENT_READINESS_MIN_PROBES": "5", "WARMUP_AGENT_READINESS_WINDOW_SIZE": str(WINDOW),
        "WARMUP_AGENT_READINESS_P50_THRESHOLD_SECONDS": "0.2",
        "WARMUP_AGENT_READINESS_P90_THRESHOLD_SECONDS": str(P90),
        "WARMUP_AGENT_BREAKER_OPEN_SECONDS": str(OPEN), "WARMUP_AGENT_BREAKER_HALF_OPEN_PROBES": "3",
        # a slow probe here is 0.45 s: judged by its time, never timed out
        "WARMUP_AGENT_READINESS_WATCH_PROBE_TIMEOUT_SECONDS": "10"})
    clock = time.perf_counter
    engine = DelayedTorchEngine(embedded_model, dtype=cfg["model.dtype"], device=cfg["model.device"], clock=clock)
    a = Agent(cfg, engine, metrics=AgentMetrics(), clock=clock)
    server = ExporterServer(a, a.metrics.registry, "127.0.0.1", 0).start()
    a.url = f"http://127.0.0.1:{server.port}"
    assert a.run() == State.SERVING
    yield a
    a.stop()
    server.stop()


def replay_trip_index(samples, first_serving_index, threshold, trip_after, window):
    """Index (into samples) of the sample whose window P90 made trip_after in a row,
    counting only samples from first_serving_index on; numpy, not our window."""
    run = 0
    for i in range(first_serving_index, len(samples)):
        tail = samples[max(0, i + 1 - window): i + 1]
        p90 = float(np.quantile(tail, 0.9, method="inverted_cdf"))
        run = run + 1 if p90 > threshold else 0
        if run == trip_after:
            return i
    return None


def test_trip_freeze_half_open_reopen_close(agent):
    reg = agent.metrics.registry
    rd = agent.readiness
    events = []   # (breaker state, agent clock, probes recorded so far)
    moved = rd.breaker._on_change

    def spy(frm, to):
        events.append((to, agent.clock(), len(agent.probes)))
        moved(frm, to)
    rd.breaker._on_change = spy
    assert http_get(agent.url + "/readyz")[0] == 200
    gate_probes = len(agent.probes)

    agent.watch(0.01)
    wait_until(lambda: len(agent.probes) >= gate_probes + 5, timeout=30, what="fast probes after SERVING")
    agent.engine.delay = DELAY
    wait_until(lambda: agent.sm.state == State.DEGRADED, timeout=60, what="the breaker to trip")

    # Tripped on exactly the sample where the independent replay sees the 3rd consecutive P90 over.
    (to, tripped_at, probes_at_trip), = events[:1]
    assert to == BreakerState.OPEN
    idx = replay_trip_index(agent.probes[:probes_at_trip], gate_probes, P90, 3, WINDOW)
    assert idx == probes_at_trip - 1, (agent.probes, gate_probes, idx)
    assert reg.get_sample_value("warmup_breaker_trips_total", {"reason": "slow"}) == 1
    assert reg.get_sample_value("warmup_fallback_active") == 1
    assert reg.get_sample_value("warmup_breaker_state", {"state": "open"}) == 1
    assert reg.get_sample_value("warmup_state_transitions_total", {"from": "SERVING", "to": "DEGRADED"}) == 1
    assert http_get(agent.url + "/readyz") == (503, "DEGRADED\n")
    assert http_get(agent.url + "/healthz")[0] == 200

    # Still slow: the first half-open probe re-opens it.
    wait_until(lambda: len(events) >= 3, timeout=30, what="half-open then open again")
    assert [e[0] for e in events[:3]] == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.OPEN]
    assert agent.sm.state == State.DEGRADED
    agent.engine.delay = 0.0
    wait_until(lambda: agent.sm.state == State.SERVING, timeout=30, what="the breaker to close")
    assert [e[0] for e in events] == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.OPEN,
                                      BreakerState.HALF_OPEN, BreakerState.CLOSED]

    # Frozen: no engine call between each open and the following half-open, which
    # came no earlier than the configured freeze.
    for (s1, t1, _), (s2, t2, _) in zip(events, events[1:], strict=False):
        if s1 == BreakerState.OPEN:
            assert s2 == BreakerState.HALF_OPEN and t2 - t1 >= OPEN
            assert not [c for c in agent.engine.calls if t1 < c < t2], "the main engine was called while frozen"
    # Closed after exactly 3 good half-open probes (sent back to back in one watch tick).
    assert events[-1][2] - events[-2][2] == 3
    assert all(p <= P90 for p in agent.probes[events[-2][2]:events[-1][2]])

    for frm, to, n in (("closed", "open", 1), ("open", "half_open", 2), ("half_open", "open", 1), ("half_open", "closed", 1)):
        assert reg.get_sample_value("warmup_breaker_transitions_total", {"from": frm, "to": to}) == n
    assert reg.get_sample_value("warmup_state_transitions_total", {"from": "DEGRADED", "to": "SERVING"}) == 1
    assert reg.get_sample_value("warmup_breaker_trips_total", {"reason": "slow"}) == 1
    assert reg.get_sample_value("warmup_fallback_active") == 0
    assert reg.get_sample_value("warmup_breaker_state", {"state": "closed"}) == 1
    assert http_get(agent.url + "/readyz") == (200, "SERVING\n")
    assert not reg.get_sample_value("warmup_illegal_transitions_total", {"from": "DEGRADED", "to": "SERVING"})


def test_user_samples_feed_the_breaker_but_not_the_probe_list(agent):
    probes = len(agent.probes)
    for _ in range(WINDOW):
        agent.context.record_probe(DELAY, kind="user")
    assert len(agent.probes) == probes
    assert agent.sm.state == State.DEGRADED
    assert agent.readiness.breaker.trips == 1


def test_breaker_disabled_never_degrades(embedded_model):
    cfg = config.load(env={"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
                           "WARMUP_AGENT_READINESS_MIN_PROBES": "5", "WARMUP_AGENT_BREAKER_ENABLED": "false"})
    a = Agent(cfg, TorchEngine(embedded_model, dtype=cfg["model.dtype"], device=cfg["model.device"]), metrics=AgentMetrics())
    assert a.run() == State.SERVING
    for _ in range(20):
        a.context.record_probe(10.0)
    assert a.sm.state == State.SERVING and a.readiness.breaker.trips == 0
    a.stop()


def test_stop_waits_for_the_probe_in_flight(agent):
    """A probe still inside a forward pass when the interpreter finalises aborts the
    process (exit -6 instead of the drain's 0, seen once in four two-agent CPU runs of
    bench/bench_two_gpu.py --dry-run): stop() must wait for it."""
    agent.engine.delay = 0.5
    calls = len(agent.engine.calls)
    agent.watch(0.01)
    wait_until(lambda: len(agent.engine.calls) > calls, timeout=30, what="a probe entering the engine")
    t0 = time.perf_counter()
    agent.stop()
    assert not [t for t in threading.enumerate() if t.name == "readiness-watch"]
    assert time.perf_counter() - t0 > 0.2          # it waited for the slow probe to finish


# -- failed probes (issue 41): the breaker's logic on a fake clock ------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_failures_trip_after_fail_after_in_a_row_and_an_answer_resets_the_count():
    clock = FakeClock()
    b = Breaker(trip_after=3, open_seconds=30, half_open_probes=2, clock=clock, fail_after=2)
    assert b.failure("server_error") == BreakerState.CLOSED
    b.closed_sample(False)                                   # an answer in between
    assert b.failure("server_error") == BreakerState.CLOSED
    assert b.failure("timeout") == BreakerState.OPEN
    assert (b.cause, b.freeze, b.trips) == ("timeout", 30, 1)
    clock.t += 29.9
    assert b.tick() == BreakerState.OPEN
    clock.t += 0.1
    assert b.tick() == BreakerState.HALF_OPEN


def test_an_unreachable_server_is_probed_again_at_the_next_tick_and_closes_after_the_half_open_probes():
    clock = FakeClock()
    b = Breaker(trip_after=3, open_seconds=30, half_open_probes=3, clock=clock, fail_after=1)
    assert b.failure("unreachable", freeze=0) == BreakerState.OPEN
    assert b.tick() == BreakerState.HALF_OPEN                # no freeze: the next watch tick probes
    assert b.failure("unreachable", freeze=0) == BreakerState.OPEN
    assert b.trips == 1                                      # re-opening is not another trip
    assert b.tick() == BreakerState.HALF_OPEN
    for _ in range(2):
        assert b.half_open_probe(False) == BreakerState.HALF_OPEN
    assert b.half_open_probe(False) == BreakerState.CLOSED
    # The server is back but slow: a slow half-open probe freezes for the full open_seconds.
    b2 = Breaker(open_seconds=30, clock=clock)
    b2.failure("unreachable", freeze=0)
    b2.tick()
    assert b2.half_open_probe(True) == BreakerState.OPEN and (b2.cause, b2.freeze) == ("slow", 30)


@pytest.mark.parametrize("error, cause", [
    (EngineError("server_unreachable", "POST http://127.0.0.1:1/v1/completions: [Errno 111] Connection refused"), "unreachable"),
    (EngineError("server_unreachable", "POST http://127.0.0.1:1/v1/completions: timed out"), "timeout"),
    (EngineError("request_failed", "POST http://x/v1/completions: HTTP 503: overloaded"), "server_error"),
    (EngineError("request_failed", "POST http://x/v1/completions: HTTP 404: no such model"), "bad_answer"),
    (EngineError("request_failed", "POST http://x/v1/completions: stream ended without a token"), "bad_answer"),
    (ConnectionResetError(104, "Connection reset by peer"), "unreachable"),
    (TimeoutError("timed out"), "timeout"),
    (RuntimeError("CUDA error: an illegal memory access"), "bad_answer"),
])
def test_failure_causes(error, cause):
    assert failure_cause(error)[0] == cause


def test_a_dead_server_trips_once_logs_once_and_counts_each_failed_probe(caplog):
    cfg = config.load(env={"WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "5"})
    metrics = AgentMetrics()
    sm = StateMachine(Recorder(metrics))
    clock = FakeClock()
    rd = Readiness(cfg.readiness, cfg.breaker, sm, Recorder(metrics), clock=clock)
    for st in (State.PRELOAD, State.PRIME, State.SERVING):
        sm.transition(st)
    refused = EngineError("server_unreachable", "POST http://127.0.0.1:1/v1/completions: [Errno 111] Connection refused")
    reg = metrics.registry
    with caplog.at_level(logging.DEBUG, logger="warmup_agent.readiness"):
        for _ in range(10):                                   # ten watch ticks of a dead server
            assert rd.due_probe()
            assert rd.probe_failed(refused) == "unreachable"
            clock.t += 5
    assert sm.state == State.DEGRADED
    assert reg.get_sample_value("warmup_breaker_trips_total", {"reason": "unreachable"}) == 1
    assert reg.get_sample_value("warmup_breaker_trips_total", {"reason": "slow"}) == 0
    assert reg.get_sample_value("warmup_watch_probe_failures_total", {"reason": "unreachable"}) == 10
    assert reg.get_sample_value("warmup_breaker_state", {"state": "open"}) == 1
    loud = [r for r in caplog.records if r.levelno >= logging.INFO and r.name == "warmup_agent.readiness"]
    assert len(loud) == 1 and "breaker tripped (unreachable)" in loud[0].getMessage(), [r.getMessage() for r in loud]
    assert not any(r.exc_info for r in caplog.records)
    # The server answers again: three good half-open probes, one line, SERVING.
    with caplog.at_level(logging.DEBUG, logger="warmup_agent.readiness"):
        assert rd.due_probe()
        for _ in range(3):
            rd.first_token(0.01)
    assert sm.state == State.SERVING
    loud = [r for r in caplog.records if r.levelno >= logging.INFO and r.name == "warmup_agent.readiness"]
    assert len(loud) == 2 and "breaker closed after 3 good probes" in loud[1].getMessage()


def serving_readiness() -> tuple[AgentMetrics, StateMachine, Readiness]:
    """A Readiness of the default config whose state machine is SERVING."""
    cfg = config.load(env={})
    metrics = AgentMetrics()
    sm = StateMachine(Recorder(metrics))
    rd = Readiness(cfg.readiness, cfg.breaker, sm, Recorder(metrics))
    for st in (State.PRELOAD, State.PRIME, State.SERVING):
        sm.transition(st)
    return metrics, sm, rd


def test_a_rewarm_closes_an_open_breaker():
    metrics, sm, rd = serving_readiness()
    rd.probe_failure("server_error", "HTTP 500")
    assert sm.state == State.DEGRADED and rd.breaker.state == BreakerState.OPEN
    assert sm.transition(State.PRELOAD)
    assert rd.breaker.state == BreakerState.CLOSED
    assert metrics.registry.get_sample_value("warmup_breaker_state", {"state": "closed"}) == 1
    rd.probe_failure("server_error", "HTTP 500")             # during the re-warm: its stages judge
    assert rd.breaker.state == BreakerState.CLOSED


def test_a_batch_of_samples_judges_each_as_one_at_a_time_does():
    """The proxy process's samples come in batches (Readiness.first_tokens): the window,
    the breaker's trip and the published quantiles are those of one sample at a time."""
    rng = np.random.default_rng(7)
    samples = list(np.concatenate([rng.uniform(0.01, 0.05, 40), rng.uniform(3.0, 4.0, 40)]))
    outcomes = []
    for batched in (False, True):
        metrics, sm, rd = serving_readiness()
        trips_at = None
        for i in range(0, len(samples), 7):
            if batched:
                rd.first_tokens(samples[i:i + 7])
            else:
                for s in samples[i:i + 7]:
                    rd.first_token(s)
            if trips_at is None and rd.breaker.state == BreakerState.OPEN:
                trips_at = i
        reg = metrics.registry
        outcomes.append((trips_at, sm.state, rd.window.values(),
                         reg.get_sample_value("warmup_breaker_trips_total", {"reason": "slow"})))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] is not None and outcomes[0][1] == State.DEGRADED   # the slow half tripped it
