"""The agent's HTTP endpoints.

  /metrics        Prometheus exposition (agent metrics + scrape-time collectors)
  /healthz        200 while the agent is alive and not FAILED (livenessProbe)
  /readyz         200 in SERVING (readinessProbe)
  /startupz       JSON: state, current stage, elapsed, deadline, per-stage durations
  /               a landing page with links
  POST /admin/rewarm   warm the engine again
  POST /admin/drain    move to DRAINING, so /readyz answers 503 (a preStop hook)
  POST /admin/wake     wake a sleeping server and warm it ahead of traffic; answers once
                       it is warm (?wait=false: at once, with an estimate)

Probe endpoints stay open under basic auth because the kubelet sends no credentials.
The admin endpoints exist only with `exporter.admin_token_file` and need a bearer
token; basic auth does not open them.
"""
from __future__ import annotations

import hmac
import json
import logging
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Literal, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

if TYPE_CHECKING:  # types only
    from prometheus_client import CollectorRegistry

    from warmup_agent.webconfig import ServerSecurity, WebConfig

log = logging.getLogger("exporter.server")

_OPEN_PATHS = {"/healthz", "/readyz", "/startupz"}
_ADMIN_PATHS = {"/admin/rewarm", "/admin/drain", "/admin/wake"}

LANDING = """<!doctype html><html><head><title>warmup-agent</title></head><body>
<h1>warmup-agent</h1><p>State: <b>{state}</b></p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li>
<li><a href="/readyz">/readyz</a></li><li><a href="/startupz">/startupz</a></li></ul></body></html>
"""


