"""Why the first readiness probe after solidify is slower on the native forward (issue 25).

On the H200 the in-process agent's exported first-request tax read 1.05-1.34 on the
native Llama/Qwen2 forward (run 3) against 0.68-1.01 through transformers (run 1).  The
probe is a 16-token prompt, one output token, after the shape grid was warmed and CUDA
graphs were captured.  This script drives the torch engine the way the agent does
(grid warmup, solidify with CUDA graphs) and then times probes of that shape, in one
child process per implementation:

  after_capture      10 probes right after solidify (the agent's case)
  after_idle         5 probes, each after a 0.3 s idle GPU
  after_settle       a fresh engine state is not possible in one process, so: one eager
                     request of another shape, then 5 probes

Each block reports every TTFT in ms and first / median of the rest.  Writes
bench/results/diag_first_probe_<gpu>.json (or --out).

    python3 -m bench.diagnostics.diag_first_probe --model /tmp/qwen2-1.5b-random-fast

Answered (H200, bench/results/diag_first_probe_h200_run1.json, _run2.json): the
first probe is not slow for a reason of its own.  The same 16-token one-token probes
read 17-40 ms from one block to the next in either implementation, and the first of a
block over the median of the rest read 0.70-1.41 for transformers and 0.77-1.20 for the
native forward, with no side consistently slower: the drift is the host launching some
400 kernels per eager prefill.  What followed: solidify also captures the native
model's prefill as CUDA graphs (warmup_agent/gpu/graphs.py, PaddedPrefill).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.provenance import provenance, write_result  # noqa: E402

_variant = [0]


def _fresh(factory, n: int) -> list[int]:
    """A prompt no earlier request began with (as the agent's probes are)."""
    _variant[0] += 7
    return factory.prompt(n, variant=_variant[0])


def _block(engine, factory, n: int, idle: float = 0.0) -> dict:
    ms = []
    for _ in range(n):
        if idle:
            time.sleep(idle)
        ms.append(engine.generate([_fresh(factory, 16)], max_new_tokens=1)[0].first_token_seconds * 1000)
    rest = statistics.median(ms[1:]) if len(ms) > 1 else ms[0]
    return {"ttft_ms": [round(x, 2) for x in ms], "first_over_rest_median": round(ms[0] / rest, 3)}


def child(model: str, implementation: str) -> dict:
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.warmup.traffic import PromptFactory
    engine = TorchEngine(model, implementation=implementation)
    engine.prestart()
    engine.init_device()
    engine.load_tokenizer()
    engine.load_weights()
    factory = PromptFactory(engine.tokenize)
    shapes = [(n, b) for n in (16, 32, 64, 128) for b in (1, 2, 4)]
    for n, b in shapes:
        for _ in range(2):
            engine.generate([_fresh(factory, n) for _ in range(b)], max_new_tokens=8, warmup=True)
    before = _block(engine, factory, 6)            # the probe shape before solidify
    report = engine.solidify(shapes, "cuda_graphs")
    out = {"implementation": engine.implementation, "solidify": report.method, "before_solidify": before,
           "after_capture": _block(engine, factory, 10)}
    out["after_idle"] = _block(engine, factory, 5, idle=0.3)
    engine.generate([_fresh(factory, 48)], max_new_tokens=1)
    out["after_settle"] = _block(engine, factory, 5)
    engine.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=("native", "transformers"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child)), flush=True)
        return 0
    result: dict = {"benchmark": "diag_first_probe", "model": args.model}
    for impl in ("native", "transformers"):
        r = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", impl],
                           capture_output=True, text=True, timeout=240)
        if r.returncode:
            result[impl] = {"error": r.stderr[-1500:]}
            continue
        result[impl] = json.loads(r.stdout.strip().splitlines()[-1])
        print(impl, json.dumps(result[impl]), flush=True)
    result.update(provenance())
    write_result(args.out or "bench/results/diag_first_probe.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
