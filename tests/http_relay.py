"""A recording HTTP relay: forwards every request to a real server unchanged and
notes method, path and the warmup headers, so a test sees what went over the
wire to a server that logs no request ids (`transformers serve`).  Not a fake
server: every answer is the real server's, streamed through as it comes."""
from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "transfer-encoding", "content-length", "keep-alive"}


class Relay:
    def __init__(self, upstream_port: int):
        self.seen: list[dict] = []
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"      # the body ends when the connection closes

            def log_message(self, *a):
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                relay.seen.append({"method": self.command, "path": self.path,
                                   "warmup": self.headers.get("X-Warmup"),
                                   "request_id": self.headers.get("X-Request-Id"), "body": body})
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=300)
                try:
                    conn.request(self.command, self.path, body=body,
                                 headers={k: v for k, v in self.headers.items() if k.lower() not in _HOP})
                    r = conn.getresponse()
                except OSError:
                    self.send_error(502)
                    return
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.end_headers()
                while True:
                    chunk = r.read1(65536)
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    self.wfile.flush()
                conn.close()

            do_GET = do_POST = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def posts(self) -> list[dict]:
        return [s for s in self.seen if s["method"] == "POST"]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
