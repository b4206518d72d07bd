"""Why is a server's first whole answer slow after warmup?  A diagnosis on the GPU (issue 19).

    python -m bench.diagnostics.diag_decode_shapes [--model DIR] [--out FILE]

`transformers serve` runs `model.generate()` eagerly.  On the H200 its first
answer to a 64-token chat request took 3.3x the steady whole-answer time even
after the agent's warmup, while time to first token was nearly steady.  The
hypothesis tested here: some kernel choice is cached per sequence length (the
KV length grows by one every decode step), so a decode step at a KV length no
earlier request reached pays a one-off cost.  If so, only warmup that decodes
through every KV length the traffic reaches removes the tax.

Each case runs `generate()` in process (sampled, temperature 0.7, top_p 0.9,
exactly N new tokens) and times every decode step with a streamer:
  warm      two 16-token-prompt answers (KV lengths 16..80)
  new83     prompt 83 (KV 83..147: partly new)
  again83   the same length again (every KV length seen)
  inside    prompt 90, 8 tokens (KV 90..98: seen during new83)
  new200    prompt 200 (all new KV lengths)
  new300_nocudnn / again300_nocudnn / new400_nocudnn: with cuDNN attention off
  tile600/664/728, covered650, again650: decode coverage as the agent warms it
    (prompts one answer apart), then a new prompt length inside the covered range
Printed and written as JSON: per case the prefill seconds, the median and
total decode-step seconds and the steps slower than 2x the warm median.

Answered (H200, bench/results/diag_decode_shapes_h200.json, _run2.json,
_cudnn_deprioritized.json): yes.  With torch 2.11's cuDNN attention every decode step at a
KV length no earlier request had reached paid 40-68 ms more: new83's step median read
79-93 ms against again83's 25-28 ms, new200 66-93 ms against 30-43 ms.  A new prompt
length inside KV lengths an earlier answer had decoded through came warm (covered650
23 ms a step, again650 23 ms).  With cuDNN attention off (the *_nocudnn cases) or
TORCH_CUDNN_SDPA_DEPRIORITIZED=1 (new83 27 ms, again83 27 ms) no step paid for its
length.  What followed: prewarm.decode_coverage (traffic.decode_tiles: warmup decodes at
every sequence length the traffic reaches), and the switch as the server owner's remedy.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


class StepTimer:
    """A generate() streamer: the first put() is the prompt, each later one a new token."""

    def __init__(self, torch):
        self.torch, self.times = torch, []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        self.times.append(time.perf_counter())


def sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_case(torch, model, length: int, new_tokens: int) -> dict:
    ids = torch.randint(100, 500, (1, length), device=model.device)
    timer = StepTimer(torch)
    sync(torch)
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.7, top_p=0.9,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=timer, pad_token_id=2)
    sync(torch)
    end = time.perf_counter()
    # times[0]: prompt put (before prefill); times[1]: first token; then one per step; last: end
    stamps = timer.times
    steps = [b - a for a, b in zip(stamps[1:-1], stamps[2:-1], strict=False)]
    return {"prompt": length, "new_tokens": new_tokens, "prefill_seconds": stamps[1] - t0 if len(stamps) > 1 else None,
            "total_seconds": end - t0, "step_median": statistics.median(steps) if steps else None,
            "step_sum": sum(steps), "steps": steps}


def load_model(args):
    """The bf16 1.5B-shaped bench model on args.device (made if missing); on the CPU the
    embedded model instead (args.model is set to it)."""
    import torch
    from transformers import AutoModelForCausalLM
    if args.device == "cpu":
        from warmup_agent.model.embedded import ensure_embedded_model
        args.model = ensure_embedded_model("/tmp/diag-embedded")
    else:
        from bench.bench_gpu_cold_start import make_model
        make_model(args.model)
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/qwen2-1.5b-random")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke check on the embedded model")
    args = ap.parse_args()
    import torch
    model = load_model(args)
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "attn_implementation": model.config._attn_implementation,
            "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(), "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            # a user-side switch found in libtorch_cuda.so (issue 19's note); recorded, since it may change the backend order
            "TORCH_CUDNN_SDPA_DEPRIORITIZED": os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED")}
    print(info, flush=True)
    cases = [("warm1", 16, 64), ("warm2", 16, 64), ("new83", 83, 64), ("again83", 83, 64), ("inside", 90, 8),
             ("new200", 200, 64), ("again200", 200, 64)]
    results = {}

    def go(name, length, n):
        r = run_case(torch, model, length, n)
        results[name] = r
        warm = results.get("warm2", r)["step_median"] or 1
        slow = [i for i, s in enumerate(r["steps"]) if s > 2 * warm]
        r["slow_steps"] = slow
        print(f"{name:18s} prompt {length:4d} new {n:3d}: prefill {r['prefill_seconds'] * 1e3:7.1f} ms, "
              f"step median {r['step_median'] * 1e3:6.1f} ms, decode sum {r['step_sum']:6.3f} s, "
              f"total {r['total_seconds']:6.3f} s, steps > 2x warm median: {len(slow)}", flush=True)

    with torch.no_grad():
        for c in cases:
            go(*c)
        torch.backends.cuda.enable_cudnn_sdp(False)
        for c in [("new300_nocudnn", 300, 64), ("again300_nocudnn", 300, 64), ("new400_nocudnn", 400, 64)]:
            go(*c)
        # Decode coverage as the agent does it (traffic.decode_tiles): answers from
        # prompts one answer apart, then a prompt length never sent whose decode
        # lengths the tiles reached.  covered650 against again650 is what remains.
        torch.backends.cuda.enable_cudnn_sdp(True)
        for c in [("tile600", 600, 64), ("tile664", 664, 64), ("tile728", 728, 64), ("covered650", 650, 64),
                  ("again650", 650, 64)]:
            go(*c)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        for c in [("new500_cudnn_only", 500, 64), ("again500_cudnn_only", 500, 64)]:
            go(*c)
    out = {"benchmark": "diag_decode_shapes", "info": info,
           "cases": {k: {kk: vv for kk, vv in v.items() if kk != "steps"} | {"steps_ms": [round(s * 1e3, 2) for s in v["steps"]]}
                     for k, v in results.items()},
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": os.environ.get("BENCH_COMMIT", "unknown")}
    if args.out:
        from bench.provenance import write_result
        write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
