"""Process start to the torch engine's first forward: native vs transformers (issue 25).

    python -m bench.diagnostics.native_start [--model DIR] [--repeat 3] [--device cpu] [--out JSON]

Each start is a fresh interpreter that does what the CLI does with the torch
engine, without the agent around it: create the engine, prestart() (the
background import and skeleton), load_weights(), load_tokenizer(), then one
1-token request.  The two implementations alternate (model.implementation
native, then transformers, repeat times), so the figures are side by side
from one run on one machine.  Reported per start: spawn -> first forward
done, the import of the engine module, the wait for the skeleton (the
background import), the weight load, the tokenizer, the first request, and
whether any transformers module was imported.  Default model: the embedded
Llama (made under --data-dir when missing).

Answered (2-core CPU, bench/results/native_start_cpu.json, 3 alternating starts
each, the embedded Llama): process start to the first forward, median 5.73 s native
against 8.31 s through transformers; the native start imports no transformers module,
and its skeleton thread's 4.5-5.4 s is almost all `import torch` on that machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.provenance import provenance, write_result  # noqa: E402

CHILD = r'''
import json, sys, time
t_spawn = float(sys.argv[4])
t0 = time.time()
from warmup_agent.engines.torch.engine import TorchEngine
t_module = time.time()
e = TorchEngine(sys.argv[1], device=sys.argv[2], implementation=sys.argv[3])
e.prestart()
t1 = time.time()
e.init_device()
e.load_weights()
t_weights = time.time()
e.load_tokenizer()
t_tok = time.time()
r = e.generate([e.tokenize("the first request is as fast as the thousandth")], max_new_tokens=1)[0]
t_first = time.time()
print(json.dumps({
    "implementation": e.implementation, "reason": e.implementation_reason,
    "python_start_seconds": t0 - t_spawn, "engine_module_import_seconds": t_module - t0,
    "load_weights_seconds": t_weights - t1, "skeleton_build_seconds": e.skeleton_build_seconds,
    "skeleton_wait_seconds": e.skeleton_wait_seconds, "tokenizer_seconds": t_tok - t_weights,
    "first_request_seconds": r.first_token_seconds, "spawn_to_first_forward_seconds": t_first - t_spawn,
    "transformers_imported": any(m == "transformers" or m.startswith("transformers.") for m in sys.modules)}))
'''


def start(model: str, device: str, implementation: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", CHILD, model, device, implementation, repr(t0)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{implementation} start failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded Llama)")
    ap.add_argument("--data-dir", default=os.path.join(ROOT, ".cache", "test-data"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from warmup_agent.model.embedded import ensure_embedded_model
        model = ensure_embedded_model(args.data_dir)
    runs: dict[str, list[dict]] = {"native": [], "transformers": []}
    for i in range(args.repeat):
        for impl in ("native", "transformers"):
            runs[impl].append(start(model, args.device, impl))
            print(f"{i} {impl:12s} spawn->first forward {runs[impl][-1]['spawn_to_first_forward_seconds']:.2f} s", flush=True)
    med = {impl: statistics.median(r["spawn_to_first_forward_seconds"] for r in rs) for impl, rs in runs.items()}
    result = {"model": model, "device": args.device, "repeat": args.repeat, "runs": runs,
              "median_spawn_to_first_forward_seconds": med,
              "native_over_transformers": med["native"] / med["transformers"], "provenance": provenance()}
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "provenance")}, indent=2))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
