"""The routing proxy under what production sends it (issue 41): clients that go away,
oversized bodies, upstreams that stall, bursts of new connections, many streams at
once beside the pod's own endpoints, and an engine in this process as the backend.

The upstream is `OpenAIStandIn` (tests/helpers/servers.py), a stand-in that
generates nothing and records what it saw, including answers whose connection
closed before their end; the agent is a real one (its state machine walked to
SERVING), as in tests/test_proxy.py.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Mapping

import pytest

from exporter.server import ExporterServer
from tests.helpers.servers import OpenAIStandIn, http_get, wait_until
from tests.test_proxy import make_agent
from warmup_agent import config
from warmup_agent.proxy import BackendResponse, RoutingProxy, from_config
from warmup_agent.states import State

CHAT = {"model": "stand-in", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True}


def raw_request(port: int, payload: dict | bytes, path: str = "/v1/chat/completions", headers: str = "",
                timeout: float = 10) -> tuple[socket.socket, bytes]:
    """Send one POST on a new connection; return the socket and the bytes read until
    the first body byte arrived (the head, and the first chunk with it)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n{headers}\r\n".encode() + body)
    got = b""
    while b"\r\n\r\n" not in got or got.endswith(b"\r\n\r\n"):
        part = s.recv(65536)
        if not part:
            break
        got += part
    return s, got


def post(port: int, payload: dict | bytes, path: str = "/v1/chat/completions", timeout: float = 10,
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def openai_error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


@pytest.fixture
def agent(embedded_model):
    return make_agent(embedded_model, State.SERVING)


def test_a_client_that_disconnects_mid_stream_releases_its_upstream_request(agent):
    # 3 s between events: the proxy must not wait for the next one to notice the client left.
    standin = OpenAIStandIn(first_token_s=0.01, chunks=5, interval_s=3.0)
    proxy = RoutingProxy(agent, standin.url).start()
    try:
        s, got = raw_request(proxy.port, CHAT)
        assert got.startswith(b"HTTP/1.1 200") and b"tok0" in got
        assert len(standin.started) == 1 and standin.aborted == []
        t0 = time.monotonic()
        s.close()
        # The upstream sees its answer's connection closed, well before its next event.
        wait_until(lambda: standin.aborted, timeout=2.0, interval=0.02, what="the upstream sees the connection closed")
        assert time.monotonic() - t0 < 2.0 and standin.finished == []
        # The proxy goes on serving: the next answer comes whole (pool not poisoned).
        fast = OpenAIStandIn()
        proxy2 = RoutingProxy(agent, fast.url).start()
        try:
            status, _, body = post(proxy2.port, CHAT)
            assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        finally:
            proxy2.stop()
            fast.stop()
    finally:
        proxy.stop()
        standin.stop()


def test_an_oversized_body_is_413_with_an_openai_error_and_never_reaches_the_upstream(agent):
    standin = OpenAIStandIn()
    proxy = RoutingProxy(agent, standin.url, max_body_bytes=4096).start()
    try:
        big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
        status, headers, body = post(proxy.port, big)
        assert status == 413 and headers["content-type"].startswith("application/json")
        err = openai_error(body)
        assert err["code"] == 413 and "4096" in err["message"] and "proxy.max_body_bytes" in err["message"]
        # Chunked, without a Content-Length: bounded all the same.
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  + b"%x\r\n%s\r\n" % (len(big), big) + b"0\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 413")
        s.close()
        assert standin.started == []
        # Within the bound: answered; a client that asks whether to send its body is told to at once.
        status, _, body = post(proxy.port, CHAT)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n") and len(standin.started) == 1
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        small = json.dumps(CHAT).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(small))
        s.settimeout(0.5)
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue")
        s.settimeout(10)
        s.sendall(small)
        got = b""
        while b"[DONE]" not in got:
            got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
        s.close()
    finally:
        proxy.stop()
        standin.stop()


