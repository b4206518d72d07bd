"""The bench's stream reader (warmup_agent/bench/client.py, issue 73 part 3): a stream
that ends in an error event (what the agent's proxy sends on a 504 from upstream) and
one cut off before `data: [DONE]` (and before its finish_reason) are failed requests,
named in the bench's output, never a timing, and never in a median.

Every test talks to a stand-in server: a small stdlib HTTP server written here, a real
process listening on 127.0.0.1, that streams chat answers and fails on purpose: the
request's `how` field says how (for the client tests), or the server fails its Nth
chat request over all starts (for the bench runs, which start it as a user's server)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import ROOT
from warmup_agent.bench import client, process

STAND_IN_SERVER = r'''
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
state, fail_at, fail_how = args.get("--state"), int(args.get("--fail-at", "0")), args.get("--how", "ok")
delay = float(args.get("--delay", "0"))
lock = threading.Lock()

def count():            # chat requests over every start (the starts run one after the other)
    if not state:
        return 0
    with lock:
        n = int(open(state).read() or 0) + 1 if os.path.exists(state) else 1
        with open(state + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(state + ".tmp", state)
        return n

def event(obj):
    return b"data: " + json.dumps(obj).encode() + b"\n\n"

def token(i):
    return event({"choices": [{"index": 0, "delta": {"content": "w%d " % i}, "finish_reason": None}]})

# the agent's proxy's error event on a 504 from upstream (proxy/routing.py _error_body)
ERROR = event({"error": {"message": "/v1/chat/completions upstream 127.0.0.1:1 sent nothing for 0.5 s "
                                    "(proxy.timeout_seconds)", "type": "upstream_timeout", "param": None,
                         "code": 504}})

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data)); self.wfile.flush()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        n = count()
        how = body.get("how") or (fail_how if n == fail_at else "ok")
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        if how == "cut-unframed":        # no length, no chunks: the answer ends where the connection closes
            self.send_header("Connection", "close"); self.end_headers(); self.close_connection = True
            write = lambda d: (self.wfile.write(d), self.wfile.flush())
        else:
            self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
            write = self.chunk
        for i in range(3):
            time.sleep(0.002)
            write(token(i))
        if how == "error":               # a well-framed stream that ends in an error event
            time.sleep(delay)
            write(ERROR)
        elif how in ("ok", "no-done"):
            write(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
            if how == "ok":
                write(b"data: [DONE]\n\n")
        if how == "cut-mid-chunk":       # a chunk that says 64 bytes, 9 of them sent
            self.wfile.write(b"40\r\ndata: {\"c"); self.wfile.flush()
        if how in ("cut-chunked", "cut-mid-chunk"):   # the connection drops before the last chunk
            self.close_connection = True
            return
        if how != "cut-unframed":
            self.wfile.write(b"0\r\n\r\n"); self.wfile.flush()

ThreadingHTTPServer(("127.0.0.1", int(args["--port"])), H).serve_forever()
'''


def _script(tmp_path) -> str:
    path = tmp_path / "stand_in_server.py"
    path.write_text(STAND_IN_SERVER)
    return str(path)


@pytest.fixture
def stand_in(tmp_path):
    """The stand-in server, running; yields its base URL."""
    port = process.free_port()
    proc = subprocess.Popen([sys.executable, _script(tmp_path), "--port", str(port)])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while client.get_status(base + "/health") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.02)
        yield base
    finally:
        proc.kill()
        proc.wait()


def _ask(base: str, how: str) -> client.Answer:
    return client.stream_chat(base, "m", {"messages": [{"role": "user", "content": "hi"}], "how": how})


@pytest.mark.parametrize("how", ["ok", "no-done"])
def test_a_whole_stream_is_an_answer(stand_in, how):
    """`no-done`: a finish_reason, then the end without `data: [DONE]`, as transformers
    serve answers (its chat stream sends no [DONE]): a whole answer, not a cut-off one."""
    a = _ask(stand_in, how)
    assert a.chunks == 3 and 0 < a.ttft <= a.total


def test_a_stream_that_ends_in_an_error_event_is_a_failed_request(stand_in):
    with pytest.raises(client.RequestFailed) as e:
        _ask(stand_in, "error")
    assert e.value.kind == "error_event"
    assert "upstream_timeout" in str(e.value) and "sent nothing for 0.5 s" in str(e.value)
    assert "after 3 token chunk(s)" in str(e.value)


@pytest.mark.parametrize("how", ["cut-chunked", "cut-mid-chunk", "cut-unframed"])
def test_a_stream_cut_before_done_is_a_failed_request(stand_in, how):
    with pytest.raises(client.RequestFailed) as e:
        _ask(stand_in, how)
    assert e.value.kind == "cut_off" and "a stream cut off: " in str(e.value), str(e.value)
    assert "3 token chunk(s)" in str(e.value)


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    server = [sys.executable, _script(tmp_path), "--port", "{port}", "--state", str(tmp_path / "count"), *args]
    cmd = [sys.executable, "-m", "warmup_agent", "bench", "--no-progress", "--out", str(tmp_path / "out"),
           "--seed", "11", "--idle", "0.2", "--conditions", "alone", "--starts", "2", "--steady", "3",
           "--burst", "0", "--", *server]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


# A start sends 1 first + 3 steady + 2 controls + 2 at a new length = 8 requests: request 9
# is the second start's first request, request 11 its second steady one.
@pytest.mark.parametrize("how, fail_at, needle", [
    ("error", 9, "a request failed mid-run: the server sent an error event mid-stream"),
    ("cut-chunked", 11, "a request failed mid-run: the server cut its stream off"),
])
def test_the_bench_names_the_failed_request_and_keeps_it_out_of_every_median(tmp_path, how, fail_at, needle):
    # The error event comes 0.5 s after the tokens: counted as an answer, it would read
    # as a first request of 0.5 s.
    r = _bench(tmp_path, "--fail-at", str(fail_at), "--how", how, "--delay", "0.5")
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if needle in ln]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("warmup-agent bench: alone start 2: ")
    with open(tmp_path / "out" / "bench.json") as f:
        res = json.load(f)
    assert res["status"] == "failed" and needle in res["error"] and res["starts_done"] == {"alone": 1}
    done, failed = res["starts"]
    assert "error" not in done and failed["error"] == res["error"]
    # what the failed start measured stops before the failed request
    assert "steady_ttft_seconds" not in failed and "steady_ttft_all_seconds" not in failed
    assert ("first" in failed) == (fail_at > 9)
    summary = res["summary"]["alone"]
    firsts = 2 if fail_at > 9 else 1            # the second start's first request answered or failed
    for key in ("first_ttft_seconds", "first_total_seconds"):
        assert summary[key]["n"] == firsts, (key, summary[key])
    for key in ("steady_ttft_seconds", "steady_total_seconds", "first_ttft_tax", "warm_control_ttft_ratio"):
        assert summary[key]["n"] == 1, (key, summary[key])
    assert summary["first_total_seconds"]["max"] < 0.5
