"""Where reserve's seconds go, and what the allocator looks like on a warmed GPU pod (issue 13).

    python -m bench.diagnostics.gpu_allocator_probe --runs 2 --out-dir "$OUT"

Creates the Qwen2-1.5B-shaped random model of bench_gpu_cold_start.py, then in
fresh processes (so `import torch` lands where it does under the CLI) runs the
agent's four stages with the default configuration up to SERVING, and writes:
  allocator_probe.json      reserve's steps per run, the allocator's memory_stats,
                            and the fragmentation figures (old and new) on the
                            warmed pod and after fragmentation made on purpose;
  snapshot_h200_warm.json   the warmed pod's torch.cuda.memory_snapshot(),
                            trimmed to segments and blocks (no stack frames):
                            recorded test data for tests/test_gpu_cpu_paths.py.

Answered (H200, bench/results/gpu_allocator_probe_h200.json, 2 runs): reserve took
3.4-4.2 s, of which torch_import 3.0-3.7 s, cuda_init 0.18 s, cuda_context 0.15-0.17 s,
host_facts (NVML) 0.09-0.11 s and memory_reserve 0.004 s: the import, not the GPU.  On
the warmed pod the old fragmentation figure read 0.59 against 0.015 for the new one
(the allocator's inactive split bytes over reserved); after fragmentation made on
purpose, 0.95 against 0.09.  The trimmed snapshot is test data of
tests/test_gpu_cpu_paths.py.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

STATS = ("reserved_bytes.all.current", "allocated_bytes.all.current", "active_bytes.all.current",
         "inactive_split_bytes.all.current", "inactive_split.all.current", "segment.all.current",
         "num_alloc_retries", "num_device_alloc", "num_device_free", "oversize_segments.all.current")


def trim(snapshot: list[dict]) -> list[dict]:
    keep_seg = ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                "stream", "segment_type", "segment_pool_id", "is_expandable")
    out = []
    for seg in snapshot:
        s = {k: seg[k] for k in keep_seg if k in seg}
        if isinstance(s.get("segment_pool_id"), tuple):
            s["segment_pool_id"] = list(s["segment_pool_id"])
        s["blocks"] = [{k: b[k] for k in ("address", "size", "requested_size", "state") if k in b}
                       for b in seg.get("blocks", [])]
        out.append(s)
    return out


def figures(torch) -> dict:
    from warmup_agent.gpu.memory import fragmentation_from_snapshot, old_fragmentation_from_snapshot
    dev = torch.cuda.current_device()
    snap = torch.cuda.memory_snapshot()
    stats = torch.cuda.memory_stats(dev)
    return {"stats": {k: stats.get(k) for k in STATS},
            "old_rate": old_fragmentation_from_snapshot(snap).get(dev),
            "new_rate": fragmentation_from_snapshot(snap).get(dev),
            "allocator_inactive_split_over_reserved": (stats["inactive_split_bytes.all.current"]
                                                       / stats["reserved_bytes.all.current"]),
            "tail_excluded_rate": tail_excluded(snap, dev),
            "segments": len([s for s in snap if s["device"] == dev]),
            "private_pool_segments": len([s for s in snap if s["device"] == dev and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)])}


def tail_excluded(snap, dev) -> float:
    """A candidate definition, for comparison: per segment holding a live block,
    its free bytes minus its largest free block, over reserved bytes."""
    stranded = reserved = 0
    for seg in snap:
        if seg["device"] != dev:
            continue
        reserved += seg["total_size"]
        free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        if free and any(b["state"] != "inactive" for b in seg["blocks"]):
            stranded += sum(free) - max(free)
    return stranded / reserved if reserved else 0.0


def child(model_dir: str, data_dir: str, out_dir: str, record: bool) -> dict:
    t_spawned = time.time()
    from exporter.metrics import AgentMetrics
    from warmup_agent import config
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.pipeline import Agent
    torch_before = "torch" in sys.modules
    cfg = config.load(env={"WARMUP_AGENT_MODEL_PATH": model_dir, "WARMUP_AGENT_DATA_DIR": data_dir,
                           "WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "0"})
    engine = TorchEngine(model_dir, dtype=cfg["model.dtype"], device=cfg["model.device"])
    agent = Agent(cfg, engine, metrics=AgentMetrics())
    state = agent.run()
    import torch
    rec = agent.record()
    stages = {s["name"]: s for s in rec["stages"]}
    out = {"state": state.name, "failure": agent.sm.failure_message, "torch_imported_before_run": torch_before,
           "imports_before_run_seconds": time.time() - t_spawned - rec["time_to_ready_seconds"] if rec["time_to_ready_seconds"] else None,
           "stage_seconds": {k: v["duration_seconds"] for k, v in stages.items()},
           "reserve": {k: v for k, v in stages["reserve"].items() if k not in ("pinned_cpus",)},
           "warm": figures(torch)}
    if record:
        with open(os.path.join(out_dir, "snapshot_h200_warm.json"), "w") as f:
            json.dump(trim(torch.cuda.memory_snapshot()), f)
    # Fragmentation on purpose: 64 x 8 MiB, then every other one freed.  The
    # holes sit between live blocks of one segment: stranded for requests > 8 MiB.
    keep = [torch.empty(8 << 20, dtype=torch.uint8, device="cuda") for _ in range(64)]
    del keep[::2]
    out["made_fragmented"] = figures(torch)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--model", default="/tmp/qwen2-1.5b-random")
    ap.add_argument("--data-dir", default="/tmp/warmup-probe")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.data_dir, args.out_dir, args.record)))
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r); import bench.bench_gpu_cold_start as b; b.make_model(%r)"
                    % (ROOT, args.model)], check=True, cwd=ROOT)
    runs = []
    for i in range(args.runs):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--data-dir", args.data_dir,
               "--out-dir", args.out_dir] + (["--record"] if i == 0 else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
        if r.returncode != 0:
            print(r.stderr[-4000:], file=sys.stderr)
            return 1
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps({"run": i, "reserve_steps": runs[-1]["reserve"].get("steps_seconds"),
                          "reserve_seconds": runs[-1]["stage_seconds"]["reserve"],
                          "warm": runs[-1]["warm"], "made": runs[-1]["made_fragmented"]}))
    with open(os.path.join(args.out_dir, "allocator_probe.json"), "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