def listen_backlog() -> int:
    """The listen backlog of the agent's servers: somaxconn, and at least 1024.
    socketserver's default of 5 overflows when a warmup holds the GIL and requests
    arrive together; the kernel then drops SYNs and clients retry a second later."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            somaxconn = int(f.read().strip())
    except (OSError, ValueError):
        somaxconn = 0
    return max(1024, somaxconn)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = listen_backlog()
    ssl_context: ssl.SSLContext | None = None
    # Connections go to waiting worker threads, and to a new thread only while all are
    # busy: a thread started per request waits behind every busy process for its first
    # time slice, which shows in the probes' tail latency on a loaded machine.
    workers = 4

    def server_activate(self) -> None:
        super().server_activate()
        import queue
        self._queue: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._idle_lock = threading.Lock()
        self._idle = self.workers
        for i in range(self.workers):
            threading.Thread(target=self._work, name=f"exporter-http-{i}", daemon=True).start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            self.process_request_thread(*item)
            with self._idle_lock:
                self._idle += 1

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._idle_lock:
            idle = self._idle > 0
            if idle:
                self._idle -= 1
        if idle:
            self._queue.put((request, client_address))
        else:
            super().process_request(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        # A failed bind closes the server before server_activate ran: no workers then.
        queue = self.__dict__.get("_queue")
        if queue is not None:
            for _ in range(self.workers):
                queue.put(None)

    def finish_request(self, request: Any, client_address: Any) -> Any:
        # Handshake in the connection's thread: in accept(), one silent client would
        # stall every other request.
        if self.ssl_context is None:
            return super().finish_request(request, client_address)
        request.settimeout(10)
        tls = self.ssl_context.wrap_socket(request, server_side=True)
        try:
            super().finish_request(tls, client_address)
        finally:
            tls.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that fails the handshake or hangs up is not our error: one debug line, no traceback.
        import sys
        log.debug("connection from %s ended: %s", client_address[0], sys.exc_info()[1])


# POST /admin/wake waits at most this long for the pod to be warm (?wait=false: not at all).
WAKE_WAIT_SECONDS = 300.0
_WAKING = frozenset({"SLEEPING", "INIT", "PRELOAD", "PRIME"})


def _query_flag(path: str, name: str, default: bool) -> bool:
    """`name` in the query of `path` as a boolean: false, 0 or no turn it off."""
    from urllib.parse import parse_qs
    values = parse_qs(path.partition("?")[2]).get(name)
    if not values:
        return default
    return values[-1].strip().lower() not in ("false", "0", "no")


class ServedAgent(Protocol):
    """All the exporter may use of the agent."""

    def status(self) -> dict: ...

    def request_rewarm(self) -> bool: ...

    def request_drain(self) -> Literal["started", "already", "refused"]: ...

    def request_wake(self) -> tuple[bool, float | None]: ...

    @property
    def state_name(self) -> str: ...


class ExporterServer:
    """Serves `agent` and `registry` on host:port in a daemon thread.  `security`
    comes from webconfig.resolve; without it the keyword pieces build one.  The
    server never reads the config."""

    def __init__(self, agent: ServedAgent, registry: CollectorRegistry, host: str, port: int,
                 tls_cert: str | None = None, tls_key: str | None = None, basic_auth: tuple[str, str] | None = None,
                 web_config: WebConfig | None = None, admin_token: str | None = None,
                 security: ServerSecurity | None = None):
        from warmup_agent.webconfig import ServerSecurity
        self.agent, self.registry = agent, registry
        if security is None:
            security = ServerSecurity.of(web_config, tls_cert, tls_key, basic_auth, admin_token)
        self.admin_token = security.admin_token
        self.auth = security.auth
        ctx = security.tls
        self.tls = ctx is not None

        handler = _make_handler(self)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("Server", (_HTTPServer,), {"address_family": family, "ssl_context": ctx})
        self.httpd = server_cls((host, port), handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="exporter-http", daemon=True)

    def start(self) -> ExporterServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def authorized(self, header: str | None) -> bool:
        return self.auth is None or self.auth.check(header)

    def admin_authorized(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer ") or self.admin_token is None:
            return False
        return hmac.compare_digest(header[7:].strip().encode(), self.admin_token.encode())

    # -- state changes ---------------------------------------------------------------------
    def rewarm(self) -> tuple[int, dict]:
        """Re-warm from SERVING or DEGRADED; anything else is a conflict."""
        if not self.agent.request_rewarm():
            state = self.agent.state_name
            return 409, {"error": f"re-warm needs SERVING or DEGRADED; state is {state}", "state": state}
        return 202, {"state": self.agent.state_name}

    def wake(self, wait: bool = True) -> tuple[int, dict]:
        """Wake a sleeping server and warm it.  With `wait` the answer comes once the pod is
        warm again: 200 and the seconds the wake took (503 where it failed, 202 past
        WAKE_WAIT_SECONDS).  Without, 202 at once with the latest wake's seconds as the
        estimate (null before the first).  200 when it is SERVING awake already."""
        t0 = time.monotonic()
        started, warm_in = self.agent.request_wake()
        state = self.agent.state_name
        if not started:
            if state == "SERVING":
                return 200, {"state": state, "warm_in_seconds": 0}
            return 409, {"error": f"wake needs a sleeping server; state is {state}", "state": state}
        if not wait:
            return 202, {"state": state, "warm_in_seconds": warm_in}
        while state in _WAKING and time.monotonic() - t0 < WAKE_WAIT_SECONDS:
            time.sleep(0.01)
            state = self.agent.state_name
        took = round(time.monotonic() - t0, 3)
        if state in _WAKING:
            return 202, {"state": state, "warm_in_seconds": warm_in, "waited_seconds": took}
        return (200 if state == "SERVING" else 503), {"state": state, "warm_in_seconds": took}

    def drain(self) -> tuple[int, dict]:
        outcome = self.agent.request_drain()
        state = self.agent.state_name
        if outcome == "refused":
            return 409, {"error": f"cannot drain from {state}", "state": state}
        return (200 if outcome == "already" else 202), {"state": state}


def _make_handler(server: ExporterServer) -> Any:
    class Handler(BaseHTTPRequestHandler):
        server_version = "warmup-agent"
        timeout = 30   # an idle or stalled client gives its thread back

        def log_message(self, fmt: Any, *args: Any) -> None:  # route to our logger at debug: probes every second
            log.debug("%s %s", self.address_string(), fmt % args)

        def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8", extra: Any = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, code: int, obj: dict) -> Any:
            return self._send(code, json.dumps(obj).encode() + b"\n", "application/json")

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_POST(self) -> Any:
            path = self.path.split("?", 1)[0]
            if path not in _ADMIN_PATHS or server.admin_token is None:
                return self._send(404, b"not found\n")
            length = int(self.headers.get("Content-Length") or 0)
            if 0 < length <= 65536:
                self.rfile.read(length)   # ignored; read so the client sees our answer
            if not server.admin_authorized(self.headers.get("Authorization")):
                log.warning("admin: refused %s from %s (missing or wrong bearer token)", path, self.client_address[0])
                return self._send(401, b"unauthorized\n", extra={"WWW-Authenticate": 'Bearer realm="warmup-agent"'})
            if path == "/admin/wake":
                code, body = server.wake(wait=_query_flag(self.path, "wait", default=True))
            else:
                code, body = {"/admin/rewarm": server.rewarm}.get(path, server.drain)()
            log.info("admin: %s from %s -> %d %s", path, self.client_address[0], code, body.get("state"))
            return self._json(code, body)

        def do_GET(self) -> Any:
            path = self.path.split("?", 1)[0]
            if path in _ADMIN_PATHS:
                if server.admin_token is None:
                    return self._send(404, b"not found\n")
                return self._send(405, b"use POST\n", extra={"Allow": "POST"})
            if path not in _OPEN_PATHS and not server.authorized(self.headers.get("Authorization")):
                return self._send(401, b"unauthorized\n", extra={"WWW-Authenticate": 'Basic realm="warmup-agent"'})
            try:
                status = server.agent.status()
            except Exception:
                log.exception("status failed")
                status = {"state": "UNKNOWN"}
            state = status.get("state")
            if path == "/metrics":
                return self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
            if path == "/healthz":
                ok = state != "FAILED"
                return self._send(200 if ok else 503, b"ok\n" if ok else b"failed\n")
            if path == "/readyz":
                ok = bool(status.get("ready", state == "SERVING"))
                return self._send(200 if ok else 503, f"{state}\n".encode())
            if path == "/startupz":
                code = 503 if state == "FAILED" else 200
                return self._send(code, json.dumps(status, indent=2).encode() + b"\n", "application/json")
            if path == "/":
                return self._send(200, LANDING.format(state=state).encode(), "text/html; charset=utf-8")
            return self._send(404, b"not found\n")

    return Handler
