"""The users'-path request before SERVING (warmup_agent/proxy/user_path.py): what it
accepts as an answer, and where it reaches a listener bound to a wildcard address.

The servers here are stand-ins (http.server in a thread, named as such): they send the
broken streams a real model server does not send on demand.  The real path, the torch
engine behind --proxy-listen, is tested in test_torch_serving_cli.py."""
from __future__ import annotations

import http.server
import socket
import threading

import pytest

from warmup_agent.errors import EngineError
from warmup_agent.proxy import user_path
from warmup_agent.server.command import http_url, listen_address, reach_host

GOOD = (b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
        b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'
        b"data: [DONE]\n\n")
ERROR = (b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'
         b'data: {"error": {"message": "CUDA out of memory", "type": "server_error"}}\n\n'
         b"data: [DONE]\n\n")
NO_DONE = b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'
NOT_JSON = b"data: <html>oops</html>\n\ndata: [DONE]\n\n"


def stand_in(body: bytes, family: int = socket.AF_INET, host: str = "127.0.0.1"):
    """A stand-in stream server: every POST gets `body` as text/event-stream."""
    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            seen.append(dict(self.headers))
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        address_family = family

    server = Server((host, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def serve():
    started = []

    def start(body: bytes, **kw):
        server, seen = stand_in(body, **kw)
        started.append(server)
        return server.server_address[1], seen
    yield start
    for s in started:
        s.shutdown()
        s.server_close()


def test_a_good_stream_passes_and_is_marked_as_warmup(serve):
    port, seen = serve(GOOD)
    out = user_path.send("127.0.0.1", port, timeout=5)
    assert out["chunks"] == 2 and out["seconds"] >= out["first_byte_seconds"] > 0
    assert seen[0].get("X-Warmup") == "true"


@pytest.mark.parametrize("body, says", [(ERROR, "CUDA out of memory"), (NO_DONE, "without [DONE]"),
                                        (NOT_JSON, "not an event stream")])
def test_a_broken_stream_fails_the_request_with_its_reason(serve, body, says):
    port, _ = serve(body)
    with pytest.raises(EngineError) as e:
        user_path.send("127.0.0.1", port, timeout=5)
    assert e.value.reason == "request_failed" and says in str(e.value)


def test_a_wildcard_listener_is_reached_on_loopback(serve):
    port, seen = serve(GOOD, host="0.0.0.0")
    user_path.send("0.0.0.0", port, timeout=5)
    assert len(seen) == 1
    if socket.has_ipv6:
        try:
            port6, seen6 = serve(GOOD, family=socket.AF_INET6, host="::")
        except OSError:
            pytest.skip("no IPv6 on this machine")
        user_path.send("::", port6, timeout=5)
        assert len(seen6) == 1


def test_server_addresses_are_reached_on_loopback_and_bracketed():
    assert reach_host("0.0.0.0") == reach_host("") == "127.0.0.1"
    assert reach_host("::") == "::1" and reach_host("10.0.0.7") == "10.0.0.7"
    assert http_url("::1", 8000) == "http://[::1]:8000" and http_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert listen_address(["llama-server", "--host", "::", "--port", "9"]) == ("::1", 9)
    assert listen_address(["llama-server", "--host", "[::1]", "--port=7"]) == ("::1", 7)
    assert listen_address(["vllm", "serve", "m", "--host", "0.0.0.0"]) == ("127.0.0.1", 8000)
