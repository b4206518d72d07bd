"""Cold-start-aware routing: an OpenAI-compatible reverse proxy in front of the engine.

    client -> proxy -> main engine       when SERVING and the breaker is closed
                    -> fallback upstream  while warming, DEGRADED or FAILED, if configured
                    -> 503 + Retry-After  otherwise (Retry-After: the seconds left in
                                          the breaker's freeze, or proxy.retry_after_seconds)

`/v1/completions` and `/v1/chat/completions` (POST) and `/v1/models` (GET) are
proxied; a streamed response (SSE, chunked) is passed through chunk by chunk,
unchanged.  Requests carrying the warmup marker (`X-Warmup: true`, what the
agent's own engines send) always go to the main engine -- the engine being
warmed is the one that must see them -- and never reach the user-facing
counters, the window or the water level.

For user requests routed to the main engine with `"stream": true`, the time to
the first streamed byte is recorded into the readiness window (the same one the
probes use), so real traffic feeds the breaker.  Stdlib only (http.server +
http.client); one persistent upstream connection per handler thread.
"""
from __future__ import annotations

import http.client
import json
import logging
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from exporter.metrics import AgentMetrics
    from warmup_agent.config import Config

log = logging.getLogger("warmup_agent.proxy")

POST_PATHS = ("/v1/completions", "/v1/chat/completions")
GET_PATHS = ("/v1/models",)
WARMUP_HEADER = "X-Warmup"
# Hop-by-hop headers (RFC 9110 §7.6.1) are the proxy's own business on each leg.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
        "transfer-encoding", "upgrade", "host", "content-length"}


class Gate(Protocol):
    """All the proxy asks of the agent's readiness (readiness.runtime.Readiness is one)."""

    @property
    def state_name(self) -> str: ...

    def main_open(self) -> bool:
        """User traffic may go to the main engine now."""

    def retry_after(self, default: float) -> float:
        """Seconds a rejected client should wait."""

    def user_request(self) -> None:
        """A user request arrived (the water level's QPS)."""

    def observe(self, ttft: float) -> None:
        """A user request's time to first token on the main engine (the window, the breaker)."""


class RoutedAgent(Protocol):
    """The agent as the proxy sees it (pipeline.Agent is one): its gate and its metrics."""

    @property
    def readiness(self) -> Gate: ...

    @property
    def metrics(self) -> AgentMetrics: ...


def _no_delay(conn: http.client.HTTPConnection) -> None:
    """Headers and body leave as separate small writes; with Nagle the second would
    wait for the first one's ACK (up to 40 ms against a delayed ACK)."""
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Upstream:
    """Base URL of an OpenAI-compatible server, with a keep-alive connection per thread."""

    def __init__(self, url: str, timeout: float):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url, self.scheme, self.timeout = url, u.scheme, timeout
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self._local = threading.local()

    def connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            conn = self._local.conn = cls(self.host, self.port, timeout=self.timeout)
        return conn

    def drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def request(self, method: str, path: str, body: bytes | None, headers: dict) -> http.client.HTTPResponse:
        """Send one request; a keep-alive connection the server closed meanwhile is
        retried once on a fresh connection (nothing was processed on it)."""
        for attempt in (0, 1):
            conn = self.connection(fresh=attempt == 1)
            try:
                if conn.sock is None:
                    conn.connect()
                    _no_delay(conn)
                conn.request(method, self.prefix + path, body=body, headers=headers)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")


class RoutingProxy:
    """The proxy for `agent`: its readiness gate (a `Gate`) and its metrics.

    upstream_url: the main engine; fallback_url: a smaller model server or None;
    listen: (host, port), port 0 for any free port."""

    def __init__(self, agent: RoutedAgent, upstream_url: str, fallback_url: str | None = None,
                 listen: tuple[str, int] = ("127.0.0.1", 0), metrics: AgentMetrics | None = None,
                 retry_after_seconds: int = 5, timeout_seconds: float = 300.0):
        self.metrics = metrics if metrics is not None else agent.metrics
        self.gate = agent.readiness
        self.main = Upstream(upstream_url, timeout_seconds)
        self.fallback = Upstream(fallback_url, timeout_seconds) if fallback_url else None
        self.retry_after_seconds = retry_after_seconds
        self.httpd = ThreadingHTTPServer(listen, _make_handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="routing-proxy", daemon=True)

    def start(self) -> RoutingProxy:
        self._thread.start()
        log.info("routing proxy on %s:%d -> main %s, fallback %s", self.httpd.server_address[0], self.port,
                 self.main.url, self.fallback.url if self.fallback else "none (503 while not SERVING)")
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

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


