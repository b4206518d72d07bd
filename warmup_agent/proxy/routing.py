"""Cold-start-aware routing: an OpenAI-compatible reverse proxy in front of the engine.

    client -> proxy -> main engine        when SERVING and the breaker is closed
                    -> fallback upstream  while not, if configured
                    -> held               while the pod warms (a start, a restart, a wake),
                                          up to hold_seconds, then the main engine
                    -> 503 + Retry-After  otherwise, or past the hold

Completions, chat completions and `/v1/models` are proxied; streams pass through chunk
by chunk, unchanged.  Requests with `X-Warmup: true` (the agent's own) always go to the
main engine and never reach the user-facing counters, the window or the water level.

A user's streamed request to the main engine feeds its time to first byte into the
readiness window, and every 200 from the main engine is reported to the gate as
`user_answer`.  The client's bytes are never changed.

The proxy runs on its own event loop in its own thread (in its own process, process.py,
where the main engine is an HTTP server) so the relay and the exporter never share a GIL.
A client that goes away cancels its upstream request; an upstream silent for
proxy.timeout_seconds gets a 504 (or, mid-stream, an error event).  Every answer the
proxy makes itself is an OpenAI error body.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from aiohttp import web

    from exporter.metrics import AgentMetrics

from warmup_agent.proxy.stream_tokens import StreamTokens
from warmup_agent.proxy.upstream import HOP as _HOP
from warmup_agent.proxy.upstream import BackendUnavailable, UpstreamBackend, UpstreamConnection
from warmup_agent.server import listener
from warmup_agent.warmup import learned
from warmup_agent.warmup.learned import Shape

log = logging.getLogger("warmup_agent.proxy")

POST_PATHS = ("/v1/completions", "/v1/chat/completions")
GET_PATHS = ("/v1/models",)
WARMUP_HEADER = "X-Warmup"
# States in which a user's request waits for the gate rather than being refused: the
# pod is warming (or asleep, and a request wakes it); the gate will open by itself.
HOLD_STATES = frozenset({"INIT", "PRELOAD", "PRIME", "SLEEPING"})
HOLD_POLL_SECONDS = 0.005      # how often held requests look at the gate (one poller for all)
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# The last `"completion_tokens": N` of an answer (the usage object ends OpenAI and vLLM
# answers); a quote inside generated text is escaped, so it cannot match there (_last_int
# drops a match after a backslash: a lookbehind in the pattern would cost its literal search).
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
# llama-server's last chunk, usage or not: the prompt tokens it evaluated and its cache held.
_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d+)')
_CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d+)')


class Gate(Protocol):
    """All the proxy asks of the agent's readiness (readiness.runtime.Readiness is one)."""

    @property
    def state_name(self) -> str: ...

    def main_open(self) -> bool:
        """User traffic may go to the main engine now."""

    def retry_after(self, default: float) -> float:
        """Seconds a rejected client should wait."""

    def user_request(self) -> None:
        """A user request arrived (the water level's QPS; in flight until user_done)."""

    def user_done(self) -> None:
        """A user request the proxy answered, refused or lost: no longer in flight."""

    def first_tokens(self, ttfts: list[float]) -> None:
        """User requests' times to first token on the main engine, in order (the window, the breaker)."""

    def user_answer(self, ttft: float, total: float, output_tokens: int | None = None, held: float = 0.0) -> None:
        """A user request the main engine answered with 200: seconds from its release to its first
        body chunk and to its end, its output tokens where known, and the seconds it was held."""

    def user_shape(self, shape: Shape, params: dict[str, Any]) -> None:
        """The shape of a user request the main engine answered (never its text)."""


class RoutedAgent(Protocol):
    """The agent as the proxy sees it (pipeline.Agent is one): its gate and its metrics."""

    @property
    def readiness(self) -> Gate: ...

    @property
    def metrics(self) -> AgentMetrics: ...


# -- backends -------------------------------------------------------------------------------

