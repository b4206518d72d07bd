"""The in-process engine's start against a plain `from_pretrained` start (issue 25).

One command, on the H200:
    python bench/bench_inproc_start.py --out bench/results/gpu_inproc_start_h200.json

For each size (Qwen2-1.5B and Qwen2-7B shapes, random bf16 weights made locally:
bench_gpu_cold_start.make_fast_model writes the safetensors without initialising
a model), alternating, cold process starts of
  agent: `python -m warmup_agent run --model DIR` (torch engine, default config)
         as a user starts it, polled from outside every 20 ms until /readyz
         answers 200; then SIGTERM, and its run record is read: the stages and
         what they spent (imports, the wait for the transformers import, weights,
         warmup traffic, solidify, ready) and the first-request tax it exports;
  naive: a script written outside the project (a temporary file that imports
         nothing of it): import torch and transformers, AutoTokenizer,
         from_pretrained(...).cuda(), one request, then 20 steady requests; it
         reports its own import, load and first-request times (`from transformers
         import AutoModelForCausalLM` is lazy: the modelling import is inside its
         from_pretrained_seconds).
Figures (issue 25 names):
  ready_over_naive          median over the 1.5B pairs of agent spawn->/readyz 200 /
                            naive spawn->first response
  ready_over_naive_7b       the same over the 7B pairs
  first_request_tax_p99     p99 over the agent's 1.5B starts of its exported
                            first_request_tax_ratio (the pairs' starts plus --extra-starts)
  first_request_tax_p99_7b  the same over the 7B starts
  load_over_floor           7B: the agent's weight-load seconds / max(bytes / pinned H2D
                            bandwidth, bytes / page-cache read bandwidth); weights_gb_per_second
Per start the JSON keeps both sides' breakdowns, so the difference is read line by line.

CPU smoke run (no GPU; a tiny model, one pair):
    python bench/bench_inproc_start.py --device cpu --sizes tiny --pairs tiny=1 --out /tmp/smoke.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.bench_gpu_cold_start import PROMPT, PROMPT_TOKENS, QWEN2_1_5B, QWEN2_7B  # noqa: E402
from bench.provenance import provenance, write_result  # noqa: E402

TINY = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
SIZES = {"1.5b": QWEN2_1_5B, "7b": QWEN2_7B, "tiny": TINY}
SUFFIX = {"1.5b": "", "7b": "_7b", "tiny": "_tiny"}
STEADY = 20

# The naive start, written to a temporary file outside the project: it imports
# nothing of warmup_agent, as a user's own server script would not.
NAIVE = r'''
import json, statistics, sys, time
t_spawn = float(sys.argv[3])
t0 = time.time()
import torch
t_torch = time.time()
from transformers import AutoModelForCausalLM, AutoTokenizer
t_tf = time.time()
model_dir, device = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(model_dir)
t_tok = time.time()
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
t_loaded = time.time()
model = model.to(device).eval()
def sync():
    if device == "cuda":
        torch.cuda.synchronize()
sync()
t_on_device = time.time()
ids = torch.tensor([tok.encode(sys.argv[4], add_special_tokens=False)[:int(sys.argv[5])]]).to(device)
def ttft():
    sync()
    t = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True).logits[:, -1, :].argmax(dim=-1)
    sync()
    return time.perf_counter() - t
first = ttft()
t_first = time.time()
steady = [ttft() for _ in range(int(sys.argv[6]))]
print(json.dumps({"python_start_seconds": t0 - t_spawn, "import_torch_seconds": t_torch - t0,
                  "import_transformers_seconds": t_tf - t_torch, "tokenizer_seconds": t_tok - t_tf,
                  "from_pretrained_seconds": t_loaded - t_tok, "to_device_seconds": t_on_device - t_loaded,
                  "first_request_seconds": first, "first_response_unix": t_first,
                  "steady_median_seconds": statistics.median(steady), "steady_seconds": steady}))
'''


def http_status(url: str, timeout: float = 1.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_naive(args, model: str, naive_file: str) -> dict:
    t0 = time.time()
    r = subprocess.run([sys.executable, naive_file, model, args.device, repr(t0), PROMPT, str(PROMPT_TOKENS), str(STEADY)],
                       capture_output=True, text=True, timeout=args.start_timeout, cwd=tempfile.gettempdir(),
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})   # the agent's environment, less the project on its path
    if r.returncode != 0:
        raise RuntimeError(f"naive start failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["spawn_to_first_response_seconds"] = out.pop("first_response_unix") - t0
    out["first_request_tax"] = out["first_request_seconds"] / out["steady_median_seconds"]
    out.pop("steady_seconds")
    return out


def run_agent(args, model: str, label: str) -> dict:
    port = free_port()
    record = os.path.join(args.logs, f"{label}_record.json")
    log_path = os.path.join(args.logs, f"{label}.log")
    cmd = [sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--model", model, "--listen", f"127.0.0.1:{port}",
           "--data-dir", args.data_dir, "--record", record]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if args.device == "cpu":
        env["WARMUP_AGENT_MODEL_DEVICE"] = "cpu"
    env["WARMUP_AGENT_MODEL_IMPLEMENTATION"] = args.implementation
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out: dict = {"command": " ".join(cmd)}
    try:
        ready = None
        while time.time() - t0 < args.start_timeout and proc.poll() is None:
            if http_status(f"http://127.0.0.1:{port}/readyz") == 200:
                ready = time.time() - t0
                break
            time.sleep(0.02)
        out["spawn_to_ready_seconds"] = ready
        t_term = time.time()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        out["sigterm_exit_seconds"] = time.time() - t_term if proc.poll() is not None else None
        out["sigterm_exit_code"] = proc.poll()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if ready is None:
        raise RuntimeError(f"agent start {label} never answered /readyz 200:\n" + open(log_path).read()[-3000:])
    rec = json.load(open(record)) if os.path.exists(record) else {}
    stages = {s["name"]: s for s in rec.get("stages", [])}
    pre = stages.get("prewarm", {})
    load = pre.get("weight_load") or {}
    out.update(
        first_request_tax=rec.get("first_request_tax_ratio"),
        record_time_to_ready_seconds=rec.get("time_to_ready_seconds"),
        startup_seconds=rec.get("startup_seconds"),   # process start -> the pipeline (the CLI's imports, set-up)
        stage_seconds={k: v.get("duration_seconds") for k, v in stages.items()},
        prewarm_split=pre.get("seconds"),
        waited_for_skeleton_seconds=pre.get("waited_for_skeleton_seconds"),
        weight_load_seconds=load.get("seconds"), weight_load_bytes=load.get("bytes"),
        warmup_requests=pre.get("requests"), warmup=pre.get("warmup"), warmup_paths=pre.get("paths"),
        solidify={k: v for k, v in stages.get("solidify", {}).items() if k in ("duration_seconds", "method", "graphs", "shapes")},
        reserve_context_seconds=stages.get("reserve", {}).get("cuda_context_seconds"),
        # native (no transformers import) or transformers, and why not native (engine_facts.extra)
        engine_implementation=(rec.get("engine_facts") or {}).get("extra", {}).get("implementation"),
        engine_implementation_reason=(rec.get("engine_facts") or {}).get("extra", {}).get("implementation_reason"),
    )
    return out


def p99(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, -(-99 * len(xs) // 100) - 1))]   # inverted CDF


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.5b,7b", help="comma list of: " + ", ".join(SIZES))
    ap.add_argument("--pairs", default="1.5b=3,7b=2,tiny=1", help="pairs per size, SIZE=N,...")
    ap.add_argument("--extra-starts", default="1.5b=2", help="agent-only starts per size for the tax, SIZE=N,...")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--implementation", default="auto", choices=("auto", "native", "transformers"),
                    help="the agent's model.implementation (auto: native for these Qwen2 models)")
    ap.add_argument("--model-root", default="/tmp", help="models are made (once) under here")
    ap.add_argument("--data-dir", default="/tmp/warmup-inproc")
    ap.add_argument("--logs", default=None, help="agent logs and run records (default: beside --out)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_inproc_start.json"))
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--budget-seconds", type=float, default=0.0, help="stop starting new pairs after this (0: no limit)")
    args = ap.parse_args()
    t_begin = time.time()
    pairs = {k: int(v) for k, v in (kv.split("=") for kv in args.pairs.split(","))}
    extra = {k: int(v) for k, v in (kv.split("=") for kv in args.extra_starts.split(",") if kv)}
    args.logs = args.logs or os.path.join(os.path.dirname(os.path.abspath(args.out)), "inproc_logs")
    os.makedirs(args.logs, exist_ok=True)
    naive_dir = tempfile.mkdtemp(prefix="naive-start-")
    naive_file = os.path.join(naive_dir, "naive_start.py")
    with open(naive_file, "w") as f:
        f.write(NAIVE)
    result: dict = {**provenance(), "device": args.device, "implementation": args.implementation, "sizes": {}, "figures": {},
                    "targets": {"ready_over_naive": 1.0, "ready_over_naive_7b": 1.0, "first_request_tax_p99": 1.10,
                                "first_request_tax_p99_7b": 1.10, "weights_gb_per_second_7b": 7.0}}
    if args.device == "cuda":   # not through torch: this process holds no CUDA context beside the starts
        result["machine_gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                               capture_output=True, text=True).stdout.strip()
    models: dict[str, str] = {}
    for size in args.sizes.split(","):
        models[size] = make(args, size, result)
        if pairs.get(size, 0) and not run_pairs(args, size, models[size], pairs[size], naive_file, result, t_begin):
            break
    # The agent-only starts for the tax come after every size's pairs: a call cut short
    # still has the 7B pairs.
    out_of_time = False
    for size, model in models.items():
        entry = result["sizes"][size]
        for j in range(extra.get(size, 0)):
            if args.budget_seconds and time.time() - t_begin > args.budget_seconds:
                out_of_time = True
                break
            entry["extra_agent_starts"].append(run_agent(args, model, f"{size}_extra{j}"))
            print(f"{size} extra start {j}: tax {entry['extra_agent_starts'][-1]['first_request_tax']}", flush=True)
            figures(result)
            write_result(args.out, result)
    out_of_time = out_of_time or any(len(result["sizes"].get(k, {}).get("pairs", [])) < n
                                     for k, n in pairs.items() if k in args.sizes.split(","))
    result["partial"] = out_of_time
    figures(result)
    write_result(args.out, result)
    print(json.dumps(result["figures"], indent=2))
    return 0


def make(args, size: str, result: dict) -> str:
    """The model of this size (made once under --model-root) and, at 7B on a GPU, the floors."""
    shape = SIZES[size]
    model = os.path.join(args.model_root, f"qwen2-{size}-random-fast")
    t = time.time()
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                    "from bench.bench_gpu_cold_start import make_fast_model; import json; "
                    "make_fast_model(sys.argv[2], json.loads(sys.argv[3]), device=sys.argv[4])",
                    ROOT, model, json.dumps(shape), args.device], check=True, cwd=ROOT)
    entry: dict = {"model": {"shape": f"Qwen2-{size}" if size != "tiny" else "tiny Qwen2", **shape,
                             "dtype": "bfloat16", "weights": "random"},
                   "model_made_seconds": time.time() - t, "pairs": [], "extra_agent_starts": []}
    result["sizes"][size] = entry
    print(f"{size}: model ready in {entry['model_made_seconds']:.1f} s", flush=True)
    if size == "7b" and args.device == "cuda":
        entry["floors"] = json.loads(subprocess.run(
            [sys.executable, "-c", "import sys, json; sys.path.insert(0, sys.argv[1]); "
             "from bench.bench_gpu_cold_start import child_floors; print(json.dumps(child_floors(sys.argv[2])))",
             ROOT, model], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip().splitlines()[-1])
        print(f"{size}: floors {entry['floors']}", flush=True)
    return model


def run_pairs(args, size: str, model: str, n: int, naive_file: str, result: dict, t_begin: float) -> bool:
    """n alternating pairs; False when the budget stopped them."""
    entry = result["sizes"][size]
    for i in range(n):
        if args.budget_seconds and time.time() - t_begin > args.budget_seconds:
            return False
        pair: dict = {}
        for side in (("naive", "agent") if i % 2 == 0 else ("agent", "naive")):   # alternate who goes first
            pair[side] = run_naive(args, model, naive_file) if side == "naive" else run_agent(args, model, f"{size}_pair{i}")
        pair["ready_over_naive"] = pair["agent"]["spawn_to_ready_seconds"] / pair["naive"]["spawn_to_first_response_seconds"]
        entry["pairs"].append(pair)
        a, nv = pair["agent"], pair["naive"]
        print(f"{size} pair {i}: agent ready {a['spawn_to_ready_seconds']:.2f} s (tax {a['first_request_tax']}), "
              f"naive first response {nv['spawn_to_first_response_seconds']:.2f} s (tax {nv['first_request_tax']:.1f}), "
              f"ratio {pair['ready_over_naive']:.3f}", flush=True)
        print(f"  agent ({a['engine_implementation']}): startup {a['startup_seconds']}, stages {a['stage_seconds']}, prewarm {a['prewarm_split']}, "
              f"waited for the skeleton (its imports) {a['waited_for_skeleton_seconds']}, warmup {a['warmup']}", flush=True)
        print("  naive: " + ", ".join(f"{k} {v:.3f}" for k, v in nv.items() if isinstance(v, float)), flush=True)
        figures(result)
        write_result(args.out, result)
    return True


def figures(result: dict) -> None:
    figs: dict = {}
    for size, entry in result["sizes"].items():
        sfx = SUFFIX[size]
        pairs = entry["pairs"]
        starts = [p["agent"] for p in pairs] + entry["extra_agent_starts"]
        if pairs:
            figs[f"ready_over_naive{sfx}"] = statistics.median(p["ready_over_naive"] for p in pairs)
            figs[f"naive_first_request_tax_median{sfx}"] = statistics.median(p["naive"]["first_request_tax"] for p in pairs)
        taxes = [s["first_request_tax"] for s in starts if s.get("first_request_tax") is not None]
        figs[f"first_request_tax_p99{sfx}"] = p99(taxes)
        figs[f"first_request_tax_starts{sfx}"] = len(taxes)
        floors = entry.get("floors")
        loads = [(s["weight_load_seconds"], s["weight_load_bytes"]) for s in starts if s.get("weight_load_seconds")]
        if loads:
            figs[f"weights_gb_per_second{sfx}"] = statistics.median(b / sec / 1e9 for sec, b in loads)
        if floors and loads:
            b = floors["checkpoint_bytes"]
            floor = max(b / floors["h2d_pinned_bytes_per_second"], b / floors["read_bytes_per_second"])
            figs[f"load_over_floor{sfx}"] = statistics.median(sec / floor for sec, _ in loads)
    result["figures"] = figs


if __name__ == "__main__":
    raise SystemExit(main())
