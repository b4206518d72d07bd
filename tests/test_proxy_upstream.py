"""The proxy's upstream client (warmup_agent/proxy/upstream.py): an answer's bytes go to
the client as the server sent them, however the reads split them, and the answer's end
is found (chunked, sized, or until the connection closes); what is not the answer is
never forwarded and never reused."""
from __future__ import annotations

import asyncio

import pytest

from warmup_agent.proxy.upstream import BackendUnavailable, UpstreamBackend, UpstreamConnection

EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(3)]
CHUNKED_BODY = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS)


class Sink:
    """A client transport: what was written, and whether it is closing."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closing = False

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return self.closing


class ServerEnd:
    """The upstream connection's own transport."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.aborted = self.paused = False

    def write(self, data: bytes) -> None:
        self.sent += data

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


class Proto:
    writing_paused = False


def _relay(pieces: list[bytes], close_after: bool = False) -> tuple[UpstreamConnection, Sink, ServerEnd]:
    """Send a request, feed the answer in `pieces`, relay the body to a Sink."""
    async def go() -> tuple[UpstreamConnection, Sink, ServerEnd]:
        backend = UpstreamBackend("http://127.0.0.1:9/base/", 5.0)
        conn = UpstreamConnection(backend)
        server = ServerEnd()
        conn.connection_made(server)  # type: ignore[arg-type]
        sent = asyncio.ensure_future(conn.send(backend.head_bytes("POST", "/v1/x", b"{}", {"A": "b"}) + b"{}"))
        await asyncio.sleep(0)
        sink = Sink()
        attached = False
        for piece in pieces:
            conn.data_received(piece)
            if sent.done() and not attached and conn.has_body():
                await sent
                conn.attach(sink, Proto(), reframe=conn.length is None and not conn.chunked)  # type: ignore[arg-type]
                attached = True
        if close_after:
            conn.connection_lost(None)
        await sent
        if not attached:
            conn.attach(sink, Proto(), reframe=conn.length is None and not conn.chunked)  # type: ignore[arg-type]
        assert await conn.wait() is True
        conn.flush()
        return conn, sink, server
    return asyncio.run(go())


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nX-Up: 1\r\n\r\n"


def test_the_request_goes_out_with_the_base_path_and_a_length():
    conn, _, server = _relay([HEAD + CHUNKED_BODY + b"0\r\n\r\n"])
    assert server.sent.startswith(b"POST /base/v1/x HTTP/1.1\r\nHost: 127.0.0.1:9\r\nA: b\r\nContent-Length: 2\r\n\r\n{}")
    assert conn.headers == {"Content-Type": "text/event-stream", "X-Up": "1"} and conn.status == 200


@pytest.mark.parametrize("split", [1, 2, 3, 5, 7, 64, 4096])
def test_chunks_pass_through_as_sent_however_the_reads_split_them(split):
    raw = HEAD + CHUNKED_BODY + b"0\r\nTrailer: x\r\n\r\n"
    pieces = [raw[i:i + split] for i in range(0, len(raw), split)]
    conn, sink, server = _relay(pieces)
    # The last chunk and its trailers are the proxy's to write (write_eof): not forwarded.
    assert bytes(sink.data) == CHUNKED_BODY
    assert conn.ended and conn.keep_alive and conn.at_boundary and not server.aborted
    if split >= len(CHUNKED_BODY):    # reads of whole events (what servers send): the usage is in the tail
        assert EVENTS[-1] in conn.tail_prev + conn.tail_last


def test_a_sized_answer_is_held_back_at_its_end_and_bytes_after_it_are_not_reused():
    body = b'{"usage": {"completion_tokens": 4}}'
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    conn, sink, _ = _relay([head + body[:10], body[10:]])
    assert bytes(sink.data) == body and conn.length == len(body) and conn.keep_alive
    conn, sink, _ = _relay([head + body + b"junk"])
    assert bytes(sink.data) == body and not conn.keep_alive


def test_an_answer_without_framing_ends_with_the_connection_and_is_reframed():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"
    conn, sink, _ = _relay([head + b"abc", b"de"], close_after=True)
    assert bytes(sink.data) == b"3\r\nabc\r\n2\r\nde\r\n" and not conn.keep_alive


def test_an_interim_answer_is_skipped_and_connection_close_is_not_reused():
    raw = b"HTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n" + HEAD.replace(b"X-Up: 1", b"Connection: close") \
        + CHUNKED_BODY + b"0\r\n\r\n"
    conn, sink, _ = _relay([raw])
    assert conn.status == 200 and bytes(sink.data) == CHUNKED_BODY and not conn.keep_alive


def test_a_bad_chunk_size_or_a_cut_answer_is_an_error():
    async def go(pieces: list[bytes], lost: bool) -> BaseException | None:
        backend = UpstreamBackend("http://127.0.0.1:9", 5.0)
        conn = UpstreamConnection(backend)
        conn.connection_made(ServerEnd())  # type: ignore[arg-type]
        sent = asyncio.ensure_future(conn.send(b"GET / HTTP/1.1\r\n\r\n"))
        await asyncio.sleep(0)
        for p in pieces:
            conn.data_received(p)
        if lost:
            conn.connection_lost(None)
        try:
            await sent
            await conn.wait_first()
            await conn.wait()
        except BackendUnavailable as e:
            return e
        return None
    assert "chunk size" in str(asyncio.run(go([HEAD + b"zz\r\n"], False)))
    assert "broke off" in str(asyncio.run(go([HEAD + CHUNKED_BODY], True)))
    assert "closed the connection" in str(asyncio.run(go([], True)))
    assert "not an HTTP" in str(asyncio.run(go([b"SSH-2.0\r\n\r\n"], False)))