@dataclass
class BackendResponse:
    """One answer of a backend.  Without a Content-Length header the answer is chunked;
    closing `body` cancels the work behind it."""
    status: int
    headers: dict[str, str]
    body: AsyncIterator[bytes]


class Backend(Protocol):
    """Where the proxy sends a request, called on the proxy's event loop.  Raise
    BackendUnavailable or OSError for 502, TimeoutError for 504; anything else is a 500."""

    async def request(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> BackendResponse: ...

    async def close(self) -> None: ...


# asyncio.TimeoutError is TimeoutError only from 3.11 on.
_TIMEOUTS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError)
_CANCELLED_OR_TIMEOUTS: tuple[type[BaseException], ...] = (asyncio.CancelledError, *_TIMEOUTS)


# -- the proxy ------------------------------------------------------------------------------

def listen_backlog() -> int:
    return listener.backlog()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _bind(listen: tuple[str, int]) -> socket.socket:
    return listener.bind(listen)


def _name(backend: Any) -> str:
    return str(getattr(backend, "url", None) or type(backend).__name__)


class RoutingProxy:
    """The proxy for `agent`.  upstream_url and fallback_url are base URLs or Backends;
    `listen` is bound here so an address in use fails at once.  tune_gc applies
    _tune_gc until stop(), for a process that only relays."""

    def __init__(self, agent: RoutedAgent, upstream_url: str | Backend, fallback_url: str | Backend | None = None,
                 listen: tuple[str, int] | socket.socket = ("127.0.0.1", 0), metrics: AgentMetrics | None = None,
                 retry_after_seconds: int = 5, timeout_seconds: float = 300.0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tune_gc: bool = False, hold_seconds: float = 0.0):
        self.metrics = metrics if metrics is not None else agent.metrics
        self.gate = agent.readiness
        self.timeout = timeout_seconds
        self.main: Backend | UpstreamBackend = (UpstreamBackend(upstream_url, timeout_seconds) if isinstance(upstream_url, str)
                              else upstream_url)
        self.fallback: Backend | UpstreamBackend | None = (UpstreamBackend(fallback_url, timeout_seconds) if isinstance(fallback_url, str)
                                         else fallback_url)
        self.retry_after_seconds = retry_after_seconds
        self.max_body_bytes = max_body_bytes
        # No hold where a fallback serves users meanwhile: they are answered at once there.
        self.hold_seconds = hold_seconds if self.fallback is None else 0.0
        self._hold = _Hold(self.gate)
        self.sock = _bind(listen) if isinstance(listen, tuple) else listen   # or a listening socket (process.py)
        self.sock.setblocking(False)
        self.host, self.port = self.sock.getsockname()[:2]
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.ServerRunner | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._watches: set[_Watch] = set()
        self.tune_gc = tune_gc
        self._gc_before: tuple[int, int, int] | None = None

    @property
    def main_name(self) -> str:
        return _name(self.main)

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> RoutingProxy:
        if self.tune_gc:
            self._gc_before = _tune_gc()
        self._thread = threading.Thread(target=self._run, name="routing-proxy", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._start_error is not None:
            raise self._start_error
        log.info("routing proxy on %s:%d -> main %s, fallback %s", self.host, self.port, self.main_name,
                 _name(self.fallback) if self.fallback else
                 f"none (held up to {self.hold_seconds:g} s while warming, then 503)")
        return self

    def _run(self) -> None:
        loop = self.loop = _new_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._start_error = e
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        from aiohttp import web
        # handler_cancellation: a client that disconnects cancels its upstream request.
        server = web.Server(self._handle, handler_cancellation=True, access_log=None)
        self._runner = web.ServerRunner(server, shutdown_timeout=5.0)
        await self._runner.setup()
        await web.SockSite(self._runner, self.sock, backlog=listen_backlog()).start()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Time out stalled answers: one pass a few times per timeout, not a timer per chunk."""
        loop = asyncio.get_running_loop()
        every = min(1.0, max(0.02, self.timeout / 5))
        idle_at = loop.time() + 5.0
        while True:
            await asyncio.sleep(every)
            now = loop.time()
            if now >= idle_at:               # idle upstream connections closed after a while
                idle_at = now + 5.0
                for b in (self.main, self.fallback):
                    if isinstance(b, UpstreamBackend):
                        b.close_idle()
            for w in list(self._watches):
                if not w.waiting or w.chunks != w.seen:
                    w.seen, w.since = w.chunks, now      # progress, or waiting on the client: not a stall
                elif now - w.since >= self.timeout and not w.stalled:
                    w.stalled = True
                    w.task.cancel()

    def stop(self) -> None:
        loop = self.loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            self.sock.close()
            return

        async def shutdown() -> None:
            self._sweeper.cancel()
            self._hold.stop()
            try:
                if self._runner is not None:
                    await self._runner.cleanup()
            finally:
                for b in (self.main, self.fallback):
                    if b is not None:
                        try:
                            await b.close()
                        except Exception:  # noqa: BLE001 - stopping: one line, go on
                            log.warning("closing backend %s failed", _name(b), exc_info=True)
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(30)
        except Exception:  # noqa: BLE001 - the loop is stopped anyway
            log.warning("routing proxy: unclean shutdown", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        self.sock.close()
        if self._gc_before is not None:
            import gc
            gc.set_threshold(*self._gc_before)
            gc.unfreeze()
            self._gc_before = None

    # -- routing -------------------------------------------------------------------------------
    def route(self, warmup: bool) -> str:
        """main | fallback | rejected, for a request arriving now."""
        if warmup or self.gate.main_open():
            return "main"
        if self.gate.state_name == "DRAINING":
            return "rejected"     # the pod is leaving: let the client go elsewhere
        return "fallback" if self.fallback is not None else "rejected"

    def retry_after(self) -> int:
        """The seconds left in the breaker's freeze while DEGRADED; else the configured value."""
        if self.gate.state_name != "DEGRADED":
            return self.retry_after_seconds
        return max(1, math.ceil(self.gate.retry_after(self.retry_after_seconds)))

    # -- one request -----------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t0 = time.perf_counter()
        path, method = request.path, request.method
        if not ((method == "POST" and path in POST_PATHS) or (method == "GET" and path in GET_PATHS)):
            return _error(404, "not_found", f"{method} {path} is not proxied")
        body = b""
        if method == "POST":
            length = request.content_length
            if length is not None and length > self.max_body_bytes:
                return _too_large(self.max_body_bytes, length)
            if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
                # The body follows our go-ahead (curl asks so for large bodies, else waits 1 s).
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0      # the answer has not begun (as aiohttp's own handler does)
            try:
                if length is not None:
                    body = await request.content.readexactly(length) if length else b""
                else:       # chunked: read up to the bound
                    parts, size = [], 0
                    while part := await request.content.readany():
                        size += len(part)
                        if size > self.max_body_bytes:
                            return _too_large(self.max_body_bytes, None)
                        parts.append(part)
                    body = b"".join(parts)
            except asyncio.IncompleteReadError:
                return _error(400, "invalid_request_error", "the request body ended early")
        warmup = request.headers.get(WARMUP_HEADER, "").strip().lower() == "true"
        if warmup:
            return await self._route(request, method, body, warmup, t0)
        self.gate.user_request()      # first: while asleep, this starts the wake it will wait for
        try:
            return await self._route(request, method, body, warmup, t0)
        finally:
            self.gate.user_done()     # in flight no more: the warm-up behind the users may go on

    async def _route(self, request: web.BaseRequest, method: str, body: bytes, warmup: bool,
                     t0: float) -> web.StreamResponse:
        route, held = self.route(warmup), 0.0
        if route == "rejected" and self.hold_seconds > 0 and self.gate.state_name in HOLD_STATES:
            route = await self._wait_for_gate()
            # Its time to first token counts from its release: the wait is the hold's own
            # figure, and must not reach the window or the breaker as a slow engine.
            held, t0 = time.perf_counter() - t0, time.perf_counter()
        # Count before the client has the answer, so a client that read it sees the count.
        if route == "rejected":
            retry = self.retry_after()
            self._count(route, 503, warmup)
            return _error(503, "warming_up", f"the model server is {self.gate.state_name}; retry in {retry} s",
                          {"Retry-After": str(retry)})
        backend = self.main if route == "main" else self.fallback
        assert backend is not None, "route() answers fallback only when there is one"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        task = asyncio.current_task()
        assert task is not None
        watch = _Watch(task, held)
        self._watches.add(watch)
        try:
            return await self._answer(request, method, body, headers, route, backend, warmup, t0, watch)
        finally:
            self._watches.discard(watch)

    async def _answer(self, request: web.BaseRequest, method: str, body: bytes, headers: dict[str, str], route: str,
                      backend: Backend | UpstreamBackend, warmup: bool, t0: float, watch: _Watch) -> web.StreamResponse:
        if isinstance(backend, UpstreamBackend):
            return await self._relay_upstream(request, method, body, headers, route, backend, warmup, t0, watch)
        try:
            watch.waiting = True
            try:
                answer = await backend.request(method, request.path_qs, body, headers)
            finally:
                watch.waiting = False
        except _CANCELLED_OR_TIMEOUTS as e:
            if isinstance(e, asyncio.CancelledError) and not watch.stalled:
                raise                        # the client went away
            _uncancel(watch)
            self._count(route, 504, warmup)
            return _error(504, "upstream_timeout", f"{route} upstream {_name(backend)} sent nothing for "
                          f"{self.timeout:g} s (proxy.timeout_seconds)")
        except (OSError, BackendUnavailable) as e:
            self._count(route, 502, warmup)
            return _error(502, "upstream_unavailable", f"{route} upstream {_name(backend)}: {e}")
        except Exception as e:  # noqa: BLE001 - a local backend's bug: the client gets a 500, we a traceback
            log.exception("%s backend %s failed", route, _name(backend))
            self._count(route, 500, warmup)
            return _error(500, "internal_error", f"{route} backend failed: {type(e).__name__}: {e}")
        measured = not warmup and answer.status == 200
        return await self._relay(request, answer, route, backend, warmup, t0, watch,
                                 stream=measured and _is_stream(body),
                                 answered=measured and route == "main" and method == "POST", body=body)

    async def _relay(self, request: web.BaseRequest, answer: BackendResponse, route: str, backend: Backend, warmup: bool,
                     t0: float, watch: _Watch, stream: bool, answered: bool, body: bytes = b"") -> web.StreamResponse:
        """Relay each chunk as it comes.  The head waits for the first chunk, so an
        upstream that stalls before it is a clean 504."""
        request_body, stream_body = body, answer.body
        headers = dict(answer.headers)
        length = None
        for k in list(headers):
            if k.lower() == "content-length":
                length = headers.pop(k)
        resp = _response(answer.status, headers, int(length) if length is not None else None)
        first: float | None = None
        prev = last = b""
        tokens = StreamTokens() if stream and answered else None
        nxt = stream_body.__aiter__().__anext__
        try:
            while True:
                watch.waiting = True
                try:
                    chunk = await nxt()
                except StopAsyncIteration:
                    break
                finally:
                    watch.waiting = False
                watch.chunks += 1
                if first is None:
                    first = time.perf_counter()
                    self._count(route, answer.status, warmup)
                    await resp.prepare(request)
                    await resp.write(chunk)
                    if stream:
                        self._first_token(route, first - t0)
                else:
                    await resp.write(chunk)
                if answered:
                    prev, last = last, chunk
                if tokens is not None:
                    tokens.feed(chunk)
            end = time.perf_counter()
            if first is None:       # an empty body
                self._count(route, answer.status, warmup)
                await resp.prepare(request)
            elif answered:
                self._user_answer(first - t0, end - t0, prev + last, tokens, request.path, request_body,
                                  held=watch.held)
            await resp.write_eof()
            return resp
        except _CANCELLED_OR_TIMEOUTS as e:
            if isinstance(e, asyncio.CancelledError) and not watch.stalled:
                raise                        # the client went away: the finally closes the body
            _uncancel(watch)
            message = f"{route} upstream {_name(backend)} sent nothing for {self.timeout:g} s (proxy.timeout_seconds)"
            log.warning("%s", message)
            if first is None:
                self._count(route, 504, warmup)
                return _error(504, "upstream_timeout", message)
            if headers.get("content-type", headers.get("Content-Type", "")).startswith("text/event-stream"):
                # Mid-stream: the status is gone; an error event is what OpenAI clients read.
                await resp.write(b"data: " + _error_body(504, "upstream_timeout", message) + b"\n\n")
                await resp.write_eof()
            resp.force_close()
            _hang_up(request)
            return resp
        except (OSError, BackendUnavailable) as e:
            # A client that went away (a failed write) or an answer that broke off.
            if isinstance(e, BackendUnavailable):
                log.warning("%s upstream: %s", route, e)
                if first is None:
                    self._count(route, 502, warmup)
                    return _error(502, "upstream_unavailable", f"{route} upstream: {e}")
            resp.force_close()
            _hang_up(request)
            return resp
        finally:
            aclose = getattr(stream_body, "aclose", None)
            if aclose is not None:
                await aclose()     # the work behind it ends (a no-op once the body is done)

    async def _relay_upstream(self, request: web.BaseRequest, method: str, body: bytes, headers: dict[str, str],
                              route: str, backend: UpstreamBackend, warmup: bool, t0: float,
                              watch: _Watch) -> web.StreamResponse:
        """Relay an HTTP upstream's answer: after the first body byte, bytes go from the
        upstream socket's callback straight to the client's transport."""
        conn: UpstreamConnection | None = None
        resp: web.StreamResponse | None = None
        first: float | None = None
        sse = False
        request_json = _json_or_none(body) if body and method == "POST" else None
        streamed = _is_stream(body, request_json)
        count = streamed and not warmup and route == "main" and method == "POST"
        try:
            watch.waiting = True
            try:
                conn = await backend.open(method, request.path_qs, body, headers, count_tokens=count)
                conn.watch = watch
                await conn.wait_first()
            finally:
                watch.waiting = False
            status = conn.status
            measured = not warmup and status == 200
            stream = measured and streamed
            answered = measured and route == "main" and method == "POST"
            resp = _response(status, conn.headers, conn.length)
            sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in conn.headers.items())
            first = conn.first_at
            self._count(route, status, warmup)
            await resp.prepare(request)
            if first is not None and stream:
                self._first_token(route, first - t0)
            transport = request.transport
            if transport is None:
                raise ConnectionResetError("the client went away")
            conn.attach(transport, request.protocol, reframe=conn.length is None and not conn.chunked)
            await _pump(conn, request, watch)
            if first is not None and answered:
                self._user_answer(first - t0, time.perf_counter() - t0, conn.tail_prev + conn.tail_last, conn.tokens,
                                  request.path, body, request_json, held=watch.held)
            conn.flush()                         # a sized answer's last bytes, once it is recorded
            await resp.write_eof()
            return resp
        except _CANCELLED_OR_TIMEOUTS as e:
            if isinstance(e, asyncio.CancelledError) and not watch.stalled:
                raise                        # the client went away: the finally aborts the upstream connection
            _uncancel(watch)
            message = f"{route} upstream {_name(backend)} sent nothing for {self.timeout:g} s (proxy.timeout_seconds)"
            if resp is None:
                if conn is not None:         # the connect timing out is a 504 too, but no stall
                    log.warning("%s", message)
                self._count(route, 504, warmup)
                return _error(504, "upstream_timeout", message)
            log.warning("%s", message)
            if sse and conn is not None and conn.length is None and conn.at_boundary:
                # Mid-stream: the status is gone; an error event is what OpenAI clients read.
                await resp.write(b"data: " + _error_body(504, "upstream_timeout", message) + b"\n\n")
                await resp.write_eof()
            resp.force_close()
            _hang_up(request)
            return resp
        except (OSError, BackendUnavailable) as e:
            # A client that went away (a failed write) or an answer that broke off.
            if isinstance(e, BackendUnavailable):
                log.warning("%s upstream: %s", route, e)
                if resp is None:
                    self._count(route, 502, warmup)
                    return _error(502, "upstream_unavailable", f"{route} upstream {_name(backend)}: {e}")
            if resp is None:
                raise
            resp.force_close()
            _hang_up(request)
            return resp
        finally:
            if conn is not None:
                conn.finish()                # to the pool when it ended cleanly, else aborted

    async def _wait_for_gate(self) -> str:
        """Hold a user's request until the gate opens ("main"), the pod leaves the warming
        states (route() again: fallback or rejected), or hold_seconds pass ("rejected")."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + self.hold_seconds
        outcome, route = "timed_out", "rejected"
        try:
            while True:
                if self.gate.main_open():
                    outcome, route = "served", "main"
                    break
                if self.gate.state_name not in HOLD_STATES:
                    outcome, route = "refused", self.route(False)
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                await self._hold.changed(remaining)
        except asyncio.CancelledError:
            outcome = "client_gone"
            raise
        finally:
            self.metrics.warmup_proxy_held_requests_total.labels(outcome=outcome).inc()
            self.metrics.warmup_proxy_hold_seconds.labels(outcome=outcome).observe(loop.time() - t0)
        return route

    def _first_token(self, route: str, ttft: float) -> None:
        """Record a user request's time to first token."""
        self.metrics.warmup_proxy_first_token_seconds.labels(route=route).observe(ttft)
        if route == "main":
            self.gate.first_tokens([ttft])    # the window and the breaker; never the probe log

    def _user_answer(self, ttft: float, total: float, tail: bytes, streamed: StreamTokens | None,
                     path: str, body: bytes, request_json: Any = None, held: float = 0.0) -> None:
        """Report a 200 from the main engine, with its usage's completion_tokens or the
        stream's counted tokens, and the request's shape (warmup/learned.py: never its
        text; prompt tokens as the server's usage counted them, else estimated).
        `request_json`: the body already parsed, where it was (None: parse it here)."""
        tokens = streamed.tokens if streamed is not None else _last_int(_COMPLETION_TOKENS, tail)
        try:
            self.gate.user_answer(ttft, total, output_tokens=tokens, held=held)
        except Exception:  # noqa: BLE001 - the user's answer must not fail on our bookkeeping
            log.exception("gate.user_answer failed")
        try:
            request = request_json if request_json is not None else json.loads(body)
            if isinstance(request, dict):
                shape, params = learned.shape_of("chat" if path.endswith("/chat/completions") else "completions",
                                                 request, _prompt_tokens(tail), tokens)
                self.gate.user_shape(shape, params)
        except Exception:  # noqa: BLE001 - as above
            log.exception("gate.user_shape failed")

    def _count(self, route: str, code: int, warmup: bool) -> None:
        if not warmup:
            self.metrics.warmup_proxy_requests_total.labels(route=route, code=str(code)).inc()


