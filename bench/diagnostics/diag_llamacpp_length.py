"""What does a warm llama-server pay for a prompt length it has not run, and why?  A
diagnosis for the GPU (issue 40).

    python -m bench.diagnostics.diag_llamacpp_length --llama-server BIN --gguf MODEL.gguf [--out FILE]

The server bench (bench_gpu_server.py --server llamacpp) reads the first user request at
1.3-1.6x the steady level, one warm-up request or the agent before it alike, while a
warm request at a new length after the steady ones read about 1.1x.  Here one server per
variant (its defaults; CUDA_MODULE_LOADING=EAGER, where a kernel first used at some
length would otherwise load then; GGML_CUDA_DISABLE_GRAPHS=1, where the steady level of
one repeated length comes from CUDA graph replay; `--cache-ram 0`, where the next request
saves its predecessor's slot to host memory) gets the same sequence of token-id prompts
through `/completion` (one output token, no prompt cache, fresh random ids every time):
a short cold request, then lengths repeated and fresh, near and far from the ones before,
and ten distinct lengths in a row.  Variants `plain` and `ladder`: the cold request, then
(`ladder` only) one request at each of LADDER's lengths, then a probe-like request and new
lengths, each once more right after.  Variants `graphs_off_*`: without CUDA graphs, and
without llama.cpp's graph reuse, cuBLASLt's heuristics cache or flash attention.  Variants
`map*`: 40 fresh lengths, each twice in a row (plain, without CUDA graphs, after a ladder
every 16 or 32 tokens), summarised as which new lengths paid against the blocks of tokens
run before (`map` in the JSON).  The server's own `timings.prompt_ms` says what each
prefill cost; the client's time says the rest.  Writes JSON with every request and the
variants' start-up times.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.provenance import provenance, write_result  # noqa: E402
from warmup_agent.bench import client, process  # noqa: E402

#: (label, prompt tokens): the cold request, then repeats and fresh lengths.
SEQUENCE = ([("cold", 10)] + [("first 285", 285)] + [("again 285", 285)] * 3
            + [("new 131", 131)] + [("again 131", 131)] * 2 + [("new 132", 132), ("again 132", 132)]
            + [("new 140", 140), ("again 140", 140), ("new 200", 200), ("again 200", 200)]
            + [("new 64", 64), ("again 64", 64), ("new 500", 500), ("again 500", 500), ("back 131", 131)]
            + [(f"distinct {n}", n) for n in range(150, 160)]
            + [("new 700", 700), ("again 700", 700), ("new 1000", 1000), ("again 1000", 1000)])

#: A length ladder (issue 40): does one request at each rung make later new lengths cheap?
LADDER = [16, 24, 32, 48, 64, 96, 128, 176, 240, 320, 416, 512]
#: After the cold request and one probe-like request: new lengths, each then again.
AFTER = [("probe 285", 285)] + [x for n in (131, 203, 71, 300, 631, 151, 457, 93, 389, 45) for x in ((f"new {n}", n), (f"again {n}", n))]
LADDER_SEQUENCE = [("cold", 10)] + [(f"rung {n}", n) for n in LADDER] + AFTER
PLAIN_SEQUENCE = [("cold", 10)] + AFTER

#: The map (variants `map`, `map_graphs_off`): MAP_PAIRS fresh lengths drawn from MAP_RANGE
#: (one ubatch each), each sent twice in a row.  Which new lengths pay, against how near the
#: lengths run before them were: the nearest one, or one in the same block of W tokens.
MAP_RANGE, MAP_PAIRS, MAP_WIDTHS = (64, 512), 40, (8, 16, 32, 64, 128)
#: A new length "pays" where its prefill took this much more than the same length right after.
PAYS_MS = 3.0


def map_sequence(rng: random.Random, rungs: int = 0) -> list[tuple[str, int]]:
    """The map's requests; `rungs` > 0: first one request every `rungs` tokens across
    MAP_RANGE (does a dense ladder leave any new length to pay?)."""
    lengths = rng.sample(range(*MAP_RANGE), MAP_PAIRS)
    ladder = [(f"rung {n}", n) for n in range(MAP_RANGE[0], MAP_RANGE[1] + 1, rungs)] if rungs else []
    return ([("cold", 10), ("first 285", 285), ("again 285", 285)] + ladder
            + [x for n in lengths for x in ((f"new {n}", n), (f"again {n}", n))])


def map_summary(rows: list[dict]) -> dict:
    """Each new/again pair: its premium (ms of prefill over the same length right after),
    the distance to the nearest length run before it, and whether a length run before
    fell in its block of W tokens; then, per W and per distance, how often a new length paid."""
    pairs = []
    for i in range(1, len(rows) - 1):
        a, b = rows[i], rows[i + 1]
        if not (a["label"].startswith("new ") and b["label"].startswith("again ")) or None in (a["prompt_ms"], b["prompt_ms"]):
            continue
        n, before = a["prompt_tokens"], [r["prompt_tokens"] for r in rows[:i]]
        pairs.append({"tokens": n, "premium_ms": round(a["prompt_ms"] - b["prompt_ms"], 2),
                      "nearest_before": min(abs(n - m) for m in before),
                      "block_seen": {str(w): any(m // w == n // w for m in before) for w in MAP_WIDTHS}})

    def share(sel: list[dict]) -> dict:
        prem = sorted(p["premium_ms"] for p in sel)
        return {"pairs": len(sel), "paid": sum(x > PAYS_MS for x in prem),
                "premium_ms_median": prem[len(prem) // 2] if prem else None}
    by_block = {str(w): {"seen": share([p for p in pairs if p["block_seen"][str(w)]]),
                         "not_seen": share([p for p in pairs if not p["block_seen"][str(w)]])} for w in MAP_WIDTHS}
    by_distance = {f"<= {d}": share([p for p in pairs if lo < p["nearest_before"] <= d])
                   for lo, d in ((-1, 4), (4, 16), (16, 32), (32, 64), (64, 10**6))}
    return {"pays_ms": PAYS_MS, "pairs": pairs, "by_block": by_block, "by_nearest_before": by_distance}


VARIANTS = [("default", {}, []), ("eager_modules", {"CUDA_MODULE_LOADING": "EAGER"}, []),
            ("no_cuda_graphs", {"GGML_CUDA_DISABLE_GRAPHS": "1"}, []), ("no_cache_ram", {}, ["--cache-ram", "0"]),
            ("plain", {}, []), ("ladder", {}, []),
            # Without CUDA graphs (whose capture on a shape's second request muddles the
            # picture), what is left of a new length's premium, and what takes it away:
            # llama.cpp's own graph reuse off (does the same length again pay too: the
            # graph's build and allocation), cuBLASLt's heuristics cache off (a GEMM's
            # algorithm chosen on every call), flash attention off (its kernels' tiles).
            ("graphs_off_no_reuse", {"GGML_CUDA_DISABLE_GRAPHS": "1", "LLAMA_GRAPH_REUSE_DISABLE": "1"}, []),
            ("graphs_off_no_heuristics_cache", {"GGML_CUDA_DISABLE_GRAPHS": "1",
                                                "CUBLASLT_HEURISTICS_CACHE_CAPACITY": "0"}, []),
            ("graphs_off_fa_off", {"GGML_CUDA_DISABLE_GRAPHS": "1"}, ["-fa", "off"]),
            ("map", {}, []), ("map_graphs_off", {"GGML_CUDA_DISABLE_GRAPHS": "1"}, []),
            ("map_after_ladder16", {}, []), ("map_after_ladder32", {}, [])]


def post(url: str, body: dict) -> tuple[dict, float]:
    t = time.perf_counter()
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t


def run_variant(args: argparse.Namespace, name: str, env: dict, extra: list[str], rng: random.Random) -> dict:
    port = process.free_port()
    cmd = [args.llama_server, "-m", args.gguf, "-ngl", "99", "--host", "127.0.0.1", "--port", str(port), "-c", "4096",
           *extra]
    log = os.path.join(args.logs or "/tmp", f"llama_{name}.log")
    server = process.spawn(cmd, log, env={**os.environ, **env})
    base = f"http://127.0.0.1:{port}"
    try:
        while client.get_status(base + "/health") != 200:
            if server.exited() is not None or time.monotonic() - server.t0 > 120:
                raise RuntimeError(f"llama-server never answered /health 200 (exit {server.exited()}; {log})")
            time.sleep(0.01)
        healthy = time.monotonic() - server.t0
        rows = []
        rungs = int(name.rsplit("ladder", 1)[1]) if name.startswith("map_after_ladder") else 0
        sequence = (map_sequence(rng, rungs) if name.startswith("map")
                    else {"plain": PLAIN_SEQUENCE, "ladder": LADDER_SEQUENCE}.get(name, SEQUENCE))
        for label, n in sequence:
            ids = [rng.randrange(100, args.max_id) for _ in range(n)]
            out, wall = post(base + "/completion", {"prompt": ids, "n_predict": 1, "cache_prompt": False,
                                                     "temperature": 0})
            timings = out.get("timings", {})
            rows.append({"label": label, "prompt_tokens": n, "prompt_ms": timings.get("prompt_ms"),
                         "client_ms": round(wall * 1e3, 3)})
            print(f"{name:15s} {label:14s} prompt {timings.get('prompt_ms', 0):7.2f} ms  client {wall * 1e3:7.2f} ms",
                  flush=True)
        out = {"variant": name, "env": env, "args": extra, "healthy_after_spawn_seconds": round(healthy, 3),
               "requests": rows}
        if name.startswith("map"):
            out["map"] = map_summary(rows)
            print(json.dumps({"variant": name, "by_block": out["map"]["by_block"],
                              "by_nearest_before": out["map"]["by_nearest_before"]}), flush=True)
        return out
    finally:
        process.stop(server, timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="llama-server binary (CUDA build)")
    ap.add_argument("--gguf", required=True, help="the model as GGUF")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "diag_llamacpp_length.json"))
    ap.add_argument("--logs", default=None, help="keep each server's log here")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-id", type=int, default=30000, help="prompt token ids are drawn below this (under the vocabulary)")
    ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    args = ap.parse_args()
    for path in (args.llama_server, args.gguf):
        if not os.path.exists(path):
            ap.error(f"{path}: no such file")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    chosen = args.variants.split(",")
    runs = []
    for name, env, extra in VARIANTS:
        if name in chosen:
            try:
                runs.append(run_variant(args, name, env, extra, rng))
            except (RuntimeError, OSError) as e:   # a server that would not start or answer: the others still run
                print(f"{name}: failed: {e}", flush=True)
                runs.append({"variant": name, "env": env, "args": extra, "error": str(e)})
    write_result(args.out, {"benchmark": "diag_llamacpp_length", "seed": seed, "server": args.llama_server,
                            "runs": runs, **provenance()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
