"""Start the real test servers (Prometheus, Alertmanager, Redis) on 127.0.0.1.

Each helper picks a free port, starts the binary installed by .ci/run, waits
until it answers (polling, never a fixed sleep) and stops it on exit.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll predicate() until it returns a truthy value; return that value."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - polling a server that is not up yet
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise RuntimeError(f"{name} not found: run .ci/run (or apt-get install it) first")
    return path


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Prometheus:
    """A real Prometheus scraping the given targets every second."""

    def __init__(self, tmpdir, targets: list[str], rule_files: Sequence[str] = (),
                 alertmanager: str | None = None, scrape_interval: str = "1s", metrics_path: str = "/metrics"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [{"job_name": "warmup-agent", "metrics_path": metrics_path,
                                "static_configs": [{"targets": list(targets)}]}],
        }
        if rule_files:
            cfg["rule_files"] = list(rule_files)
        if alertmanager:
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        self.dir = str(tmpdir)
        self.config_path = os.path.join(self.dir, "prometheus.yml")
        with open(self.config_path, "w") as f:
            json.dump(cfg, f)  # JSON is valid YAML
        self.proc = subprocess.Popen(
            [require_binary("prometheus"), f"--config.file={self.config_path}",
             f"--storage.tsdb.path={os.path.join(self.dir, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "prometheus.log"), "w"))
        wait_until(lambda: http_get(self.url + "/-/ready")[0] == 200, 30, what="prometheus ready")

    def api(self, path: str) -> dict:
        status, body = http_get(self.url + path)
        data = json.loads(body)
        if data.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body[:300]}")
        return data["data"]

    def query(self, expr: str) -> list:
        return self.api("/api/v1/query?query=" + urllib.parse.quote(expr))["result"]

    def wait_for_scrape(self, timeout: float = 60.0) -> None:
        def up():
            targets = self.api("/api/v1/targets")["activeTargets"]
            return targets and all(t["health"] == "up" for t in targets)
        wait_until(up, timeout, interval=0.25, what="prometheus target up")

    def stop(self) -> None:
        stop_process(self.proc)


class Alertmanager:
    def __init__(self, tmpdir, webhook_url: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        receiver: dict[str, object] = {"name": "default"}
        if webhook_url:
            receiver["webhook_configs"] = [{"url": webhook_url, "send_resolved": True}]
        cfg = {"route": {"receiver": "default", "group_wait": "0s", "group_interval": "1s", "repeat_interval": "1h"},
               "receivers": [receiver]}
        self.dir = str(tmpdir)
        path = os.path.join(self.dir, "alertmanager.yml")
        with open(path, "w") as f:
            json.dump(cfg, f)
        self.proc = subprocess.Popen(
            [require_binary("prometheus-alertmanager"), f"--config.file={path}",
             f"--storage.path={os.path.join(self.dir, 'am')}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "alertmanager.log"), "w"))
        wait_until(lambda: http_get(self.url + "/-/ready")[0] == 200, 30, what="alertmanager ready")

    def stop(self) -> None:
        stop_process(self.proc)


class Redis:
    def __init__(self, tmpdir, extra_args: Sequence[str] = ()):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = str(tmpdir)
        self.proc = subprocess.Popen(
            [require_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(self.port),
             "--save", "", "--appendonly", "no", "--dir", self.dir, "--daemonize", "no", *extra_args],
            stdout=open(os.path.join(self.dir, "redis.log"), "w"), stderr=subprocess.STDOUT)

        def ping():
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        wait_until(ping, 30, interval=0.05, what="redis PING")

    def stop(self) -> None:
        stop_process(self.proc)


class SSEStandIn:
    """A stand-in OpenAI-compatible upstream (named as such: for the proxy's own
    latency and pass-through, where a real engine's spread would hide it): answers
    every POST at once with `events` as a chunked text/event-stream, and keeps
    (path, headers, body) of each request when `record` is set."""

    def __init__(self, events: list[bytes], record: bool = True):
        self.requests: list[tuple[str, dict, bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if record:
                    outer.requests.append((self.path, dict(self.headers), body))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for part in events:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def running(server):
    try:
        yield server
    finally:
        server.stop()


# -- a stand-in OpenAI-compatible upstream on asyncio ----------------------------------------

def _stand_in_loop():
    import asyncio
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class OpenAIStandIn:
    """A stand-in OpenAI-compatible upstream (named as such: it generates nothing; for the
    proxy's own costs, where a real engine's spread would hide them), on asyncio (uvloop
    where installed) in its own thread, or as its own process (`python -m
    tests.helpers.servers openai-stand-in --port N`, what bench/bench_proxy.py runs).

    POST /v1/chat/completions and /v1/completions: with "stream": true a chunked
    text/event-stream, the first event `first_token_s` after the request, then
    `chunks - 1` more `interval_s` apart (the last with finish_reason and usage), then
    [DONE]; without it the same answer as one JSON body after the same time.  A request
    body with "stand_in_stall": "head" gets nothing at all, with "stand_in_stall": N
    its head and N events, then nothing (`stall=True`: every POST gets nothing).  GET
    /v1/models lists `model`; GET /health is 200; POST /tokenize gives one token per
    character (what the agent's warmup needs of a server without a local tokenizer).
    HTTP/1.1 keep-alive, no pipelining.

    What the upstream saw: `started` (request bodies), `finished` (answers written to
    the end) and `aborted` (answers whose connection closed before their end: the
    client, or the proxy in front, went away)."""

    def __init__(self, first_token_s: float = 0.02, chunks: int = 32, interval_s: float = 0.005,
                 model: str = "stand-in", stall: bool = False, port: int = 0, host: str = "127.0.0.1",
                 thread: bool = True):
        self.first_token_s, self.chunks, self.interval_s = first_token_s, chunks, interval_s
        self.model, self.stall = model, stall
        self.started: list[bytes] = []
        self.finished: list[bytes] = []
        self.aborted: list[bytes] = []
        self.host = host
        self.loop = _stand_in_loop()
        self._server: Any = None
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(4096)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = None
        if thread:
            ready = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(ready,), name="openai-stand-in", daemon=True)
            self._thread.start()
            ready.wait(10)

    def _run(self, ready=None):
        import asyncio
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(
            self.loop.create_server(lambda: _StandInProtocol(self), sock=self._sock, backlog=4096))
        if ready is not None:
            ready.set()
        self.loop.run_forever()

    def serve_forever(self):
        """Run in this thread (the stand-in's own process)."""
        self._run()

    def stop(self):
        if self._thread is None:
            return

        async def close():
            self._server.close()
        import asyncio
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self._thread = None

    # -- the answers -----------------------------------------------------------------------
    def event(self, path: str, i: int, last: bool) -> bytes:
        if path.endswith("/chat/completions"):
            choice = {"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": "length" if last else None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": f" tok{i}", "finish_reason": "length" if last else None}
            obj = "text_completion"
        msg = {"id": "stand-in", "object": obj, "created": 0, "model": self.model, "choices": [choice]}
        if last:
            msg["usage"] = {"prompt_tokens": 8, "completion_tokens": self.chunks, "total_tokens": 8 + self.chunks}
        return b"data: " + json.dumps(msg, separators=(",", ":")).encode() + b"\n\n"

    def whole(self, path: str) -> bytes:
        text = "".join(f" tok{i}" for i in range(self.chunks))
        if path.endswith("/chat/completions"):
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            obj = "text_completion"
        return json.dumps({"id": "stand-in", "object": obj, "created": 0, "model": self.model, "choices": [choice],
                           "usage": {"prompt_tokens": 8, "completion_tokens": self.chunks,
                                     "total_tokens": 8 + self.chunks}}).encode()


class _StandInProtocol:
    """One connection of OpenAIStandIn: a minimal HTTP/1.1 server (asyncio.Protocol)."""

    def __init__(self, owner: OpenAIStandIn):
        self.owner = owner
        self.buf = b""
        self.transport: Any = None
        self.task: Any = None
        self.closed = False
        self.close_after = False

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data):
        self.buf += data
        if self.task is None:
            self._next()

    def eof_received(self):
        return False

    def connection_lost(self, exc):
        self.closed = True
        if self.task is not None:
            self.task.cancel()

    def pause_writing(self):
        pass

    def resume_writing(self):
        pass

    def _next(self):
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1").split("\r\n")
        method, path = head[0].split(" ")[:2]
        headers = {}
        for line in head[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        length = int(headers.get("content-length") or 0)
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4:end + 4 + length]
        self.buf = self.buf[end + 4 + length:]
        self.close_after = headers.get("connection", "").lower() == "close"
        self.task = self.owner.loop.create_task(self._answer(method, path, body))

    def _write(self, data: bytes):
        if self.closed or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    def _simple(self, code: int, body: bytes, ctype: str = "application/json"):
        reason = {200: "OK", 404: "Not Found"}.get(code, "Error")
        self._write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                    % (code, reason.encode(), ctype.encode(), len(body), body))

    async def _answer(self, method: str, path: str, body: bytes):
        import asyncio
        owner = self.owner
        try:
            if method == "GET":
                if path == "/v1/models":
                    self._simple(200, json.dumps({"object": "list", "data": [
                        {"id": owner.model, "object": "model", "created": 0, "owned_by": "stand-in"}]}).encode())
                elif path == "/health":
                    self._simple(200, b"")
                else:
                    self._simple(404, b'{"error": {"message": "not found", "type": "not_found", "param": null, "code": 404}}')
            elif path == "/tokenize":
                # One token per character: enough for a client that sizes its prompts (the agent's warmup).
                text = json.loads(body or b"{}").get("prompt") or ""
                self._simple(200, json.dumps({"tokens": [ord(c) % 32000 for c in text], "count": len(text),
                                              "max_model_len": 4096}).encode())
            elif path not in ("/v1/chat/completions", "/v1/completions"):
                self._simple(404, b'{"error": {"message": "not found", "type": "not_found", "param": null, "code": 404}}')
            else:
                owner.started.append(body)
                try:
                    req = json.loads(body or b"{}")
                    stream = bool(req.get("stream"))
                except (ValueError, AttributeError):
                    req, stream = None, False
                # A request can ask to stall: "head" (no answer at all), or N (after N events).
                stall = "head" if owner.stall else (req.get("stand_in_stall") if isinstance(req, dict) else None)
                if stall == "head":
                    await asyncio.sleep(3600)
                if not stream:
                    await asyncio.sleep(owner.first_token_s + owner.interval_s * (owner.chunks - 1))
                    self._simple(200, owner.whole(path))
                else:
                    self._write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                    await asyncio.sleep(owner.first_token_s)
                    for i in range(owner.chunks):
                        if i == stall:
                            await asyncio.sleep(3600)
                        if i:
                            await asyncio.sleep(owner.interval_s)
                        ev = owner.event(path, i, i == owner.chunks - 1)
                        if i == owner.chunks - 1:
                            ev += b"data: [DONE]\n\n"
                        self._write(b"%x\r\n%s\r\n" % (len(ev), ev))
                    self._write(b"0\r\n\r\n")
                owner.finished.append(body)
        except (asyncio.CancelledError, ConnectionError):
            owner.aborted.append(body)
            return
        self.task = None
        if self.close_after:
            self.transport.close()
        elif self.buf:
            self._next()


def _main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="test and bench servers")
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("openai-stand-in", help="OpenAIStandIn in this process, until killed")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--first-token-ms", type=float, default=20.0)
    s.add_argument("--chunks", type=int, default=32)
    s.add_argument("--interval-ms", type=float, default=5.0)
    s.add_argument("--model", default="stand-in")
    args = p.parse_args(argv)
    standin = OpenAIStandIn(args.first_token_ms / 1e3, args.chunks, args.interval_ms / 1e3, args.model,
                            port=args.port, host=args.host, thread=False)
    print(f"stand-in upstream on {standin.url}", flush=True)
    standin.serve_forever()
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_main())
