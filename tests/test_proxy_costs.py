"""What the proxy does per chunk and per request, made cheaper without changing its figures
(issue 71, item 5).

The token count is read once per answer: StreamTokens keeps the pieces as they pass and
reads the events when the answer's tokens are asked for, from the last one back.  Its
figures are those of reading every event as it came (the reference below, the counter as
it was), however the reads split the body, with CRs or without; an answer that ends with
its usage reads only its last events; a long one holds at most SETTLE_BYTES bytes
unread.  The usage numbers in an answer's tail are found as the lookbehind pattern found
them, and a request body is parsed once for the stream flag and the shape."""
from __future__ import annotations

import json
import random

import pytest

from tests.test_stream_tokens import _ServerEnd
from warmup_agent.proxy import routing, stream_tokens
from warmup_agent.proxy.stream_tokens import SETTLE_BYTES, StreamTokens, _is_token


class EveryEvent:
    """The reference: each event read with json.loads as it comes."""

    def __init__(self) -> None:
        self.buf, self.count, self.usage = b"", 0, None

    def feed(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else bytes(data)
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        start = 0
        while (end := buf.find(b"\n\n", start)) >= 0:
            self.event(buf[start:end])
            start = end + 2
        self.buf = buf[start:]

    def event(self, event: bytes) -> None:
        if b'"choices"' not in event and b'"usage"' not in event:
            return
        payload = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
        try:
            obj = json.loads(payload)
            choices, usage = obj.get("choices"), obj.get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(choices, list):
            self.count += sum(1 for c in choices if _is_token(c))
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage = usage["completion_tokens"]

    @property
    def tokens(self) -> int:
        return self.usage if self.usage is not None else self.count


PIECES = [b"data: ", b"data:", b"\n", b"\n\n", b"\r\n", b"\r", b" ", b"[DONE]", b"{}", b"{", b"}", b"\x00", b"\xff\xfe",
          b'{"choices":[{"delta":{"content":"a"}}]}', b'{"choices":[{"text":""}]}', b'{"choices":',
          b'[{"text":"x"}]}', b'{"choices":[{"delta":{"role":"assistant","content":""}}]}',
          b'{"choices":[{"delta":{},"finish_reason":"stop"}]}', b'{"choices":[],"usage":{"completion_tokens":5}}',
          b'{"usage":{"completion_tokens":true}}', b'{"usage":{"completion_tokens":3}} ', b'{\x00}',
          b'{"a":1},{"choices":[{"text":"q"}]}', b'{"choices":[{"text":"\xed\xa0\x80"}]}', b'"usage"', b'"choices"']


@pytest.mark.parametrize("crs", [True, False])
def test_the_count_and_the_usage_are_those_of_reading_every_event_as_it_came(monkeypatch, crs):
    rng = random.Random(71)
    pieces = PIECES if crs else [p for p in PIECES if b"\r" not in p]
    for _ in range(3000):
        body = b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        cuts = sorted(rng.sample(range(len(body) + 1), min(len(body) + 1, rng.randint(0, 6))))
        monkeypatch.setattr(stream_tokens, "SETTLE_BYTES", rng.choice([1, 20, 100, 64 * 1024]))
        ref, lazy = EveryEvent(), StreamTokens()
        for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
            ref.feed(body[a:b])
            lazy.feed(body[a:b])
            if rng.random() < 0.2:                    # asked mid-stream, then fed on
                assert lazy.tokens == ref.tokens, body
        assert (lazy.tokens, lazy.count, lazy.usage) == (ref.tokens, ref.count, ref.usage), body


def _chat(i: int, usage: bool = False) -> bytes:
    obj: dict = {"id": "c", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]}
    if usage:
        obj["usage"] = {"prompt_tokens": 8, "completion_tokens": 99, "total_tokens": 107}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_an_answer_that_ends_with_its_usage_reads_only_its_last_events(monkeypatch):
    read: list[bytes] = []
    parse = stream_tokens._parse
    monkeypatch.setattr(stream_tokens, "_parse", lambda event: read.append(event) or parse(event))
    counter = StreamTokens()
    for i in range(31):
        counter.feed(_chat(i))
    counter.feed(_chat(31, usage=True))
    counter.feed(b"data: [DONE]\n\n")
    assert counter.tokens == 99
    assert len(read) == 2                 # [DONE], then the usage event
    assert counter.count == 32            # asked for, every event is read