def test_a_stalled_upstream_is_504_with_an_openai_error_while_other_requests_are_answered(agent):
    standin = OpenAIStandIn()
    proxy = RoutingProxy(agent, standin.url, timeout_seconds=1.5).start()
    results: dict = {}

    def stalled(name: str, payload: dict) -> None:
        t0 = time.monotonic()
        results[name] = (*post(proxy.port, payload), time.monotonic() - t0)

    try:
        threads = [threading.Thread(target=stalled, args=(name, {**CHAT, "stand_in_stall": how}))
                   for name, how in (("no_head", "head"), ("no_chunk", 0), ("mid_stream", 2))]
        for t in threads:
            t.start()
        wait_until(lambda: len(standin.started) == 3, timeout=5, interval=0.02, what="three stalled requests")
        # Meanwhile another request through the same proxy and upstream is answered whole, at once.
        t0 = time.monotonic()
        status, _, body = post(proxy.port, CHAT)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n") and time.monotonic() - t0 < 1.0
        assert "no_head" not in results
        for t in threads:
            t.join(10)
        for name in ("no_head", "no_chunk"):
            status, headers, body, seconds = results[name]
            assert status == 504, (name, status, body)
            err = openai_error(body)
            assert err["code"] == 504 and err["type"] == "upstream_timeout" and "proxy.timeout_seconds" in err["message"]
            assert 1.4 < seconds < 5
        # Mid-stream the status is gone: the stream ends with an OpenAI error event.
        status, _, body, _ = results["mid_stream"]
        assert status == 200 and b"tok1" in body and b"[DONE]" not in body
        last = [line for line in body.decode().split("\n") if line.startswith("data: ")][-1]
        assert json.loads(last[6:])["error"]["code"] == 504
        # The proxy closed its upstream connections of the stalled answers.
        wait_until(lambda: len(standin.aborted) == 3, timeout=3, interval=0.02, what="stalled answers released")
        reg = agent.metrics.registry
        assert reg.get_sample_value("warmup_proxy_requests_total", {"route": "main", "code": "504"}) == 2
    finally:
        proxy.stop()
        standin.stop()


async def _burst(port: int, n: int, request: bytes) -> list[tuple[float, bytes]]:
    """n clients connect at the same moment; each: (seconds to connect, its whole answer)."""
    start = asyncio.Event()

    async def one() -> tuple[float, bytes]:
        await start.wait()
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        connected = time.perf_counter() - t0
        writer.write(request)
        data = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return connected, data

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    await asyncio.sleep(0.05)
    start.set()
    return list(await asyncio.gather(*tasks))


def test_256_clients_connecting_at_once_are_all_answered_without_a_syn_retry(agent):
    standin = OpenAIStandIn()
    proxy = RoutingProxy(agent, standin.url).start()
    exporter = ExporterServer(agent, agent.metrics.registry, "127.0.0.1", 0).start()
    try:
        body = json.dumps(CHAT).encode()
        chat = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        readyz = b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        for port, request, what in ((proxy.port, chat, b"data: [DONE]"), (exporter.port, readyz, b"SERVING")):
            answers = asyncio.run(_burst(port, 256, request))
            bad = [a[:200] for _, a in answers if a.split(b" ", 2)[1:2] != [b"200"] or what not in a]
            assert bad == [], bad[:3]
            # A SYN dropped by a full backlog is retried after 1 s: no connect may take that long.
            slowest = max(c for c, _ in answers)
            assert slowest < 1.0, f"a connect took {slowest:.2f} s (SYN retry)"
        assert len(standin.finished) == 256
    finally:
        exporter.stop()
        proxy.stop()
        standin.stop()


def test_the_pods_endpoints_answer_while_the_proxy_relays_many_streams(agent):
    # 200 streams of 2 s each through the proxy, and the kubelet's probe (1 s timeout) meanwhile.
    standin = OpenAIStandIn(first_token_s=0.01, chunks=100, interval_s=0.02)
    proxy = RoutingProxy(agent, standin.url).start()
    exporter = ExporterServer(agent, agent.metrics.registry, "127.0.0.1", 0).start()
    body = json.dumps(CHAT).encode()
    chat = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    streams: list = []
    t = threading.Thread(target=lambda: streams.extend(asyncio.run(_burst(proxy.port, 200, chat))))
    try:
        t.start()
        wait_until(lambda: len(standin.started) == 200, timeout=10, interval=0.02, what="200 streams started")
        probes = []
        while len(standin.finished) < 150 and len(probes) < 40:
            t0 = time.perf_counter()
            code, text = http_get(f"http://127.0.0.1:{exporter.port}/readyz", timeout=1.0)
            probes.append((code, text, time.perf_counter() - t0))
            code, _ = http_get(f"http://127.0.0.1:{exporter.port}/metrics", timeout=1.0)
            assert code == 200
            time.sleep(0.02)
        assert len(probes) >= 5 and all(c == 200 and x.strip() == "SERVING" for c, x, _ in probes), probes
        t.join(30)
        assert len(streams) == 200 and all(a.rstrip().endswith(b"data: [DONE]") or b"[DONE]" in a for _, a in streams)
    finally:
        t.join(30)
        exporter.stop()
        proxy.stop()
        standin.stop()


