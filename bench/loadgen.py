"""Shared by bench_load.py, bench_soak.py and tests/test_load.py: start the real
agent through its CLI, and an open-loop HTTP load generator.

Requests are sent on a fixed schedule (request i at t0 + i/rate) by a pool of
threads, one new connection each (the exporter speaks HTTP/1.0), so a slow
answer does not slow the offered load down.  Latency runs from the moment a
request is actually sent to the last byte of its answer.  An error is a
connection failure, a timeout, or a status the endpoint must never give
(/metrics: anything but 200; /readyz: anything but 200 or 503).
"""
from __future__ import annotations

import http.client
import itertools
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = {"/metrics": {200}, "/readyz": {200, 503}, "/healthz": {200}, "/startupz": {200}}


def start_agent(port: int, workdir: str, env_extra: dict | None = None, data_dir: str | None = None) -> subprocess.Popen:
    """`warmup-agent run` (no --once) on 127.0.0.1:port, with an admin token so a
    load test can keep re-warming; its output goes to workdir/agent.log."""
    token = os.path.join(workdir, "admin.token")
    with open(token, "w") as f:
        f.write(admin_token())
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env.update(WARMUP_AGENT_EXPORTER_ADMIN_TOKEN_FILE=token, **(env_extra or {}))
    cmd = [sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--listen", f"127.0.0.1:{port}"]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(os.path.join(workdir, "agent.log"), "w"),
                            stderr=subprocess.STDOUT)


def admin_token() -> str:
    return "bench-admin-token-0123456789"


def stop_agent(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def request(port: int, method: str, path: str, headers: dict | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def state(port: int) -> str:
    try:
        status, body = request(port, "GET", "/readyz", timeout=2)
        return body.decode().strip()
    except OSError:
        return "DOWN"


def wait_for(port: int, wanted, timeout: float, proc: subprocess.Popen | None = None) -> str:
    """Poll /readyz until the state satisfies `wanted` (a state name or a predicate); return it."""
    ok = wanted if callable(wanted) else (lambda s: s == wanted)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"agent exited with {proc.returncode} while waiting for {wanted}")
        now = state(port)
        if ok(now):
            return now
        time.sleep(0.02)
    raise TimeoutError(f"agent not {wanted} within {timeout}s (state {state(port)})")


class Rewarmer(threading.Thread):
    """Keeps a warmup running: whenever the agent is SERVING, POST /admin/rewarm."""

    def __init__(self, port: int):
        super().__init__(name="rewarmer", daemon=True)
        self.port, self.stop_event, self.rewarms = port, threading.Event(), 0
        self.seen: set[str] = set()   # states observed while running

    def run(self):
        while not self.stop_event.wait(0.05):
            now = state(self.port)
            self.seen.add(now)
            if now == "SERVING":
                status, _ = request(self.port, "POST", "/admin/rewarm",
                                    {"Authorization": f"Bearer {admin_token()}"})
                self.rewarms += status == 202


def run_load(port: int, rate: float, seconds: float, paths=("/metrics", "/readyz"), workers: int = 32):
    """Offer `rate` requests/s for `seconds`, alternating `paths`.  Returns a list of
    (path, latency_seconds or None, error or None)."""
    total = int(rate * seconds)
    counter = itertools.count()
    results: list = []
    lock = threading.Lock()
    t0 = time.perf_counter() + 0.05

    def worker():
        while True:
            i = next(counter)
            if i >= total:
                return
            path = paths[i % len(paths)]
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)   # pacing the offered load, not waiting for the server
            start = time.perf_counter()
            try:
                status, _ = request(port, "GET", path)
                err = None if status in ALLOWED[path] else f"status {status}"
            except OSError as e:
                err = f"{type(e).__name__}: {e}"
            with lock:
                results.append((path, time.perf_counter() - start, err))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0






