"""`warmup-agent bench` (issue 60): the traffic, the figures, the failures, and
brief real runs against the tests' llama-server and CPU vLLM, each checked by an
independent outside client in the same test.

The failure tests start a small stdlib HTTP server written here (a server command
as a user gives one: it answers /health and streams chat) that fails on purpose;
every one checks the one line, the partial JSON and that nothing is left running
(by the process group the JSON names, and by a marker in the command line)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import ROOT
from warmup_agent.bench import process, summary
from warmup_agent.bench.cli import UsageError, model_name, parse_conditions
from warmup_agent.bench.conditions import order
from warmup_agent.bench.traffic import Traffic, load_requests_file

FAKE_SERVER = r'''
import json, os, signal, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
mode, state = args.get("--mode", "ok"), args.get("--state")
if args.get("--child") == "1":        # a child in the server's group that outlives it on SIGTERM
    subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
if mode == "exit":
    print("fake: cannot load the model", flush=True)
    sys.exit(3)
delay = float(args.get("--delay", "0"))

import threading
lock = threading.Lock()

def count():            # chat requests over every start (the starts run one after the other)
    with lock:
        n = int(open(state).read() or 0) + 1 if os.path.exists(state) else 1
        with open(state + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(state + ".tmp", state)
        return n

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(503 if mode == "hang" else 200); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        n = count()
        if mode == "die" and n >= int(args["--die-at"]):
            os.kill(os.getpid(), signal.SIGKILL)
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        for i in range(3):
            time.sleep(delay + 0.002)
            chunk = {"choices": [{"index": 0, "delta": {"content": "w%d " % i}}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n"); self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

ThreadingHTTPServer(("127.0.0.1", int(args["--port"])), H).serve_forever()
'''


def _bench(tmp_path, *args, server: list[str], timeout: float = 120, popen: bool = False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    cmd = [sys.executable, "-m", "warmup_agent", "bench", "--no-progress", "--out", str(tmp_path / "out"),
           "--seed", "11", *args, "--", *server]
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _fake(tmp_path, *extra: str) -> list[str]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    return [sys.executable, str(script), "--port", "{port}", "--marker", str(tmp_path), "--state",
            str(tmp_path / "count"), *extra]


def _left_running(tmp_path, result: dict) -> list[int]:
    """Processes still alive from the run: in a group the JSON names, or with the marker."""
    left = set()
    for rec in result["starts"]:
        if rec.get("pid"):
            left.update(process.group_members(rec["pid"]))
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if str(tmp_path) in cmdline and "pytest" not in cmdline and process._alive(int(pid)):
                left.add(int(pid))
    return sorted(left)


def _result(tmp_path) -> dict:
    with open(tmp_path / "out" / "bench.json") as f:
        return json.load(f)


def _one_line(stderr: str, needle: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if needle in ln]
    assert len(lines) == 1, stderr
    return lines[0]


# --- the traffic and the figures -------------------------------------------------------

def test_draws_are_seeded_and_every_prompt_is_a_fresh_prefix():
    a, b = Traffic(5), Traffic(5)
    assert a.shape(0).body == b.shape(0).body and a.shape(1).describe() == b.shape(1).describe()
    shape = a.shape(0)
    prompts = [a.request(shape)["messages"][-1]["content"] for _ in range(50)]
    assert len({p.split(":")[0] for p in prompts}) == 50          # 50 different prefixes
    assert [p[:30] for p in prompts] == [p[:30] for p in (b.request(shape)["messages"][-1]["content"]
                                                           for _ in range(50))]
    assert Traffic(6).shape(0).body != shape.body or Traffic(6).request(shape) != Traffic(5).request(shape)
    # the mix spans short and long prompts, within the context
    words = [Traffic(s, max_context=256, max_tokens=16).shape(i).prompt_words for s in range(5) for i in range(5)]
    assert min(words) < 10 and max(words) <= 256 // 3


def test_requests_file_prompts_keep_their_shape_with_a_new_prefix(tmp_path):
    f = tmp_path / "traffic.jsonl"
    f.write_text(json.dumps({"model": "x", "messages": [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Where is my order?"}],
                             "max_tokens": 12, "temperature": 0.3, "stream": True}) + "\n"
                 + "not json\n" + json.dumps({"prompt": "Once upon a time", "max_tokens": 5}) + "\n")
    bodies = load_requests_file(str(f))
    assert len(bodies) == 2
    t = Traffic(1, file_bodies=bodies)
    seen = {t.shape(i).source for i in range(20)}
    assert seen == {f"{f}:1", f"{f}:3"}
    shape = next(t.shape(i) for i in range(20) if t.shape(i).source.endswith(":1"))
    body = t.request(shape)
    assert body["max_tokens"] == 12 and body["temperature"] == 0.3 and "model" not in body and "stream" not in body
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["messages"][1]["content"].endswith(": Where is my order?")


def test_conditions_alternate_and_names_come_from_the_command():
    assert order(["alone", "oneshot", "agent"], 2) == [("alone", 0), ("oneshot", 0), ("agent", 0),
                                                       ("oneshot", 1), ("agent", 1), ("alone", 1)]
    assert model_name(["python", "-m", "vllm.x", "--model", "/m", "--served-model-name", "tiny"]) == "tiny"
    assert model_name(["transformers", "serve", "/models/q", "--port", "1"]) == "/models/q"
    assert model_name(["vllm", "serve", "Qwen/Qwen2", "--port", "1"]) == "Qwen/Qwen2"
    assert model_name(["llama-server", "-m", "m.gguf", "--alias", "q"]) == "q"
    with pytest.raises(UsageError):
        parse_conditions("alone,warm")


def test_summary_medians_spread_and_ratios():
    def rec(cond, ready, tax):
        return {"condition": cond, "ready_seconds": ready, "first_ttft_tax": tax, "first": {"ttft_seconds": 0.1},
                "sigterm": {"exit_seconds": 0.5, "orphans": 0}}
    starts = [rec("alone", 10, 3.0), rec("alone", 12, 5.0), rec("agent", 13, 1.1), rec("agent", 11, 1.3)]
    res = summary.result({"tool": "warmup-agent bench"}, starts, ["alone", "agent"])
    assert res["summary"]["alone"]["ready_seconds"] == {"median": 11, "min": 10, "max": 12, "n": 2}
    assert res["ratios"]["agent_over_alone"]["ready_seconds"] == pytest.approx(12 / 11)
    assert res["ratios"]["agent_over_alone"]["first_ttft_tax"] == pytest.approx(1.2 / 4.0)
    assert res["summary"]["agent"]["burst_ttft_over_steady"] is None
    assert json.loads(summary.dumps(res)) == json.loads(json.dumps(res))


@pytest.mark.parametrize("args, needle", [
    ((), "no server command"),
    (("--conditions", "alone,cold", "--", "llama-server", "--port", "1"), "--conditions"),
    (("--", "llama-server", "-m", "m.gguf"), "no --port"),
    (("--requests-file", "/nonexistent.jsonl", "--", "llama-server", "--port", "1"), "cannot read"),
])
def test_usage_errors_are_one_line(tmp_path, args, needle):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    r = subprocess.run([sys.executable, "-m", "warmup_agent", "bench", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert _one_line(r.stderr, needle).startswith("warmup-agent bench: ")


def test_help_explains():
    r = subprocess.run([sys.executable, "-m", "warmup_agent", "bench", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    for word in ("alone", "oneshot", "agent", "--seed", "{port}", "bench.json", "exit codes"):
        assert word in r.stdout


# --- failures: one line, the partial JSON, nothing left running -----------------------

def test_a_server_that_exits_at_once(tmp_path):
    r = _bench(tmp_path, "--starts", "2", server=_fake(tmp_path, "--mode", "exit"))
    assert r.returncode == 3
    line = _one_line(r.stderr, "exited with code 3")
    assert "alone start 1" in line and "cannot load the model" in line
    res = _result(tmp_path)
    assert res["status"] == "failed" and res["error"] in line and res["tool"] == "warmup-agent bench"
    assert res["seed"] == 11 and len(res["starts"]) == 1
    assert _left_running(tmp_path, res) == []


def test_a_server_that_never_becomes_healthy(tmp_path):
    r = _bench(tmp_path, "--conditions", "oneshot", "--ready-timeout", "2", server=_fake(tmp_path, "--mode", "hang"))
    assert r.returncode == 3
    line = _one_line(r.stderr, "never became ready")
    assert "/health did not answer 200 within 2 s" in line
    res = _result(tmp_path)
    assert res["status"] == "failed" and res["starts"][0]["condition"] == "oneshot"
    assert _left_running(tmp_path, res) == []


def test_a_server_killed_mid_run_keeps_what_was_measured(tmp_path):
    # A start sends 1 + steady + burst requests: the second start dies at its third request.
    r = _bench(tmp_path, "--conditions", "alone", "--starts", "2", "--steady", "3", "--burst", "2",
               server=_fake(tmp_path, "--mode", "die", "--die-at", "9", "--child", "1"))
    assert r.returncode == 3
    line = _one_line(r.stderr, "mid-run")
    assert "alone start 2: the server exited with code -9 mid-run" in line
    res = _result(tmp_path)
    assert res["status"] == "failed" and res["starts_done"] == {"alone": 1}
    done, failed = res["starts"]
    assert done["first_ttft_tax"] > 0 and done["sigterm"]["orphans"] == 1     # the child outlived SIGTERM
    assert failed["error"] == res["error"] and "first" in failed and "steady_ttft_seconds" not in failed
    assert res["summary"]["alone"]["ready_seconds"]["n"] == 2                   # both starts got ready
    assert _left_running(tmp_path, res) == []
    assert os.path.exists(tmp_path / "out" / "report.html")


def test_ctrl_c_stops_cleanly(tmp_path):
    proc = _bench(tmp_path, "--conditions", "alone", "--starts", "3", "--steady", "20",
                  server=_fake(tmp_path, "--delay", "0.05", "--child", "1"), popen=True)
    deadline = time.time() + 60
    while not (tmp_path / "count").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    line = _one_line(err, "interrupted")
    assert "interrupted after 0 of 3 starts" in line
    res = _result(tmp_path)
    assert res["status"] == "interrupted" and res["starts_done"] == {"alone": 0}
    assert res["starts"][0]["error"] == "interrupted" and res["starts"][0]["ready_seconds"] > 0
    assert _left_running(tmp_path, res) == []
