"""Benchmark: cold compile vs a new pod restored from the shared kernel cache.

One run, side by side, each in a fresh process (as a new pod would be):
  cold  empty local tier, empty Redis: torch.compile compiles everything, then publishes;
  warm  a new, empty local tier restored from Redis first, then the same torch.compile.
warm_over_cold_compile = (warm restore + warm compile) / cold compile, where "compile" is the
first call of the compiled model (compilation happens there).  Lower is better.

    .venv/bin/python bench/bench_kernel_cache.py                       # CPU, small Llama
    python bench/bench_kernel_cache.py --device cuda --model qwen2-1.5b   # the H200 figure

Without --redis-url a redis-server (Debian package) is started on 127.0.0.1.  Results go to
bench/results/kernel_cache_<device>.json (or --out).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # a script, not a package: make warmup_agent and tests importable
from bench.provenance import commit, write_result  # noqa: E402

# Model shapes: "llama-small" compiles in tens of seconds on a CPU; "qwen2-1.5b" is the
# Qwen2-1.5B shape of the GPU figures in TESTING.md; "mlp" is for the CI test.
SHAPES = {
    "llama-small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=2048),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936),
}


def build_model(name: str, device: str):
    import torch
    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
        return model.to(device).eval(), torch.randn(4, 64, device=device)
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(max_position_embeddings=512, **SHAPES[name])
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


def child(args) -> dict:
    """One pod: restore (warm only), compile, publish (cold only).  Prints a JSON line."""
    from warmup_agent.kernel_cache import KernelCache, Settings
    from warmup_agent.kernel_cache import namespace as nsmod

    t0 = time.perf_counter()
    import torch
    from torch._dynamo.utils import counters
    with open(args.secret_file, "rb") as f:
        secret = f.read()
    settings = Settings(root=args.root, max_local_bytes=50 << 30, redis_url=args.redis_url, secret=secret,
                        socket_timeout=30.0)
    cache = KernelCache(settings, nsmod.components({"shape": args.model}, {"mode": "default"}), None)
    os.environ.update(cache.env())       # before anything compiles
    model, inputs = build_model(args.model, args.device)
    imported = time.perf_counter() - t0

    restore_s = 0.0
    if args.child == "warm":
        t = time.perf_counter()
        cache.restore()
        restore_s = time.perf_counter() - t
    compiled = torch.compile(model)
    t = time.perf_counter()
    with torch.no_grad():
        out = compiled(inputs)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t
    logits = out if isinstance(out, torch.Tensor) else out.logits
    publish_s, published = 0.0, 0
    if args.child == "cold":
        t = time.perf_counter()
        published = cache.publish()
        publish_s = time.perf_counter() - t
    return {"role": args.child, "import_and_load_s": imported, "restore_s": restore_s, "compile_s": compile_s,
            "publish_s": publish_s, "published_entries": published,
            "local_bytes": cache.local.total_bytes(), "cache_requests": {k: v for k, v in cache.counts.items() if "/" in k},
            "inductor_counters": {k: dict(counters[k]) for k in ("inductor", "aot_autograd") if k in counters},
            "output_sha256": hashlib.sha256(logits.float().cpu().numpy().tobytes()).hexdigest()}


def run_child(role: str, args, root: str, secret_file: str, redis_url: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT")}
    env["TMPDIR"] = root  # Inductor's default temp locations stay inside this pod's scratch
    cmd = [sys.executable, os.path.abspath(__file__), "--child", role, "--root", root, "--secret-file", secret_file,
           "--redis-url", redis_url, "--model", args.model, "--device", args.device]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"{role} run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])




def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-small", choices=("mlp", *SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--redis-url", default=None, help="use this Redis (flushed of the bench namespace only by key)")
    p.add_argument("--out", default=None, help="result file (default bench/results/kernel_cache_<device>.json)")
    p.add_argument("--child", choices=("cold", "warm"), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--secret-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-kc-") as scratch:
        server = None
        redis_url = args.redis_url
        if redis_url is None:
            from tests.helpers.servers import Redis
            os.makedirs(os.path.join(scratch, "redis"))
            server = Redis(os.path.join(scratch, "redis"))
            redis_url = server.url
        secret_file = os.path.join(scratch, "hmac")
        with open(secret_file, "wb") as f:
            f.write(os.urandom(32).hex().encode())
        try:
            cold = run_child("cold", args, os.path.join(scratch, "pod-cold"), secret_file, redis_url)
            warm = run_child("warm", args, os.path.join(scratch, "pod-warm"), secret_file, redis_url)
        finally:
            if server:
                server.stop()

    ratio = (warm["restore_s"] + warm["compile_s"]) / cold["compile_s"]
    result = {
        "benchmark": "kernel_cache", "warm_over_cold_compile": round(ratio, 4),
        "cold_compile_s": round(cold["compile_s"], 3), "warm_restore_s": round(warm["restore_s"], 3),
        "warm_compile_s": round(warm["compile_s"], 3),
        "same_output": cold["output_sha256"] == warm["output_sha256"],
        "model": args.model, "device": _device_name(args.device), "machine": platform.node(),
        "python": platform.python_version(), "torch": __import__("importlib.metadata").metadata.version("torch"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
        "runs": {"cold": cold, "warm": warm},
    }
    out = args.out or os.path.join(ROOT, "bench", "results",
                                   f"kernel_cache_{'cuda' if args.device.startswith('cuda') else 'cpu'}.json")
    write_result(out, result)
    print(f"warm_over_cold_compile={ratio:.3f}  cold compile {cold['compile_s']:.1f} s, "
          f"new pod: restore {warm['restore_s']:.2f} s + compile {warm['compile_s']:.1f} s  -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
