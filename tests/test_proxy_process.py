"""The proxy in a process of its own (warmup_agent/proxy/process.py), where the main engine
is an HTTP server: it routes by the agent's gate as the agent sees it, and what it
measures reaches the agent's metrics, window and first-user figures as in process; a
child that dies is started again on the same socket."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.helpers.servers import OpenAIStandIn, wait_until
from tests.test_proxy import make_agent
from tests.test_proxy_concurrency import CHAT, post
from warmup_agent import config
from warmup_agent.proxy import ProxyProcess, RoutingProxy, from_config
from warmup_agent.readiness.breaker import BreakerState
from warmup_agent.states import State


@pytest.fixture
def standin():
    s = OpenAIStandIn()
    yield s
    s.stop()


def sample(agent, name: str, labels: dict) -> float:
    return agent.metrics.registry.get_sample_value(name, labels) or 0.0


def test_from_config_runs_an_http_main_engine_in_a_process_and_a_local_one_in_process(embedded_model, standin):
    agent = make_agent(embedded_model, State.SERVING)
    env = {"WARMUP_AGENT_PROXY_LISTEN": "127.0.0.1:0", "WARMUP_AGENT_PROXY_UPSTREAM_URL": standin.url}
    proxy = from_config(agent, *_proxy_sections(config.load(env=env)))
    assert isinstance(proxy, ProxyProcess)
    proxy.stop()                  # never started: the socket and the shared memory are released

    class Local:
        async def request(self, *a):
            raise AssertionError

        async def close(self):
            pass
    local = from_config(agent, *_proxy_sections(config.load(env={"WARMUP_AGENT_PROXY_LISTEN": "127.0.0.1:0"})), local_backend=Local())
    assert isinstance(local, RoutingProxy)
    local.sock.close()


def test_users_answers_reach_the_agents_metrics_window_and_gate(embedded_model, standin):
    agent = make_agent(embedded_model, State.SERVING)
    answers: list = []
    agent.readiness.user_answer = lambda ttft, total, output_tokens=None, held=0.0: answers.append((ttft, total, output_tokens))
    proxy = ProxyProcess(agent, standin.url).start()
    try:
        assert proxy.proc is not None and proxy.proc.pid != os.getpid()
        for _ in range(3):
            status, _, body = post(proxy.port, CHAT)
            assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert post(proxy.port, CHAT, headers={"X-Warmup": "true"})[0] == 200     # never a user figure
        wait_until(lambda: len(answers) == 3, timeout=2, interval=0.01, what="the users' answers in the agent")
        assert all(0 < ttft <= total and tokens == standin.chunks for ttft, total, tokens in answers), answers
        assert sample(agent, "warmup_proxy_requests_total", {"route": "main", "code": "200"}) == 3
        assert sample(agent, "warmup_proxy_first_token_seconds_count", {"route": "main"}) == 3
        assert len(agent.readiness.window) == 3                    # streamed first tokens fed the window
    finally:
        proxy.stop()
    assert proxy.proc is not None and proxy.proc.returncode == 0


def test_the_child_routes_by_the_agents_state_and_breaker(embedded_model, standin):
    agent = make_agent(embedded_model, State.PRIME)
    proxy = ProxyProcess(agent, standin.url, retry_after_seconds=7).start()
    try:
        status, headers, body = post(proxy.port, CHAT)
        assert status == 503 and headers["retry-after"] == "7" and "PRIME" in json.loads(body)["error"]["message"]
        assert standin.started == []
        assert agent.sm.transition(State.SERVING)
        t0 = time.monotonic()
        wait_until(lambda: post(proxy.port, CHAT)[0] == 200, timeout=2, interval=0.005, what="routed to main")
        assert time.monotonic() - t0 < 0.5
        # The breaker trips (DEGRADED): rejected, and told the seconds left in the freeze.
        breaker = agent.readiness.breaker
        for _ in range(10):
            if breaker.failure("slow", 30.0) == BreakerState.OPEN:
                break
        assert agent.sm.state == State.DEGRADED
        wait_until(lambda: post(proxy.port, CHAT)[0] == 503, timeout=2, interval=0.005, what="rejected")
        status, headers, _ = post(proxy.port, CHAT)
        assert status == 503 and 25 <= int(headers["retry-after"]) <= 30
        wait_until(lambda: sample(agent, "warmup_proxy_requests_total", {"route": "rejected", "code": "503"}) >= 1,
                   timeout=2, interval=0.01, what="the rejections counted")
    finally:
        proxy.stop()


def test_a_child_that_dies_is_started_again_on_the_same_socket(embedded_model, standin):
    agent = make_agent(embedded_model, State.SERVING)
    proxy = ProxyProcess(agent, standin.url).start()
    try:
        assert post(proxy.port, CHAT)[0] == 200
        first = proxy.proc
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)
        wait_until(lambda: proxy.proc is not first and proxy.proc is not None and proxy.proc.poll() is None,
                   timeout=10, interval=0.05, what="a new proxy process")
        wait_until(lambda: post(proxy.port, CHAT)[0] == 200, timeout=10, interval=0.1, what="answers again")
    finally:
        proxy.stop()


def test_the_shared_gate_is_never_read_half_written():
    import threading

    from warmup_agent.proxy.process import SharedGate
    writer = SharedGate.create()
    reader = SharedGate(writer.fd)
    writer.write("SERVING", True, -1.0)
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            writer.write("SERVING", True, -1.0)
    t = threading.Thread(target=write)
    t.start()
    try:
        seen = {reader.read()[:2] for _ in range(50_000)}
    finally:
        stop.set()
        t.join()
    assert seen == {("SERVING", True)}
    writer.write("DEGRADED", False, 12.0)
    state, main_open, frozen = reader.read()
    assert (state, main_open) == ("DEGRADED", False) and 11.0 < frozen <= 12.0


def _proxy_sections(cfg):
    """What from_config takes of a Config: the proxy section and openai.url."""
    return cfg.proxy, cfg.openai.url
