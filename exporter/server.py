"""The agent's HTTP endpoints.

  /metrics   Prometheus exposition (agent metrics + scrape-time collectors)
  /healthz   200 while the agent is alive and not FAILED (livenessProbe)
  /readyz    200 only in SERVING (readinessProbe)
  /startupz  JSON: state, current stage, elapsed, deadline, per-stage durations
  /          a landing page with links

Optional TLS and basic auth.  Probe endpoints stay open under basic auth
because the kubelet does not send credentials.
"""
from __future__ import annotations

import base64
import hmac
import json
import logging
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("exporter.server")

_OPEN_PATHS = {"/healthz", "/readyz", "/startupz"}

LANDING = """<!doctype html><html><head><title>warmup-agent</title></head><body>
<h1>warmup-agent</h1><p>State: <b>{state}</b></p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li>
<li><a href="/readyz">/readyz</a></li><li><a href="/startupz">/startupz</a></li></ul></body></html>
"""


class ExporterServer:
    """Serves `agent` (anything with `.status()` returning a dict with "state")
    and `registry` on host:port in a daemon thread."""

    def __init__(self, agent, registry, host: str, port: int, tls_cert: str | None = None,
                 tls_key: str | None = None, basic_auth: tuple[str, str] | None = None):
        self.agent, self.registry, self.basic_auth = agent, registry, basic_auth
        handler = _make_handler(self)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        if tls_cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls_cert, tls_key)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="exporter-http", daemon=True)

    def start(self) -> "ExporterServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def authorized(self, header: str | None) -> bool:
        if self.basic_auth is None:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except Exception:  # noqa: BLE001 - malformed header
            return False
        return hmac.compare_digest(user, self.basic_auth[0]) & hmac.compare_digest(password, self.basic_auth[1])


def _make_handler(server: ExporterServer):
    class Handler(BaseHTTPRequestHandler):
        server_version = "warmup-agent"

        def log_message(self, fmt, *args):  # route to our logger at debug: probes every second
            log.debug("%s %s", self.address_string(), fmt % args)

        def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8", extra=None):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path not in _OPEN_PATHS and not server.authorized(self.headers.get("Authorization")):
                return self._send(401, b"unauthorized\n", extra={"WWW-Authenticate": 'Basic realm="warmup-agent"'})
            try:
                status = server.agent.status()
            except Exception:  # noqa: BLE001 - never let a status bug take the endpoint down
                log.exception("status failed")
                status = {"state": "UNKNOWN"}
            state = status.get("state")
            if path == "/metrics":
                return self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
            if path == "/healthz":
                ok = state != "FAILED"
                return self._send(200 if ok else 503, b"ok\n" if ok else b"failed\n")
            if path == "/readyz":
                ok = state == "SERVING"
                return self._send(200 if ok else 503, f"{state}\n".encode())
            if path == "/startupz":
                code = 503 if state == "FAILED" else 200
                return self._send(code, json.dumps(status, indent=2).encode() + b"\n", "application/json")
            if path == "/":
                return self._send(200, LANDING.format(state=state).encode(), "text/html; charset=utf-8")
            return self._send(404, b"not found\n")

    return Handler