def from_config(agent: RoutedAgent, cfg: Config) -> RoutingProxy | None:
    """The proxy `proxy.*` asks for (None when proxy.listen is empty), not started.
    Raises ConfigError (one line) for a missing upstream or an address in use."""
    from warmup_agent.config import ConfigError
    pc = cfg.proxy
    if not pc.listen:
        return None
    upstream = pc.upstream_url or cfg.openai.url
    if not upstream:
        raise ConfigError("key 'proxy.upstream_url': the proxy needs the main engine's URL "
                          "(proxy.upstream_url, or openai.url with --engine openai)", "proxy.upstream_url")
    if not upstream.startswith(("http://", "https://")):
        raise ConfigError(f"key 'proxy.upstream_url': got {upstream!r}; expected a URL starting with http:// or https://",
                          "proxy.upstream_url")
    host, _, port = pc.listen.rpartition(":")
    try:
        return RoutingProxy(agent, upstream, pc.fallback_url, (host.strip("[]"), int(port)),
                            retry_after_seconds=pc.retry_after_seconds, timeout_seconds=pc.timeout_seconds)
    except OSError as e:
        raise ConfigError(f"key 'proxy.listen': cannot listen on {pc.listen}: {e.strerror}",
                          "proxy.listen") from None


def _is_stream(body: bytes) -> bool:
    try:
        return bool(json.loads(body).get("stream"))
    except (ValueError, AttributeError):
        return False


class _Handler(BaseHTTPRequestHandler):
    """One client connection of the proxy; `proxy` is set on the subclass `_make_handler` makes."""
    proxy: RoutingProxy

    protocol_version = "HTTP/1.1"     # keep-alive to clients: no connect per request
    # Each SSE chunk is its own small write: with Nagle on, the second one waits
    # for the client's delayed ACK (40 ms on Linux).
    disable_nagle_algorithm = True
    server_version = "warmup-agent-proxy"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), fmt % args)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in GET_PATHS:
            return self._error(404, "not_found", f"{path} is not proxied")
        self._proxy(b"")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        length = self.headers.get("Content-Length")
        if length is None:
            return self._error(411, "length_required", "a Content-Length is required")
        body = self.rfile.read(int(length))
        if path not in POST_PATHS:
            return self._error(404, "not_found", f"{path} is not proxied")
        self._proxy(body)

    # -- one request ---------------------------------------------------------------
    def _proxy(self, body: bytes) -> None:
        t0 = time.perf_counter()
        warmup = self.headers.get(WARMUP_HEADER, "").strip().lower() == "true"
        route = self.proxy.route(warmup)
        if not warmup:
            self.proxy.gate.user_request()
        # Metrics are recorded before the client can have the whole answer, so a
        # client (or test) that read the response sees them.
        if route == "rejected":
            retry = self.proxy.retry_after()
            self._count(route, 503, warmup)
            return self._error(503, "warming_up",
                               f"the model server is {self.proxy.gate.state_name}; retry in {retry} s",
                               {"Retry-After": str(retry)})
        upstream = self.proxy.main if route == "main" else self.proxy.fallback
        assert upstream is not None, "route() answers fallback only when there is one"
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        headers["Host"] = f"{upstream.host}:{upstream.port}"
        if body:
            headers["Content-Length"] = str(len(body))
        try:
            resp = upstream.request(self.command, self.path, body or None, headers)
        except (OSError, http.client.HTTPException) as e:
            upstream.drop()
            self._count(route, 502, warmup)
            return self._error(502, "upstream_unavailable", f"{route} upstream {upstream.url}: {e}")
        self._count(route, resp.status, warmup)
        measured = not warmup and resp.status == 200 and _is_stream(body)
        self._relay(resp, upstream, (lambda first: self._first_token(route, first - t0)) if measured else None)

    def _first_token(self, route: str, ttft: float) -> None:
        """A user request's time to first token: histogram, and the readiness window."""
        self.proxy.metrics.warmup_proxy_first_token_seconds.labels(route=route).observe(ttft)
        if route == "main":
            self.proxy.gate.observe(ttft)    # the window and the breaker; never the probe log

    def _relay(self, resp: http.client.HTTPResponse, upstream: Upstream, on_first: Callable[[float], None] | None = None) -> float | None:
        """Pass status, headers and body through; return when the first body byte
        arrived.  `on_first(t)` runs once the first chunk is out, before the rest."""
        length = resp.getheader("Content-Length")
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP:
                self.send_header(k, v)
        if length is not None:
            self.send_header("Content-Length", length)
        else:
            self.send_header("Transfer-Encoding", "chunked")
        if resp.will_close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        first = None
        try:
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                if first is None:
                    first = time.perf_counter()
                if length is None:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                else:
                    self.wfile.write(chunk)
                self.wfile.flush()
                if on_first is not None:
                    on_first(first)
                    on_first = None
            if length is None:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            # The client went away mid-stream: the upstream connection is mid-response.
            upstream.drop()
            self.close_connection = True
        if resp.will_close:
            upstream.drop()
        return first

    def _count(self, route: str, code: int, warmup: bool) -> None:
        if not warmup:
            self.proxy.metrics.warmup_proxy_requests_total.labels(route=route, code=str(code)).inc()

    def _error(self, code: int, kind: str, message: str, extra: dict | None = None) -> None:
        body = json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


def _make_handler(proxy: RoutingProxy) -> type[_Handler]:
    return type("Handler", (_Handler,), {"proxy": proxy})
