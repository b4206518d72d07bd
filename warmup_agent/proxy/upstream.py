"""The proxy's HTTP upstream: a small HTTP/1.1 client on asyncio protocols, made for relaying.

An answer's head is parsed once and its body not at all: bytes go to the client's
transport from `data_received` as they come, with the server's chunk framing, which
is followed only to find the end.  Per streamed chunk that is one callback and one
write, with no task wake-up or copy, which is what keeps the proxy's CPU per request low.

Connections are reused last in, first out; one the server closed meanwhile is
replaced once.  A client that goes away aborts the upstream connection; a slow
client pauses reading from the upstream.
"""
from __future__ import annotations

import asyncio
import ssl
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from warmup_agent.proxy.stream_tokens import StreamTokens

# Hop-by-hop headers (RFC 9110 §7.6.1) are the proxy's own business on each leg.
HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                 "transfer-encoding", "upgrade", "host", "content-length",
                 "expect"})   # answered by the proxy (100 Continue); the upstream gets the whole body at once
# Idle keep-alive connections kept per upstream (more in flight is fine: they close when done).
UPSTREAM_CONNECTIONS = 1024
IDLE_SECONDS = 30.0
MAX_HEAD_BYTES = 64 * 1024

# Framing of an answer's body.
_LENGTH, _CHUNKED, _CLOSE = 0, 1, 2
# Where the chunked-body scanner is.
_SIZE, _DATA, _TRAILER, _DONE = 0, 1, 2, 3


class BackendUnavailable(Exception):
    """The backend could not take the request (the proxy answers 502 upstream_unavailable)."""


class _Reset(BackendUnavailable):
    """The connection closed before any byte of the answer (a reused one may be retried)."""