# -- helpers ----------------------------------------------------------------------------------

def _tune_gc() -> tuple[int, int, int]:
    """Freeze what exists and collect the young generation far less often; returns the
    thresholds to restore.  The relay allocates many short-lived objects per chunk and
    the default collector pauses showed in its tail latency (docs/readiness.md).  Not
    for a process with an engine: tensors in cycles would wait longer for their memory."""
    import gc
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    return before


class _Hold:
    """Where held requests wait: while anyone waits, one poller looks at the gate every
    HOLD_POLL_SECONDS and wakes them all once it opens or the pod leaves the warming
    states.  (The gate may live in another process, in shared memory: nothing calls back.)"""

    def __init__(self, gate: Gate):
        self.gate = gate
        self.waiters = 0
        self._event: asyncio.Event | None = None
        self._poller: asyncio.Task[None] | None = None

    async def changed(self, timeout: float) -> None:
        """Return when the hold may be over, or after `timeout` seconds."""
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        self.waiters += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except _TIMEOUTS:
            pass
        finally:
            self.waiters -= 1

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def _poll(self) -> None:
        while self.waiters > 0:
            await asyncio.sleep(HOLD_POLL_SECONDS)
            if self._event is not None and (self.gate.main_open() or self.gate.state_name not in HOLD_STATES):
                self._event.set()          # everyone waiting looks again
                self._event = asyncio.Event()


