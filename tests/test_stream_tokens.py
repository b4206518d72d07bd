"""A streamed answer without usage: the proxy counts its tokens (issue 61) and the client
still gets exactly the bytes the server sent.

The events are as llama.cpp's llama-server and the CPU vLLM sent them here (ids and
times shortened): llama.cpp opens chat with a role chunk whose content is null, sends a
token past the vocabulary as an empty content, and closes with an empty delta; vLLM
opens with a role chunk whose content is empty and closes on its last token; both
close completions with (llama.cpp) or on (vLLM) a finish_reason.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading

import pytest

from exporter.metrics import AgentMetrics
from warmup_agent.proxy.routing import RoutingProxy
from warmup_agent.proxy.stream_tokens import StreamTokens
from warmup_agent.proxy.upstream import UpstreamBackend, UpstreamConnection


def sse(*objs: object) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


def chat(delta: dict, finish: str | None = None) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                                       "finish_reason": finish}]}


def text(piece: str, finish: str | None = None, usage: dict | None = None) -> dict:
    out: dict = {"id": "t", "object": "text_completion",
                 "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    return out


LLAMACPP_CHAT = sse(chat({"role": "assistant", "content": None}), chat({"content": " voku"}),
                    chat({"content": ""}), chat({"content": "\ufffd"}), chat({"content": " g"}),
                    {**chat({}, "length"), "timings": {"predicted_n": 4}}, b"[DONE]")
VLLM_CHAT = sse(chat({"role": "assistant", "content": ""}), chat({"content": "vi"}), chat({"content": " sice"}),
                chat({"content": " kaze"}, "length"), b"[DONE]")
LLAMACPP_COMPLETIONS = sse(text(" mu"), text(" conu"), text("", "length"), b"[DONE]")
VLLM_COMPLETIONS = sse(text(" gakubi"), text(" heriwu"), text(" tiha", "length"), b"[DONE]")
CASES = [(LLAMACPP_CHAT, 4), (VLLM_CHAT, 3), (LLAMACPP_COMPLETIONS, 2), (VLLM_COMPLETIONS, 3)]


@pytest.mark.parametrize("body,tokens", CASES)
@pytest.mark.parametrize("split", [1, 3, 17, 10_000])
@pytest.mark.parametrize("crlf", [False, True])
def test_content_chunks_are_counted_however_the_reads_split_them(body, tokens, split, crlf):
    if crlf:
        body = body.replace(b"\n", b"\r\n")
    counter = StreamTokens()
    for i in range(0, len(body), split):
        counter.feed(body[i:i + split])
    assert counter.count == tokens


def test_usage_error_and_non_json_events_are_not_tokens():
    counter = StreamTokens()
    counter.feed(sse({"choices": [], "usage": {"completion_tokens": 9}}, {"error": {"message": "x"}}, b"{not json",
                     {"choices": [{"delta": {"content": "a"}}, {"delta": {"content": "b"}}]}))
    assert counter.count == 2     # two choices (n=2), one token each


class _ServerEnd:
    def __init__(self) -> None:
        self.sent = bytearray()

    def write(self, data: bytes) -> None:
        self.sent += data

    def abort(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass


class _Sink(_ServerEnd):
    writing_paused = False


@pytest.mark.parametrize("split", [1, 5, 64, 100_000])
@pytest.mark.parametrize("chunked", [True, False])
def test_the_upstream_connection_counts_a_copy_and_forwards_the_bytes_as_sent(split, chunked):
    """Chunk framing split anywhere (mid size line, mid event, between CR and LF): the
    client's bytes are the server's, the count is the events' own."""
    events = [LLAMACPP_CHAT[i:i + 40] for i in range(0, len(LLAMACPP_CHAT), 40)]   # chunks cut mid-event
    if chunked:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
        raw = head + body + b"0\r\n\r\n"
    else:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(LLAMACPP_CHAT)
        body = LLAMACPP_CHAT
        raw = head + body

    async def go() -> tuple[UpstreamConnection, _Sink]:
        backend = UpstreamBackend("http://127.0.0.1:9", 5.0)
        conn = UpstreamConnection(backend)
        conn.connection_made(_ServerEnd())  # type: ignore[arg-type]
        sent = asyncio.ensure_future(conn.send(b"POST / HTTP/1.1\r\n\r\n", count_tokens=True))
        await asyncio.sleep(0)
        sink = _Sink()
        for i in range(0, len(raw), split):
            conn.data_received(raw[i:i + split])
        await sent
        conn.attach(sink, sink, reframe=False)  # type: ignore[arg-type]
        assert await conn.wait() is True
        conn.flush()
        return conn, sink
    conn, sink = asyncio.run(go())
    assert bytes(sink.sent) == body
    assert conn.tokens is not None and conn.tokens.count == 4


class _Gate:
    state_name = "SERVING"

    def __init__(self) -> None:
        self.answers: list[tuple[float, float, int | None]] = []

    def main_open(self) -> bool:
        return True

    def retry_after(self, default: float) -> float:
        return default

    def user_request(self) -> None:
        pass

    def first_tokens(self, ttfts: list[float]) -> None:
        pass

    def user_answer(self, ttft: float, total: float, output_tokens: int | None = None, held: float = 0.0) -> None:
        self.answers.append((ttft, total, output_tokens))


class _Agent:
    def __init__(self) -> None:
        self.readiness = _Gate()
        self.metrics = AgentMetrics()


def _raw_server(answer: bytes) -> tuple[int, threading.Thread]:
    """A server that answers one request with `answer`, written in uneven pieces."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)

    def serve() -> None:
        conn, _ = sock.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += conn.recv(65536)
        for i in range(0, len(answer), 23):
            conn.sendall(answer[i:i + 23])
        conn.close()
        sock.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return sock.getsockname()[1], t


@pytest.mark.parametrize("usage", [False, True])
def test_through_the_proxy_the_client_gets_the_servers_bytes_and_the_gate_the_count(usage):
    body = VLLM_CHAT
    if usage:   # a server that says its usage: that figure wins
        body = body.replace(b"data: [DONE]", sse({"choices": [], "usage": {"completion_tokens": 7}}) + b"data: [DONE]")
    events = [body[i:i + 50] for i in range(0, len(body), 50)]
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
              + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")
    port, served = _raw_server(answer)
    agent = _Agent()
    proxy = RoutingProxy(agent, f"http://127.0.0.1:{port}").start()  # type: ignore[arg-type]
    try:
        client = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        client.request("POST", "/v1/chat/completions", body=json.dumps({"messages": [], "stream": True}),
                       headers={"Content-Type": "application/json"})
        got = client.getresponse().read()
        served.join(5)
    finally:
        proxy.stop()
    assert got == body
    assert [a[2] for a in agent.readiness.answers] == [7 if usage else 3]