class UpstreamBackend:
    """An OpenAI-compatible server at `url`.  `timeout` bounds the connect (10 s at most); a
    server that stalls after it is timed out by the proxy's sweep, not by a timer per chunk."""

    def __init__(self, url: str, timeout: float, connections: int = UPSTREAM_CONNECTIONS):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url, self.timeout, self.connections = url, timeout, connections
        self.host = u.hostname
        self.tls = u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        default = 443 if self.tls else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if self.port == default else f"{host}:{self.port}"
        self._idle: list[UpstreamConnection] = []
        self._ssl: ssl.SSLContext | None = None

    async def _connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        if self.tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamConnection(self), self.host, self.port, ssl=self._ssl,
                                       server_hostname=self.host if self.tls else None),
                min(10.0, self.timeout))
        except OSError as e:
            raise BackendUnavailable(f"cannot connect to {self.host}:{self.port}: {e.strerror or e}") from None
        return conn

    def head_bytes(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"]
        for k, v in headers.items():
            lines.append(f"{k}: {v}\r\n")
        if body or method == "POST":
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        # As aiohttp's parser decoded them (UTF-8, undecodable bytes kept as surrogates): the bytes the client sent.
        return "".join(lines).encode("utf-8", "surrogateescape")

    async def open(self, method: str, path: str, body: bytes, headers: Mapping[str, str],
                   count_tokens: bool = False) -> UpstreamConnection:
        """Send the request; return the connection once the answer's head has come (its
        status, headers and framing parsed).  `count_tokens`: count the answer's streamed
        tokens as they pass (the connection's `tokens`, stream_tokens.py).  Raises
        BackendUnavailable, or TimeoutError for a connect that timed out; cancelled, the
        connection is aborted."""
        data = self.head_bytes(method, path, body, headers) + body
        for attempt in (0, 1):
            conn = None
            while self._idle:
                c = self._idle.pop()
                if c.usable():
                    conn = c
                    break
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                await conn.send(data, count_tokens)
                return conn
            except _Reset:
                conn.abort()
                if reused and attempt == 0:
                    continue          # a kept-alive connection the server closed meanwhile: once more, fresh
                raise BackendUnavailable("the server closed the connection") from None
            except BaseException:
                conn.abort()          # cancelled (client gone, stall), or the head was not HTTP
                raise
        raise AssertionError("unreachable")

    def release(self, conn: UpstreamConnection) -> None:
        if conn.usable() and len(self._idle) < self.connections:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.abort()

    def close_idle(self, older_than: float = IDLE_SECONDS) -> None:
        """Close connections idle for more than `older_than` seconds (the proxy's sweep)."""
        if not self._idle:
            return
        now = time.monotonic()
        keep = []
        for c in self._idle:
            if c.usable() and now - c.idle_since < older_than:
                keep.append(c)
            else:
                c.abort()
        self._idle = keep

    async def close(self) -> None:
        self.close_idle(-1.0)


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to the upstream, and the answer it is receiving.

    Body bytes that come before `attach` are held; after it every byte goes to the
    client's transport.  `first_at` is the first body byte's perf_counter time, the
    tail the body's last two pieces (where the usage object is)."""

    def __init__(self, backend: UpstreamBackend):
        self.backend = backend
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.watch: Any = None           # the proxy's _Watch: .chunks counts what came
        self._loop: asyncio.AbstractEventLoop | None = None    # the loop of the request sent last
        self._reset()

    def _reset(self) -> None:
        self._head_wait: asyncio.Future[None] | None = None
        self._buf = bytearray()
        self._head_done = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.length: int | None = None
        self.keep_alive = True
        self.framing = _LENGTH
        self._remaining = 0
        self._state = _SIZE
        self._carry = b""
        self._held: list[bytes] = []
        self._client: asyncio.Transport | None = None
        self._client_proto: Any = None
        self._reframe = False
        self._event: asyncio.Future[bool] | None = None
        self.ended = False
        self.error: BaseException | None = None
        self.first_at: float | None = None
        self.tail_prev = self.tail_last = b""
        self.at_boundary = True
        self.tokens: StreamTokens | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._head_done:
            if self._head_wait is not None and not self._head_wait.done():
                self._head_wait.set_exception(_Reset("the server closed the connection") if not self._buf
                                              else BackendUnavailable("the server closed the connection mid-head"))
            return
        if self.ended:
            return
        if self.framing == _CLOSE:
            self._end()
        else:
            self._fail(BackendUnavailable("the answer broke off (the server closed the connection)"))

    def data_received(self, data: bytes) -> None:
        if self._head_done:
            self._body(data)
            return
        if self._head_wait is None:        # idle: the server sent something unasked
            self.abort()
            return
        self._buf += data
        self._parse_head()

    def pause_writing(self) -> None:   # the request is small: no flow control on this leg
        pass

    def resume_writing(self) -> None:
        pass

    # -- the request and the head ------------------------------------------------------------------
    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    async def send(self, data: bytes, count_tokens: bool = False) -> None:
        assert self.transport is not None
        self._reset()
        if count_tokens:
            self.tokens = StreamTokens()
        self._loop = loop = asyncio.get_running_loop()
        self._head_wait = loop.create_future()
        self.transport.write(data)
        await self._head_wait

    def _parse_head(self) -> None:
        buf = self._buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self._head_error("the answer's head is too large")
                return
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            rest = bytes(buf[end + 4:])
            parts = lines[0].split(" ", 2)
            try:
                status = int(parts[1])
                version = parts[0]
                if not version.startswith("HTTP/1."):
                    raise ValueError(version)
            except (IndexError, ValueError):
                self._head_error(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
                return
            if 100 <= status < 200:          # an interim answer (103 Early Hints): the real one follows
                buf[:] = rest
                continue
            break
        headers: dict[str, str] = {}
        chunked = close = False
        length = None
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if not sep:
                continue
            value = value.strip()
            low = key.strip().lower()
            if low == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif low == "content-length":
                try:
                    length = int(value)
                except ValueError:
                    self._head_error(f"a bad Content-Length: {value!r}")
                    return
            elif low == "connection":
                close = "close" in value.lower()
            if low not in HOP:
                headers[key.strip()] = value
        self.status, self.headers = status, headers
        self.keep_alive = not close and version != "HTTP/1.0"
        if chunked:
            self.framing = _CHUNKED
        elif length is not None:
            self.framing, self.length, self._remaining = _LENGTH, length, length
        elif status in (204, 304):
            self.framing, self.length, self._remaining = _LENGTH, 0, 0
        else:
            self.framing, self.keep_alive = _CLOSE, False
        self._head_done = True
        self._buf = bytearray()
        assert self._head_wait is not None
        self._head_wait.set_result(None)
        if self.framing == _LENGTH and self._remaining == 0:
            self._end()
        if rest:
            self._body(rest)

    def _head_error(self, message: str) -> None:
        if self._head_wait is not None and not self._head_wait.done():
            self._head_wait.set_exception(BackendUnavailable(message))
        self.abort()

    # -- the body --------------------------------------------------------------------------------
    def _body(self, data: bytes) -> None:
        if self.ended:          # more than the answer: the connection is not reused
            self.keep_alive = False
            return
        watch = self.watch
        if watch is not None:
            watch.chunks += 1
        if self.first_at is None:
            self.first_at = time.perf_counter()
        framing = self.framing
        if framing == _CHUNKED:
            out, done = self._scan(data)
            if self.error is not None:
                return
        elif framing == _LENGTH:
            n = len(data)
            if n >= self._remaining:
                if n > self._remaining:
                    self.keep_alive = False
                out, done = data[:self._remaining], True
                self._remaining = 0
            else:
                self._remaining -= n
                out, done = data, False
        else:
            out, done = data, False
        if self.tokens is not None and framing != _CHUNKED and out:
            self.tokens.feed(out)
        if out:
            self.tail_prev, self.tail_last = self.tail_last, out
            client = self._client
            if client is None or (done and framing == _LENGTH):
                # Before attach; or the last bytes of a sized answer, which the proxy writes
                # itself (flush) after it has recorded the answer.
                self._held.append(out)
                self._wake(True)            # wait_first: the proxy's head may go
            elif client.is_closing():       # the client went away: its handler is being cancelled
                self.transport.pause_reading()  # type: ignore[union-attr]
                return
            elif self._reframe:
                client.write(b"%x\r\n%s\r\n" % (len(out), out))
            else:
                client.write(out)
        if done:
            self._end()
        elif self._client is not None and self._client_proto.writing_paused:
            self.transport.pause_reading()   # type: ignore[union-attr]
            self._wake(False)

    def _scan(self, data: bytes) -> tuple[bytes, bool]:
        """Follow the chunk framing through `data`; return the bytes to forward (the
        chunks as they came, up to the last chunk's zero-size line, which the proxy
        writes itself) and whether the body ended.  A size line split between two
        reads is held back until it is whole."""
        if self._carry:
            data = self._carry + data
            self._carry = b""
        elif self._state == _SIZE:
            # The usual read under a stream: exactly one whole chunk (its size line, its
            # data, its CRLF), as the loop below would take it in two turns.
            eol = data.find(b"\r\n")
            if eol > 0:
                try:
                    size = int(data[:eol].split(b";", 1)[0], 16)
                except ValueError:
                    size = 0                                  # the loop below says why
                if size > 0 and len(data) == eol + size + 4:
                    if self.tokens is not None:
                        self.tokens.feed(data[eol + 2:eol + 2 + size])
                    self.at_boundary = True
                    return data, False
        state = self._state
        pos, n, fwd = 0, len(data), (0 if state == _TRAILER else -1)
        while pos < n:
            if state == _DATA:
                take = min(self._remaining, n - pos)
                if self.tokens is not None and self._remaining > 2:   # the chunk's data, not its CRLF
                    self.tokens.feed(data[pos:pos + min(take, self._remaining - 2)])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    state = _SIZE
                continue
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                self._carry = data[pos:]
                if fwd < 0:
                    fwd = pos
                break
            if state == _SIZE:
                try:
                    size = int(data[pos:eol].split(b";", 1)[0], 16)
                except ValueError:
                    self._fail(BackendUnavailable(f"a bad chunk size line: {bytes(data[pos:eol])[:40]!r}"))
                    return b"", False
                if size == 0:
                    fwd, state = pos, _TRAILER
                else:
                    state, self._remaining = _DATA, size + 2
                pos = eol + 2
            else:   # _TRAILER: trailer lines (dropped) until an empty one
                empty = eol == pos
                pos = eol + 2
                if empty:
                    state = _DONE
                    if pos < n:
                        self.keep_alive = False    # bytes after the answer: not reusable
                    break
        self._state = state
        self.at_boundary = state != _DATA    # what was forwarded ends where a chunk ends
        if fwd < 0:
            fwd = n
        return (data if fwd >= n else data[:fwd]), state == _DONE

    def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self._wake(True)

    def _fail(self, error: BaseException) -> None:
        if self.ended:
            return
        self.ended = True
        self.error = error
        self.keep_alive = False
        if self._event is not None and not self._event.done():
            self._event.set_exception(error)
        if self.transport is not None:
            self.transport.abort()

    def _wake(self, value: bool) -> None:
        if self._event is not None and not self._event.done():
            self._event.set_result(value)

    # -- the relay -------------------------------------------------------------------------------
    def attach(self, transport: asyncio.Transport, protocol: Any, reframe: bool) -> None:
        """From now on the body goes to `transport` (aiohttp's server `protocol` says when
        it wants draining); `reframe`: wrap each piece in a chunk of its own (an answer
        without chunk framing sent to the client chunked)."""
        self._client, self._client_proto, self._reframe = transport, protocol, reframe
        if not self.ended:
            self.flush()

    def flush(self) -> None:
        """Write the body bytes held so far to the client (attach does while the body goes on;
        the proxy does at the end, after recording the answer)."""
        held, self._held = self._held, []
        transport = self._client
        if transport is None or transport.is_closing():
            return
        for out in held:
            transport.write(b"%x\r\n%s\r\n" % (len(out), out) if self._reframe else out)

    @property
    def chunked(self) -> bool:
        return self.framing == _CHUNKED

    def has_body(self) -> bool:
        """Whether a body byte came, or the body ended (the proxy's head may go)."""
        return self.first_at is not None or self.ended

    async def wait(self) -> bool:
        """True when the body has ended; False when the client's transport wants draining
        (call resume() after draining it)."""
        if self.error is not None:
            raise self.error
        if self.ended:
            return True
        self._event = (self._loop or asyncio.get_running_loop()).create_future()
        try:
            return await self._event
        finally:
            self._event = None

    async def wait_first(self) -> None:
        """Until the first body byte, or the body's end."""
        while not self.has_body():
            if self.error is not None:
                raise self.error
            self._event = (self._loop or asyncio.get_running_loop()).create_future()
            try:
                await self._event
            finally:
                self._event = None
        if self.error is not None:
            raise self.error

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def finish(self) -> None:
        """The answer is over (or abandoned): back to the pool if it ended cleanly."""
        self._client = self._client_proto = None
        self._held = []
        self.watch = None
        if self.ended and self.error is None and self.keep_alive and self._head_done:
            self._head_wait = None
            self.backend.release(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        self.ended = True
        if self.transport is not None:
            self.transport.abort()