def test_a_long_answer_holds_few_bytes_unread():
    counter = StreamTokens()
    n = 10 * SETTLE_BYTES // len(_chat(0))
    for i in range(n):
        counter.feed(_chat(i))
        assert sum(map(len, counter._parts)) < SETTLE_BYTES
    assert counter.tokens == n


def test_a_payload_nested_past_the_parsers_depth_is_no_event():
    counter = StreamTokens()
    counter.feed(b'data: {"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n\n" + _chat(1))
    assert counter.tokens == 1


def test_the_tails_usage_numbers_are_found_as_the_lookbehind_pattern_found_them():
    import re
    before = re.compile(rb'(?<!\\)"prompt_tokens"\s*:\s*(\d+)')
    rng = random.Random(5)
    pieces = [b'"prompt_tokens"', b"\\", b": ", b"12", b'"', b" ", b"x", b'\\"prompt_tokens":5', b":", b"7"]
    for _ in range(20000):
        tail = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        found = before.findall(tail)
        assert routing._last_int(routing._PROMPT_TOKENS, tail) == (int(found[-1]) if found else None), tail


@pytest.mark.parametrize("body", [b"", b"null", b"[1]", b'{"stream": true}', b'{"stream": false}', b'{"a": 1}',
                                  b'{"\\u0073tream": true}', b'{"stream": 1', b'"stream"', b'{"stream": "yes"}'])
def test_a_body_parsed_once_says_stream_as_before(body):
    parsed = routing._json_or_none(body)
    assert routing._is_stream(body, parsed) == routing._is_stream(body)


class _End(_ServerEnd):
    """test_stream_tokens' transport stub, as a client's end too (the relay reads writing_paused)."""
    writing_paused = False


@pytest.mark.parametrize("reads", ["chunk", "random"])
def test_a_read_of_one_whole_chunk_is_relayed_and_counted_as_any_other(reads):
    """The upstream connection's quick path (a read that is exactly one chunk) forwards and
    counts what the chunk scanner does, chunk extensions and all."""
    import asyncio

    from warmup_agent.proxy.upstream import UpstreamBackend, UpstreamConnection
    rng = random.Random(9)
    events = [_chat(i) for i in range(40)] + [_chat(40, usage=True), b"data: [DONE]\n\n"]
    chunks = [b"%x%s\r\n%s\r\n" % (len(e), b";ext=1" if i % 7 == 3 else b"", e) for i, e in enumerate(events)]
    raw = b"".join(chunks) + b"0\r\n\r\n"
    if reads == "chunk":
        pieces = [*chunks, b"0\r\n\r\n"]
    else:
        cuts = sorted(rng.sample(range(1, len(raw)), 60))
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]

    async def go() -> tuple[UpstreamConnection, _End]:
        conn = UpstreamConnection(UpstreamBackend("http://127.0.0.1:9", 5.0))
        conn.connection_made(_End())  # type: ignore[arg-type]
        sent = asyncio.ensure_future(conn.send(b"POST / HTTP/1.1\r\n\r\n", count_tokens=True))
        await asyncio.sleep(0)
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await sent
        sink = _End()
        conn.attach(sink, sink, reframe=False)  # type: ignore[arg-type]
        for piece in pieces:
            conn.data_received(piece)
        assert await conn.wait() is True
        return conn, sink
    conn, sink = asyncio.run(go())
    assert bytes(sink.sent) == b"".join(chunks)          # all but the last chunk's zero line (the proxy's own)
    assert conn.tokens is not None and (conn.tokens.tokens, conn.tokens.count) == (99, 41)
