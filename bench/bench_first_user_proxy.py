"""The users' whole first answer through the proxy beside a supervised server (issue 61),
exported by the agent and measured by an outside client, side by side.

Each start runs `warmup-agent run --engine openai --model M --proxy-listen H:P --
<server command>` with no URL (the proxy finds the supervised server itself).  After
/readyz an outside client sends streamed chat requests through the proxy, as most
clients do: no `stream_options`, so no answer carries usage.  The first asks for a
longer answer than the STEADY ones after it.  The client times each itself (first body
byte, end of body) and counts its tokens on its own: llama.cpp's `timings.predicted_n`
(the server's count in its last event), else the chunks whose delta carries content.
Its whole-answer figure is first_user.py's formula on its own times:

  first whole answer / (median steady TTFT + (first's tokens - 1) x median steady time per token)

and the agent's is `warmup_first_user_request_total_tax_ratio` from its /metrics.
`first_user_total_tax_over_outside` is the agent's over the client's, per start.

Run: .venv/bin/python -m bench.bench_first_user_proxy [--server llamacpp|vllm] [--starts 3] [--out PATH]
Writes bench/results/first_user_proxy_<server>_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.helpers.servers import free_port, http_get, wait_until  # noqa: E402

STEADY = 5
FIRST_TOKENS, STEADY_TOKENS = 96, 64
#: What the agent is asked to do at each start: a small grid, only users' requests after SERVING.
AGENT_ENV = {"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[24]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
             "WARMUP_AGENT_PREWARM_MAX_OUTPUT_TOKENS": "4", "WARMUP_AGENT_READINESS_PROBE_MAX_TOKENS": "4",
             "WARMUP_AGENT_READINESS_PROBE_PROMPT_LENGTH": "20", "WARMUP_AGENT_READINESS_MIN_PROBES": "5",
             "WARMUP_AGENT_READINESS_TPOT_CONVERGENCE_RATIO": "4",
             "WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "0",
             "WARMUP_AGENT_READINESS_FIRST_USER_STEADY_REQUESTS": str(STEADY)}


def server_command(server: str, data_dir: str, port: int) -> tuple[list[str], dict[str, str], str]:
    """(the server's command, its environment, the model directory) for `server`."""
    from warmup_agent.model.embedded import ensure_embedded_model
    model = ensure_embedded_model(data_dir)
    scratch = tempfile.mkdtemp(prefix="first-user-proxy-")
    if server == "llamacpp":
        from tests.helpers import llamacpp_server as ls
        return ls.server_command(ls.ensure_binary(), ls.ensure_gguf(model), port), ls.server_env(scratch), model
    from tests.helpers import vllm_server as vs
    return vs.server_command(model, port), vs.server_env(scratch), model


def chat(proxy: str, model: str, i: int, max_tokens: int) -> dict:
    """One streamed chat request without usage, timed and counted by this client."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Question {i}: where is my order {i * 7919}?"}],
            "max_tokens": max_tokens, "temperature": 0.7, "top_p": 0.9, "seed": i, "stream": True}
    req = urllib.request.Request(proxy + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    first = None
    raw = b""
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        while chunk := r.read1(65536):
            if first is None:
                first = time.perf_counter() - t0
            raw += chunk
    total = time.perf_counter() - t0
    assert first is not None
    return {"ttft": first, "total": total, "tokens": client_tokens(raw), "bytes": len(raw)}


def client_tokens(raw: bytes) -> int:
    """The answer's tokens as this client reads them: llama.cpp's own count where its last
    event has one (timings.predicted_n), else the chunks whose delta carries content."""
    chunks, predicted = 0, None
    for line in raw.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        event = json.loads(line[5:])
        predicted = (event.get("timings") or {}).get("predicted_n", predicted)
        for c in event.get("choices") or ():
            delta = c.get("delta") or {}
            if isinstance(delta.get("content"), str) and "role" not in delta:
                chunks += 1
    return int(predicted) if predicted is not None else chunks


def outside_total_tax(answers: list[dict]) -> float:
    """first_user.py's whole-answer figure, on this client's own times and counts."""
    first, later = answers[0], answers[1:]
    steady_ttft = statistics.median(a["ttft"] for a in later)
    tpot = statistics.median((a["total"] - a["ttft"]) / (a["tokens"] - 1) for a in later if a["tokens"] >= 2)
    return first["total"] / (steady_ttft + (first["tokens"] - 1) * tpot)


def gauge(url: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", http_get(url + "/metrics")[1], re.M)
    return float(m.group(1)) if m else 0.0


def one_start(server: str, data_dir: str, i: int, log_dir: str) -> dict:
    """One agent start with its server; the users' answers and both figures."""
    port, listen, proxy_port = free_port(), free_port(), free_port()
    command, env, model_dir = server_command(server, data_dir, port)
    env.update(AGENT_ENV)
    log = os.path.join(log_dir, f"agent-{server}-{i}.log")
    agent = subprocess.Popen([sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--engine", "openai",
                              "--model", model_dir, "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}",
                              "--proxy-listen", f"127.0.0.1:{proxy_port}", "--", *command],
                             cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url, proxy = f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{proxy_port}"
    try:
        t0 = time.monotonic()
        wait_until(lambda: http_get(url + "/readyz", timeout=2)[0] == 200 or agent.poll() is not None, 600,
                   what="SERVING")
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited ({agent.returncode}): {open(log).read()[-3000:]}")
        ready = time.monotonic() - t0
        # The served name, asked of the server itself: a GET through the proxy would be the users' first request.
        model = json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"]
        answers = [chat(proxy, model, 1000 * i, FIRST_TOKENS)]
        answers += [chat(proxy, model, 1000 * i + k, STEADY_TOKENS) for k in range(1, STEADY + 1)]
        wait_until(lambda: gauge(url, "warmup_first_user_request_tax_ratio") > 0, 15, what="the users' figures")
        exported = {"ttft": gauge(url, "warmup_first_user_request_tax_ratio"),
                    "total": gauge(url, "warmup_first_user_request_total_tax_ratio")}
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            rc = agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()
            rc = agent.wait()
    outside_total = outside_total_tax(answers)
    steady_ttft = statistics.median(a["ttft"] for a in answers[1:])
    return {"start": i, "ready_seconds": round(ready, 3), "exit_code": rc, "answers": answers,
            "exported_ttft_tax": exported["ttft"], "outside_ttft_tax": answers[0]["ttft"] / steady_ttft,
            "exported_total_tax": exported["total"], "outside_total_tax": outside_total,
            "total_tax_over_outside": exported["total"] / outside_total}


def run(server: str, starts: int, data_dir: str, log_dir: str) -> dict:
    """`starts` starts, one after the other; the per-start figures and their range."""
    rows = [one_start(server, data_dir, i, log_dir) for i in range(starts)]
    ratios = [r["total_tax_over_outside"] for r in rows]
    return {"server": server, "starts": rows, "steady_requests": STEADY,
            "first_tokens_asked": FIRST_TOKENS, "steady_tokens_asked": STEADY_TOKENS,
            "first_user_total_tax_over_outside_min": min(ratios),
            "first_user_total_tax_over_outside_max": max(ratios)}


def table(result: dict) -> str:
    lines = [f"{'start':>5} {'ready s':>8} {'TTFT tax agent':>14} {'outside':>8} {'whole tax agent':>15} "
             f"{'outside':>8} {'agent/outside':>13}"]
    for r in result["starts"]:
        lines.append(f"{r['start']:>5} {r['ready_seconds']:>8.2f} {r['exported_ttft_tax']:>14.3f} "
                     f"{r['outside_ttft_tax']:>8.3f} {r['exported_total_tax']:>15.3f} {r['outside_total_tax']:>8.3f} "
                     f"{r['total_tax_over_outside']:>13.3f}")
    lines.append(f"first_user_total_tax_over_outside: {result['first_user_total_tax_over_outside_min']:.3f}"
                 f"-{result['first_user_total_tax_over_outside_max']:.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=("llamacpp", "vllm"), default="llamacpp")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--data-dir", default=os.path.join(ROOT, ".cache", "test-data"))
    ap.add_argument("--out")
    args = ap.parse_args()
    from bench.provenance import provenance, write_result
    log_dir = tempfile.mkdtemp(prefix="first-user-proxy-logs-")
    result = {**provenance(), **run(args.server, args.starts, args.data_dir, log_dir)}
    print(table(result))
    day = datetime.date.today().isoformat()
    out = args.out or os.path.join(ROOT, "bench", "results", f"first_user_proxy_{args.server}_{day}.json")
    write_result(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
