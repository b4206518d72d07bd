"""How long config loading takes to check a large prewarm.requests_file (issue 29:
a file of 1 million lines, checked in under 10 s on the development machine).

Writes a JSON Lines file of gateway-like bodies (chat and completions, half
each, prompts of 5-60 words, a few sampling fields; about 290 bytes a line),
then times `config.load` with it (the check the agent and `check-config` run
before anything starts) and `requests_file.check_file` alone, wall and CPU
seconds, best of --repeat.  The machine may be shared: CPU seconds are the
figure a busy neighbour moves least.  Writes bench/results/requests_file_<label>.json.

    .venv/bin/python -m bench.bench_requests_file [--lines 1000000] [--repeat 3] [--label cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.provenance import provenance, write_result  # noqa: E402
from warmup_agent import config  # noqa: E402
from warmup_agent.warmup import requests_file  # noqa: E402


def write_file(path: str, lines: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            words = "word " * rng.randint(5, 60)
            if i % 2:
                body = {"model": "m", "messages": [{"role": "system", "content": "You are helpful."},
                                                   {"role": "user", "content": words}],
                        "max_tokens": 64, "temperature": 0.7, "top_p": 0.9}
            else:
                body = {"model": "m", "prompt": words, "max_tokens": 16, "temperature": 0, "logprobs": 2, "stop": ["\n"]}
            f.write(json.dumps(body) + "\n")


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--label", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "requests.jsonl")
        write_file(path, args.lines)
        size = os.path.getsize(path)
        env = {"WARMUP_AGENT_ENGINE": "openai", "WARMUP_AGENT_PREWARM_REQUESTS_FILE": path,
               "WARMUP_AGENT_DATA_DIR": os.path.join(tmp, "data")}
        loads = [timed(lambda: config.load(env=env)) for _ in range(args.repeat)]
        checks = [timed(lambda: requests_file.check_file(path, keep_good=False)) for _ in range(args.repeat)]
        assert requests_file.check_file(path, keep_good=False).good_count == args.lines
    best_load = min(loads)
    result = {
        "benchmark": "requests_file_check",
        "lines": args.lines, "bytes": size,
        "config_load_seconds": {"wall": [round(w, 3) for w, _ in loads], "cpu": [round(c, 3) for _, c in loads]},
        "check_file_seconds": {"wall": [round(w, 3) for w, _ in checks], "cpu": [round(c, 3) for _, c in checks]},
        "best_config_load_wall_seconds": round(best_load[0], 3),
        "target_seconds": 10.0,
        "within_target": best_load[0] < 10.0,
        "load_average": list(os.getloadavg()),
        **provenance(),
    }
    out = args.out or os.path.join(ROOT, "bench", "results", f"requests_file_{args.label}.json")
    write_result(out, result)
    print(json.dumps({k: result[k] for k in ("lines", "bytes", "config_load_seconds", "check_file_seconds",
                                             "within_target", "load_average")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