class _Watch:
    """One request in flight, as the sweep sees it."""
    __slots__ = ("task", "waiting", "chunks", "seen", "since", "stalled", "held")

    def __init__(self, task: asyncio.Task[Any], held: float = 0.0):
        self.task, self.held = task, held
        self.waiting = self.stalled = False
        self.chunks, self.seen, self.since = 0, -1, 0.0


def _uncancel(watch: _Watch) -> None:
    """The sweep's cancel was handled (a 504): the task goes on as if not cancelled."""
    if sys.version_info >= (3, 11):
        watch.task.uncancel()


def _prompt_tokens(tail: bytes) -> int | None:
    """The prompt's tokens as the server counted them: its usage, else llama-server's timings."""
    usage = _last_int(_PROMPT_TOKENS, tail)
    if usage is not None:
        return usage
    evaluated = _last_int(_PROMPT_N, tail)
    return None if evaluated is None else evaluated + (_last_int(_CACHE_N, tail) or 0)


def _last_int(pattern: re.Pattern[bytes], tail: bytes) -> int | None:
    """The number of the last match of `pattern` in `tail` not right after a backslash."""
    last = None
    for m in pattern.finditer(tail):
        if tail[m.start() - 1:m.start()] != b"\\":
            last = m
    return int(last.group(1)) if last is not None else None


