"""What does a user pay who arrives while the warm-up behind the users runs?  (issue 71)

    python -m bench.diagnostics.diag_user_during_behind [--rounds 6] [--seed 7341]
        [--baseline-tree DIR] [--batch-sizes "[1, 2, 4]"] [--out FILE]

The CPU llama-server of the tests (the padded embedded GGUF) under `warmup-agent run
--proxy-listen ... --` with no --model.  After /readyz, one streamed chat request of 40
random words goes through the proxy at a seeded moment 0.52-0.85 s after ready (the
warm-up behind the users starts after 0.5 s without a user, and runs 0.2-0.4 s here),
then, 2.5 s later, five more: its TTFT over their median is the figure
(`background_user_ttft_over_steady`).  With --baseline-tree (another checkout, e.g.
`git worktree add DIR <commit>`), that tree's agent runs the same rounds, alternating, so
a before and after meet the same neighbours.  Each agent keeps its own data dir across
rounds, as a pod's restarts do.  Also counted from the agent's log: the background
batches stopped for the user (`stopped for a user's request`) and the server's `cancel
task` lines.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.provenance import provenance, write_result  # noqa: E402
from tests.helpers import llamacpp_server as ls  # noqa: E402
from tests.helpers.servers import free_port  # noqa: E402

GGUF = os.path.join(ROOT, ".cache", "test-data", "models", "embedded-llama-v1-bf16-padtext.gguf")


def chat(url: str, words: list[str], rng: random.Random) -> float:
    """Seconds to the first token's event of a streamed chat request of 40 random words."""
    text = " ".join(rng.choice(words) for _ in range(40))
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 16, "ignore_eos": True, "temperature": 0.0,
                       "stream": True}).encode()
    t0 = time.monotonic()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    first, lines = None, []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:                    # read to the end: a closed stream is cancelled
            lines.append(line)
            # a token's event: a delta without the opening role (a random model's token may
            # be an empty piece, so not only events with text)
            if first is None and line.startswith(b"data: {") and b'"role"' not in line:
                first = time.monotonic() - t0
    if first is None:
        raise RuntimeError(f"no token in the answer: {b''.join(lines[-4:])[:600]!r}")
    return first


def one_start(tree: str, data: str, log_path: str, env: dict, rng: random.Random, words: list[str]) -> dict:
    port, listen, proxy = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--engine", "openai", "--listen",
           f"127.0.0.1:{listen}", "--proxy-listen", f"127.0.0.1:{proxy}", "--data-dir", data, "--",
           *ls.server_command(ls.ensure_binary(cuda="off"), GGUF, port, ctx=4096)]
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if urllib.request.urlopen(f"http://127.0.0.1:{listen}/readyz", timeout=1).status == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.005)
            users = f"http://127.0.0.1:{proxy}"
            delay = 0.5 + rng.uniform(0.02, 0.35)
            time.sleep(delay)
            first = chat(users, words, rng)
            time.sleep(2.5)
            steady = statistics.median(chat(users, words, rng) for _ in range(5))
        finally:
            p.terminate()
            p.wait(60)
    text = open(log_path).read()
    stopped = re.search(r"(\d+) batch\(es\) stopped", text)
    return {"arrived_after_ready_seconds": round(delay, 3), "first_ttft_seconds": round(first, 5),
            "steady_ttft_seconds": round(steady, 5), "background_user_ttft_over_steady": round(first / steady, 3),
            "batches_stopped": int(stopped.group(1)) if stopped else None, "server_cancels": text.count("cancel task")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=7341)
    ap.add_argument("--baseline-tree", help="another checkout whose agent runs the same rounds")
    ap.add_argument("--batch-sizes", help="WARMUP_AGENT_PREWARM_BATCH_SIZES for both (default: the config's)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "diag_user_during_behind.json"))
    args = ap.parse_args()
    words = open(os.path.join(ROOT, "README.md")).read().split()
    trees = {"current": ROOT, **({"baseline": args.baseline_tree} if args.baseline_tree else {})}
    env = dict(os.environ, **({"WARMUP_AGENT_PREWARM_BATCH_SIZES": args.batch_sizes} if args.batch_sizes else {}))
    work = tempfile.mkdtemp(prefix="user-during-behind-")
    seeds = random.Random(args.seed)
    starts: dict[str, list[dict]] = {name: [] for name in trees}
    for k in range(args.rounds):
        s = seeds.randrange(1 << 30)
        for name in (list(trees) if k % 2 == 0 else list(reversed(trees))):
            r = one_start(trees[name], os.path.join(work, f"data-{name}"), os.path.join(work, f"{name}-{k}.log"),
                          env, random.Random(s), words)
            starts[name].append(r)
            print(name, r, flush=True)
    summary = {name: {"background_user_ttft_over_steady_median": round(statistics.median(
                          r["background_user_ttft_over_steady"] for r in rs), 3),
                      "background_user_ttft_over_steady_max": max(r["background_user_ttft_over_steady"] for r in rs)}
               for name, rs in starts.items()}
    print(json.dumps(summary))
    write_result(args.out, {**provenance(), "seed": args.seed, "rounds": args.rounds, "batch_sizes": args.batch_sizes,
                            "baseline_tree_commit": _commit(args.baseline_tree) if args.baseline_tree else None,
                            "summary": summary, "starts": starts, "logs": work})


def _commit(tree: str) -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True)
    return r.stdout.strip()


if __name__ == "__main__":
    main()
