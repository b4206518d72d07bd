"""What does a prompt length the process has not seen cost, and in which op?  A diagnosis
for the GPU (issue 30).

    python -m bench.diagnostics.diag_prefill_length [--model DIR] [--out FILE] [--device cuda|cpu]

`transformers serve` with TORCH_CUDNN_SDPA_DEPRIORITIZED=1 still pays per exact prompt
length on the H200: in the server bench (tfserve + switch run 5) fresh lengths read
35-61 ms to first token against 24-38 ms steady, and the user's 243-token length,
between two warmed lengths, paid 10-14 ms once. diag_decode_shapes.py saw the same in
process (new83 49 ms, again83 30 ms) and saw a length whose KV lengths an earlier answer
had decoded through come nearly warm (covered650 40 ms, again650 37 ms).

Here, in process, like the server's eager generate(): warm a few lengths, then for each
of a few fresh lengths time one forward pass at the new length and again at the same
length, each under torch.profiler, and list the ops whose time grew most on the new
length. Run it twice, once with CUDA_MODULE_LOADING=EAGER (kernels loaded at start, not
on first use): if lazy kernel loading is the cost, the eager run has none.
Writes JSON: per fresh length new/again milliseconds, and the top ops by added time.

Answered (H200, bench/results/diag_prefill_length_h200.json and _eager.json): in
process a fresh prompt length cost 0-3 ms over a repeated one (unprofiled), with lazy or
eager CUDA kernel loading alike, so eager kernel loading is no remedy for transformers
serve's per-length cost.

Since then (H200): a warm server with the switch pays +0.6/+1.1 ms at a fresh length
(diag_server_fresh.py), and generate() in process nothing once 16-310 tokens were seen
(diag_fresh_length.py); the 10-14 ms above was the server's speed level moving.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.diagnostics.diag_decode_shapes import load_model, sync  # noqa: E402


def forward_ms(torch, model, length: int, profile: bool) -> tuple[float, dict[str, float]]:
    """One prefill forward at `length` (ms), and per op its self time in ms (CPU + device)."""
    ids = torch.randint(100, 500, (1, length), device=model.device)
    ops: dict[str, float] = {}
    sync(torch)
    if not profile:
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        sync(torch)
        return (time.perf_counter() - t0) * 1e3, ops
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with prof(activities=activities) as p:
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        sync(torch)
        ms = (time.perf_counter() - t0) * 1e3
    for e in p.key_averages():
        device = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
        ops[e.key] = ops.get(e.key, 0.0) + (e.self_cpu_time_total + device) / 1e3
    return ms, ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/qwen2-1.5b-random")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke check on the embedded model")
    ap.add_argument("--fresh", default="243,251,277", help="comma-separated fresh prompt lengths")
    args = ap.parse_args()
    import torch
    model = load_model(args)
    info = {"torch": torch.__version__, "device": args.device,
            "attn_implementation": model.config._attn_implementation,
            **{k: os.environ.get(k) for k in ("TORCH_CUDNN_SDPA_DEPRIORITIZED", "CUDA_MODULE_LOADING")}}
    print(info, flush=True)
    fresh = [int(x) for x in args.fresh.split(",")]
    cases = []
    with torch.no_grad():
        for n in (16, 180, 230, 262, 310):          # the server bench's profile lengths, roughly
            forward_ms(torch, model, n, False)
            forward_ms(torch, model, n, False)
        for n in fresh:
            new_ms, new_ops = forward_ms(torch, model, n, True)
            again_ms, again_ops = forward_ms(torch, model, n, True)
            plain_new = forward_ms(torch, model, n + 1, False)[0]     # unprofiled, a further fresh length
            plain_again = forward_ms(torch, model, n + 1, False)[0]
            grew = sorted(((k, v - again_ops.get(k, 0.0)) for k, v in new_ops.items()), key=lambda kv: -kv[1])[:12]
            case = {"length": n, "new_ms": round(new_ms, 3), "again_ms": round(again_ms, 3),
                    "unprofiled_new_ms": round(plain_new, 3), "unprofiled_again_ms": round(plain_again, 3),
                    "ops_that_grew_ms": [[k, round(v, 3)] for k, v in grew if v > 0]}
            cases.append(case)
            print(f"length {n}: new {new_ms:.1f} ms, again {again_ms:.1f} ms (unprofiled {plain_new:.1f} / "
                  f"{plain_again:.1f} ms); grew most: " + ", ".join(f"{k} +{v:.2f}" for k, v in grew[:5]), flush=True)
    if args.out:
        from bench.provenance import provenance, write_result
        write_result(args.out, {"benchmark": "diag_prefill_length", "info": info, "cases": cases, **provenance()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
