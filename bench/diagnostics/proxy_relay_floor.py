"""What a Python relay costs at best, beside nginx and the agent's proxy (issue 41).

bench_proxy's 256-stream cells leave the agent's proxy at 0.79-0.89x nginx's requests
per second on the 2-core machine.  Is the server side (aiohttp's low-level server) what
is left?  This diagnostic relays the same stand-in upstream (tests/helpers/servers.py,
20 ms to the first token, then 32 chunks 5 ms apart) through four targets, one at a time,
repetitions interleaved, with bench_proxy's load generator at `--streams` streams, a new
connection per request and preconnected:

  nginx        one worker, proxy_buffering off, upstream keepalive (bench_proxy's)
  proxy        the agent's routing proxy, through `warmup-agent run --proxy-listen`
  aiohttp_min  aiohttp's low-level server and the proxy's own upstream client
               (warmup_agent/proxy/upstream.py): the relay with no routing, no gate, no
               metrics, no agent process
  raw_min      the same upstream client behind a bare asyncio protocol (head found by
               hand, no HTTP library): the least a Python server side can cost

Each target's process CPU (user + system, with its children) per request is the figure
that decides: on 2 shared cores, the load generator and the upstream get what the target
leaves.  Writes bench/results/proxy_relay_floor.json.

    .venv/bin/python -m bench.diagnostics.proxy_relay_floor [--seconds 10] [--reps 2]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.bench_proxy import cpu_seconds, free_port, quantile, run_load, start_agent, start_nginx, stop, wait_http  # noqa: E402
from bench.provenance import provenance, write_result  # noqa: E402

TARGETS = ("nginx", "proxy", "aiohttp_min", "raw_min")


# -- the two minimal relays (run as `python -m bench.diagnostics.proxy_relay_floor serve KIND UPSTREAM PORT`) --

async def _serve_aiohttp(backend, port: int) -> None:
    from aiohttp import web

    from warmup_agent.proxy.upstream import HOP

    async def handle(request):
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        conn = await backend.open(request.method, request.path_qs, body, headers)
        try:
            await conn.wait_first()
            resp = web.StreamResponse(status=conn.status, headers=conn.headers)
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            conn.attach(request.transport, request.protocol, reframe=False)
            while not await conn.wait():
                await request.writer.drain()
                conn.resume()
            await resp.write_eof()
            return resp
        finally:
            conn.finish()
    runner = web.ServerRunner(web.Server(handle, handler_cancellation=True, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
    await asyncio.Event().wait()


class _RawClient(asyncio.Protocol):
    """One client connection: the request head found by hand, the body by Content-Length."""
    writing_paused = False

    def __init__(self, backend):
        self.backend, self.buf, self.task = backend, b"", None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = self.buf[:end].decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        length = int(headers.get("Content-Length", "0"))
        if len(self.buf) < end + 4 + length:
            return
        body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
        method, path, _ = lines[0].split(" ")
        self.transport.pause_reading()
        self.task = asyncio.get_running_loop().create_task(self.handle(method, path, headers, body))

    def connection_lost(self, exc):
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def pause_writing(self):
        self.writing_paused = True

    def resume_writing(self):
        self.writing_paused = False

    async def handle(self, method, path, headers, body):
        from warmup_agent.proxy.upstream import HOP
        close = headers.get("Connection", "").lower() == "close"
        conn = await self.backend.open(method, path, body, {k: v for k, v in headers.items() if k.lower() not in HOP})
        try:
            await conn.wait_first()
            head = [f"HTTP/1.1 {conn.status} OK\r\n"] + [f"{k}: {v}\r\n" for k, v in conn.headers.items()]
            head.append("Transfer-Encoding: chunked\r\n" + ("Connection: close\r\n" if close else "") + "\r\n")
            self.transport.write("".join(head).encode("latin-1"))
            conn.attach(self.transport, self, reframe=False)
            while not await conn.wait():
                conn.resume()
            self.transport.write(b"0\r\n\r\n")
        finally:
            conn.finish()
        if close:
            self.transport.close()
        else:
            self.transport.resume_reading()


def serve(kind: str, upstream: str, port: int) -> None:
    import gc

    import uvloop

    from warmup_agent.proxy.upstream import UpstreamBackend
    backend = UpstreamBackend(upstream, 300.0)
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)      # as the agent's proxy process does (routing._tune_gc)

    async def raw() -> None:
        await asyncio.get_running_loop().create_server(lambda: _RawClient(backend), "127.0.0.1", port, backlog=4096)
        await asyncio.Event().wait()
    uvloop.run(_serve_aiohttp(backend, port) if kind == "aiohttp_min" else raw())


# -- the measurement ----------------------------------------------------------------------------

def start_target(target: str, workdir: str, up_port: int) -> tuple[subprocess.Popen, int]:
    os.makedirs(workdir, exist_ok=True)
    if target == "nginx":
        return start_nginx(workdir, up_port)
    if target == "proxy":
        proc, _, port = start_agent(workdir, f"http://127.0.0.1:{up_port}")
        return proc, port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.diagnostics.proxy_relay_floor", "serve", target,
                             f"http://127.0.0.1:{up_port}", str(port)], cwd=ROOT)
    wait_http(f"http://127.0.0.1:{port}/v1/models", 30)
    return proc, port


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "proxy_relay_floor.json"))
    a = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="relay-floor-")
    up_port = free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "tests.helpers.servers", "openai-stand-in", "--port",
                                 str(up_port)], cwd=ROOT, stdout=subprocess.DEVNULL)
    cells = []
    try:
        wait_http(f"http://127.0.0.1:{up_port}/health", 30)
        for rep in range(a.reps):
            for target in TARGETS:
                proc, port = start_target(target, os.path.join(workdir, f"{target}-{rep}"), up_port)
                try:
                    for mode in ("new", "keepalive"):
                        c0, t0 = cpu_seconds([proc.pid]), time.monotonic()
                        r = run_load(port, a.streams, mode, a.seconds, 1.0)
                        cpu = cpu_seconds([proc.pid]) - c0
                        cell = {"target": target, "mode": mode, "rep": rep, "rps": r["rps"], "errors": r["errors"],
                                "cpu_percent": round(100 * cpu / (time.monotonic() - t0), 1),
                                "cpu_ms_per_request": round(1e3 * cpu / max(1, r["requests"]), 3)}
                        cells.append(cell)
                        print(cell, flush=True)
                finally:
                    stop(proc)
    finally:
        stop(upstream)
    result = {"benchmark": "proxy_relay_floor", "streams": a.streams, "seconds_per_cell": a.seconds,
              "reps": a.reps, "summary": {}, "cells": cells, **provenance()}
    def med(target: str, key: str, mode: str) -> float:
        return quantile([c[key] for c in cells if c["target"] == target and c["mode"] == mode], 0.5)
    for mode in ("new", "keepalive"):
        nginx_rps = med("nginx", "rps", mode)
        result["summary"][mode] = {t: {"rps_median": med(t, "rps", mode),
                                       "rps_over_nginx": round(med(t, "rps", mode) / nginx_rps, 3),
                                       "cpu_ms_per_request_median": med(t, "cpu_ms_per_request", mode)}
                                   for t in TARGETS}
    write_result(a.out, result)
    print(result["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
