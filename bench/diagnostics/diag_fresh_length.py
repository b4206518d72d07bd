"""Which part of an eager generate() pays for a prompt length the process has not seen?
A diagnosis for the GPU (issue 30).

    python -m bench.diagnostics.diag_fresh_length [--model DIR] [--out FILE] [--device cuda|cpu]

`transformers serve` (eager generate(), TORCH_CUDNN_SDPA_DEPRIORITIZED=1) pays 10-20 ms
more to first token at a prompt length it has not seen (H200 tfserve + switch runs 7-8:
fresh lengths 41-69 ms against 31-55 ms steady, the first probe at 263 tokens 12 ms more
than the next two). diag_decode_shapes.py saw it in process with generate() (new83 49 ms,
again83 30 ms), and diag_prefill_length.py did not with a full-logits forward (0-3 ms).

Here, after warming a few lengths, each part is timed at a fresh length ("new") and at
once more at the same length ("again"), each part on lengths of its own so one part
cannot warm another's:
  generate   generate(max_new_tokens=1), sampled, as the server runs it
  keep1      the model's forward with logits_to_keep=1 (generate's prefill)
  full       the forward with logits for every position (diag_prefill_length's)
  linear     layer 0's seven projections on [1, L, hidden]
  sdpa       scaled_dot_product_attention at [1, heads, L, head_dim], causal
  rope       the rotary embedding at L positions
then generate, keep1 and linear again with the cuBLASLt backend preferred, and keep1's
new-vs-again op times under torch.profiler (CPU side). Writes JSON with every figure.

Answered (H200, bench/results/diag_fresh_length_h200.json): after 16-310 tokens had
been seen, generate() at a fresh length cost -2.1 ms over the same length again (median
of three), the forward with one logit +3.8 ms, the full forward +0.7 ms, layer 0's
projections +0.8 ms, attention and rope nothing; preferring cuBLASLt changed nothing.
In process, a warm eager generate() does not pay for a fresh prompt length; the
server's case was answered by diag_server_fresh.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.diagnostics.diag_decode_shapes import load_model, sync  # noqa: E402


def timed(torch, fn) -> float:
    sync(torch)
    t0 = time.perf_counter()
    fn()
    sync(torch)
    return (time.perf_counter() - t0) * 1e3


def parts(torch, model):
    """name -> (length -> a callable that runs that part once at that length)."""
    import torch.nn.functional as F
    cfg = model.config
    dev, dt = model.device, model.dtype
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    kv_heads, head_dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or hidden // heads
    layer = model.model.layers[0]
    linears = [m for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]

    def ids(n):
        return torch.randint(100, 500, (1, n), device=dev)

    def generate(n):
        x = ids(n)
        return lambda: model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, temperature=0.7,
                                      top_p=0.9, max_new_tokens=1, min_new_tokens=1, pad_token_id=0)

    def keep1(n):
        x = ids(n)
        return lambda: model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True, logits_to_keep=1)

    def full(n):
        x = ids(n)
        return lambda: model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True)

    def linear(n):
        xs = [torch.randn(1, n, m.in_features, device=dev, dtype=dt) for m in linears]
        return lambda: [m(x) for m, x in zip(linears, xs, strict=True)]

    def sdpa(n):
        q = torch.randn(1, heads, n, head_dim, device=dev, dtype=dt)
        k = torch.randn(1, kv_heads, n, head_dim, device=dev, dtype=dt)
        v = torch.randn_like(k)
        rep = heads // kv_heads
        return lambda: F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                      is_causal=True)

    def rope(n):
        x = torch.randn(1, n, hidden, device=dev, dtype=dt)
        pos = torch.arange(n, device=dev)[None]
        return lambda: model.model.rotary_emb(x, pos)

    return {"generate": generate, "keep1": keep1, "full": full, "linear": linear, "sdpa": sdpa, "rope": rope}


def new_again(torch, make, n: int) -> tuple[float, float]:
    new = timed(torch, make(n))
    again = timed(torch, make(n))
    return new, again


def profile_grew(torch, make, n: int) -> list:
    """The ops whose CPU self time grew most from `again` to `new` at length n."""
    from torch.profiler import ProfilerActivity, profile

    def ops(fn):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            timed(torch, fn)
        return {e.key: e.self_cpu_time_total / 1e3 for e in p.key_averages()}
    new, again = ops(make(n)), ops(make(n))
    grew = sorted(((k, v - again.get(k, 0.0)) for k, v in new.items()), key=lambda kv: -kv[1])[:10]
    return [[k, round(v, 3)] for k, v in grew if v > 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/qwen2-1.5b-random")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke check on the embedded model")
    ap.add_argument("--lengths", type=int, default=3, help="fresh lengths per part")
    args = ap.parse_args()
    import torch
    model = load_model(args)
    info = {"torch": torch.__version__, "device": args.device,
            "attn_implementation": model.config._attn_implementation,
            **{k: os.environ.get(k) for k in ("TORCH_CUDNN_SDPA_DEPRIORITIZED", "CUDA_MODULE_LOADING")}}
    print(info, flush=True)
    table = parts(torch, model)
    results: dict = {}
    base = 181            # odd lengths from here, each used by one part only
    with torch.no_grad():
        for n in (16, 180, 230, 262, 310):          # the server bench's profile lengths, roughly
            for _ in range(2):
                timed(torch, table["generate"](n))
                timed(torch, table["full"](n))

        def run(label, name):
            nonlocal base
            rows = []
            for _ in range(args.lengths):
                base += 2
                new, again = new_again(torch, table[name], base)
                rows.append({"length": base, "new_ms": round(new, 3), "again_ms": round(again, 3)})
            extra = statistics.median(r["new_ms"] - r["again_ms"] for r in rows)
            results[label] = {"rows": rows, "median_extra_ms": round(extra, 3)}
            print(f"{label:18s} fresh-length extra {extra:7.2f} ms  "
                  + "  ".join(f"{r['length']}: {r['new_ms']:.1f}/{r['again_ms']:.1f}" for r in rows), flush=True)

        for name in table:
            run(name, name)
        if args.device == "cuda":
            before = str(torch.backends.cuda.preferred_blas_library())
            torch.backends.cuda.preferred_blas_library("cublaslt")
            info["blas_default"] = before
            for name in ("generate", "keep1", "linear"):
                run(f"{name}_cublaslt", name)
            torch.backends.cuda.preferred_blas_library("cublas")
        base += 2
        results["keep1_profile_cpu_grew_ms"] = profile_grew(torch, table["keep1"], base)
        print("keep1 ops whose CPU time grew at a fresh length:", results["keep1_profile_cpu_grew_ms"], flush=True)
    if args.out:
        from bench.provenance import provenance, write_result
        write_result(args.out, {"benchmark": "diag_fresh_length", "info": info, "parts": results, **provenance()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