def _json_or_none(body: bytes) -> Any:
    """The request body parsed once for the stream flag and the shape; None where it is
    not JSON (or is JSON's null), and then whoever needs it parses again, failing as before."""
    try:
        return json.loads(body)
    except Exception:  # noqa: BLE001 - see above
        return None


def _is_stream(body: bytes, parsed: Any = None) -> bool:
    """Whether the request asks for a stream; `parsed`: the body already parsed, where it was."""
    if b'"stream"' not in body:
        return False
    try:
        return bool((parsed if parsed is not None else json.loads(body)).get("stream"))
    except (ValueError, AttributeError):
        return False


def _response(status: int, headers: Mapping[str, str], length: int | None) -> web.StreamResponse:
    """The relayed answer's head: sized where the backend said its length, else chunked."""
    from aiohttp import web
    resp = web.StreamResponse(status=status, headers=headers)
    if length is not None:
        resp.content_length = length
    else:
        resp.enable_chunked_encoding()
    return resp


def _error_body(code: int, kind: str, message: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def _error(code: int, kind: str, message: str, extra: dict[str, str] | None = None,
           param: str | None = None) -> web.Response:
    from aiohttp import web
    return web.Response(status=code, body=_error_body(code, kind, message, param), headers=extra,
                        content_type="application/json")


def _too_large(limit: int, length: int | None) -> web.Response:
    size = f"{length} bytes" if length is not None else "more"
    resp = _error(413, "request_too_large", f"the request body is {size}; the proxy takes at most {limit} bytes "
                  "(proxy.max_body_bytes)")
    resp.force_close()    # the rest of the body is not read: this connection ends with the answer
    return resp


def _hang_up(request: web.BaseRequest) -> None:
    """End the client's connection now: a broken answer must not look complete."""
    transport = request.transport
    if transport is not None:
        transport.close()



async def _pump(conn: UpstreamConnection, request: web.BaseRequest, watch: _Watch) -> None:
    """Wait for the relay to end; a slow client pauses the upstream's reads until it drains."""
    while True:
        watch.waiting = True
        try:
            ended = await conn.wait()
        finally:
            watch.waiting = False
        if ended:
            return
        await request.writer.drain()
        conn.resume()
