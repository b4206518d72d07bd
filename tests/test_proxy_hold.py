"""Users who arrive while the pod warms are held, not refused (issue 71), in both proxies:
in the agent's process (RoutingProxy) and in a process of its own (ProxyProcess).

A held request is sent on as soon as the gate opens, answered 503 + Retry-After past
proxy.hold_seconds, and at once when the pod leaves the warming states (FAILED).  Each
is counted by outcome, with the seconds it waited.  The main engine is a stand-in
(OpenAIStandIn, named as such): what is checked is when the proxy lets a request
through, which a real engine's own timing would only blur.
"""
from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from tests.helpers.servers import OpenAIStandIn, wait_until
from tests.test_proxy import make_agent
from tests.test_proxy_concurrency import CHAT, post
from warmup_agent.proxy import ProxyProcess, RoutingProxy
from warmup_agent.states import State

pytestmark = pytest.mark.slow
KINDS = ["in_process", "process"]


@pytest.fixture
def standin():
    s = OpenAIStandIn()
    yield s
    s.stop()


def start(kind, agent, standin, **kw):
    cls = RoutingProxy if kind == "in_process" else ProxyProcess
    return cls(agent, standin.url, **kw).start()


def sample(agent, name: str, labels: dict | None = None) -> float:
    return agent.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def send_later(port: int) -> dict:
    """POST CHAT in a thread; the dict gets status, body and the seconds it took."""
    out: dict = {}

    def go() -> None:
        t0 = time.monotonic()
        out["status"], out["headers"], out["body"] = post(port, CHAT, timeout=60)
        out["seconds"] = time.monotonic() - t0
    out["thread"] = threading.Thread(target=go)
    out["thread"].start()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_user_who_arrives_while_warming_is_served_when_the_gate_opens(embedded_model, standin, kind):
    agent = make_agent(embedded_model, State.PRIME)
    proxy = start(kind, agent, standin, hold_seconds=30)
    try:
        sent = send_later(proxy.port)
        time.sleep(0.6)
        assert standin.started == [], "a held request reached the main engine before SERVING"
        assert "status" not in sent, sent
        opened = time.monotonic()
        assert agent.sm.transition(State.SERVING)
        sent["thread"].join(30)
        released = time.monotonic() - opened
        assert sent["status"] == 200 and sent["body"].endswith(b"data: [DONE]\n\n"), sent
        assert len(standin.started) == 1
        assert 0.6 <= sent["seconds"], sent["seconds"]
        assert released < 0.5, f"answered {released:.3f} s after the gate opened"
        wait_until(lambda: sample(agent, "warmup_proxy_hold_seconds_count", {"outcome": "served"}) == 1, timeout=2, interval=0.01,
                   what="the hold, reported")
        assert sample(agent, "warmup_proxy_held_requests_total", {"outcome": "served"}) == 1
        held = sample(agent, "warmup_proxy_hold_seconds_sum", {"outcome": "served"})
        # The client's wall clock: its connect and the answer (a few ms) on top of the hold.
        assert sent["seconds"] - 0.3 <= held <= sent["seconds"], (held, sent["seconds"])
        assert sample(agent, "warmup_proxy_requests_total", {"route": "main", "code": "200"}) == 1
        # Its time to first token counts from the release: the hold never reaches the window.
        assert len(agent.readiness.window) == 1 and agent.readiness.window.values()[0] < 0.5
    finally:
        proxy.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_past_the_hold_a_clear_503_with_retry_after(embedded_model, standin, kind):
    agent = make_agent(embedded_model, State.PRELOAD)
    proxy = start(kind, agent, standin, hold_seconds=0.5, retry_after_seconds=7)
    try:
        t0 = time.monotonic()
        status, headers, body = post(proxy.port, CHAT)
        waited = time.monotonic() - t0
        assert status == 503 and headers["retry-after"] == "7", (status, headers)
        err = json.loads(body)["error"]
        assert err["type"] == "warming_up" and "PRELOAD" in err["message"]
        assert 0.5 <= waited < 2.0, waited
        assert standin.started == []
        wait_until(lambda: sample(agent, "warmup_proxy_held_requests_total", {"outcome": "timed_out"}) == 1,
                   timeout=2, interval=0.01, what="the timed-out hold, reported")
        assert sample(agent, "warmup_proxy_requests_total", {"route": "rejected", "code": "503"}) == 1
    finally:
        proxy.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_a_start_that_fails_releases_its_held_users_at_once(embedded_model, standin, kind):
    agent = make_agent(embedded_model, State.PRIME)
    proxy = start(kind, agent, standin, hold_seconds=30)
    try:
        sent = send_later(proxy.port)
        time.sleep(0.3)
        failed = time.monotonic()
        assert agent.sm.transition(State.FAILED)
        sent["thread"].join(30)
        assert sent["status"] == 503 and "FAILED" in json.loads(sent["body"])["error"]["message"]
        assert time.monotonic() - failed < 0.5
        assert standin.started == []
        wait_until(lambda: sample(agent, "warmup_proxy_held_requests_total", {"outcome": "refused"}) == 1,
                   timeout=2, interval=0.01, what="the refused hold, reported")
    finally:
        proxy.stop()


def test_no_hold_without_hold_seconds_or_with_a_fallback(embedded_model, standin):
    agent = make_agent(embedded_model, State.PRIME)
    proxy = RoutingProxy(agent, standin.url, hold_seconds=0).start()
    try:
        t0 = time.monotonic()
        assert post(proxy.port, CHAT)[0] == 503 and time.monotonic() - t0 < 0.5
    finally:
        proxy.stop()
    fallback = OpenAIStandIn()
    proxy = RoutingProxy(agent, standin.url, fallback_url=fallback.url, hold_seconds=30).start()
    try:
        assert post(proxy.port, CHAT)[0] == 200
        assert len(fallback.started) == 1 and standin.started == []
        assert sample(agent, "warmup_proxy_held_requests_total", {"outcome": "served"}) == 0
    finally:
        proxy.stop()
        fallback.stop()


def test_a_held_client_that_goes_away_is_counted_and_never_sent_on(embedded_model, standin):
    agent = make_agent(embedded_model, State.PRIME)
    proxy = RoutingProxy(agent, standin.url, hold_seconds=30).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(CHAT).encode(),
                     headers={"Content-Type": "application/json"})
        time.sleep(0.3)
        conn.close()
        wait_until(lambda: sample(agent, "warmup_proxy_held_requests_total", {"outcome": "client_gone"}) == 1,
                   timeout=5, interval=0.02, what="the client that went away, counted")
        assert agent.sm.transition(State.SERVING)
        time.sleep(0.2)
        assert standin.started == []
    finally:
        proxy.stop()
