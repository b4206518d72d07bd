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