class LocalBackend:
    """An engine in this process as the proxy sees it (the torch engine's openai_backend()
    is one): answers each request with a few SSE events; records what was closed."""

    def __init__(self, gap: float = 0.0):
        self.gap = gap
        self.requests: list[tuple[str, str, bytes]] = []
        self.closed_bodies = 0
        self.finished_bodies = 0
        self.closed = False

    async def request(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> BackendResponse:
        self.requests.append((method, path, body))
        if path == "/v1/models":
            return BackendResponse(200, {"Content-Type": "application/json"}, _once(b'{"object": "list", "data": []}'))
        return BackendResponse(200, {"Content-Type": "text/event-stream"}, self._events())

    async def _events(self) -> AsyncIterator[bytes]:
        try:
            for i in range(3):
                if i:
                    await asyncio.sleep(self.gap)
                yield b'data: {"choices": [{"index": 0, "delta": {"content": "x%d"}}]}\n\n' % i
            yield b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}\n\ndata: [DONE]\n\n'
            self.finished_bodies += 1
        finally:
            self.closed_bodies += 1

    async def close(self) -> None:
        self.closed = True


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def test_an_engine_in_this_process_serves_through_the_proxy_and_users_answers_reach_the_gate(agent):
    answers: list = []
    agent.readiness.user_answer = lambda ttft, total, output_tokens=None, held=0.0: answers.append((ttft, total, output_tokens))
    backend = LocalBackend(gap=0.05)
    env = {"WARMUP_AGENT_PROXY_LISTEN": "127.0.0.1:0"}
    with pytest.raises(config.ConfigError):            # no URL and no engine in process: nothing to serve
        from_config(agent, *_proxy_sections(config.load(env=env)))
    proxy = from_config(agent, *_proxy_sections(config.load(env=env)), local_backend=backend)
    assert proxy is not None and proxy.main_name == "LocalBackend"
    proxy.start()
    try:
        t0 = time.perf_counter()
        status, headers, body = post(proxy.port, CHAT)
        elapsed = time.perf_counter() - t0
        assert status == 200 and headers["content-type"] == "text/event-stream" and body.endswith(b"data: [DONE]\n\n")
        assert backend.requests[0][:2] == ("POST", "/v1/chat/completions")
        # The user's answer: time to the first chunk, to the end (>= the two 50 ms gaps), its tokens.
        assert len(answers) == 1
        ttft, total, tokens = answers[0]
        assert 0 < ttft and ttft + 0.09 <= total <= elapsed and tokens == 3
        assert len(agent.readiness.window) == 1                   # streamed: the time to first token fed the window
        # Non-streamed answers count too; warmup-marked requests never do.
        assert post(proxy.port, {**CHAT, "stream": False})[0] == 200 and len(answers) == 2
        assert post(proxy.port, CHAT, headers={"X-Warmup": "true"})[0] == 200 and len(answers) == 2
        assert http_get(f"http://127.0.0.1:{proxy.port}/v1/models")[0] == 200 and len(answers) == 2   # no answer
        # A client that leaves closes the backend's body (the work behind it stops).
        slow = LocalBackend(gap=5.0)
        proxy2 = RoutingProxy(agent, slow).start()
        try:
            s, got = raw_request(proxy2.port, CHAT)
            assert b"x0" in got
            s.close()
            wait_until(lambda: slow.closed_bodies == 1, timeout=2, interval=0.02, what="the body closed")
            assert slow.finished_bodies == 0
        finally:
            proxy2.stop()
        assert slow.closed
    finally:
        proxy.stop()
    assert backend.closed


def _proxy_sections(cfg):
    """What from_config takes of a Config: the proxy section and openai.url."""
    return cfg.proxy, cfg.openai.url
