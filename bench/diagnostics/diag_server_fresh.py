"""Does a warm `transformers serve` pay for a prompt length it has not seen, and is it the
length, the change of length, or an idle pause?  A diagnosis for the GPU (issue 30).

    python -m bench.diagnostics.diag_server_fresh [--out FILE] [--device cuda|cpu] [--server-env K=V ...]

In process, a model warmed over 16-310 tokens pays nothing at a fresh length in generate()
(diag_fresh_length.py on the H200: -2 ms), yet the server bench's first requests read
1.1-1.6x steady to first token, and the agent's first probe at a fresh length ran 12-20 ms
slower than the next two in some starts. Here one server is started and warmed at the
bench's profile lengths, then for each of PAIRS fresh lengths L, back to back:
  new        L, never sent before
  again      L once more (fresh text)
  same_text  L with again's very messages
  switch     a warmed length other than L (a length change, not a fresh length)
and IDLE times: a warmed length after a pause, then right after it. Client-side TTFT
(streamed chat, sampled, 4 tokens). Beside it, in a process of its own, a fixed pure-Python
workload is timed every 20 ms (HOST_PROBE): if the server's slow requests fall where that
workload also ran slow, the host changed speed, not the server. Writes JSON with every
request, the host workload's times around it, and the medians.

Answered (H200, bench/results/diag_server_fresh_h200_switch_run1.json, _run2.json
and _default_run1/_run2.json): with TORCH_CUDNN_SDPA_DEPRIORITIZED=1 a fresh length cost
+0.6 and +1.1 ms over the same length again (median), a change of length +0.5 and
0.0 ms, a 0.3 s pause +1.4 and +0.5 ms: nothing left to warm.  With the defaults a
fresh length cost +67 and +63 ms (cuDNN's plan per length).  What varies with the switch
is the server's level: the same length and messages read 27-35 ms in one stretch of
requests and 45-55 ms in the next, and the host workload beside it varied 0.87-1.68 ms
over the same minutes (1.21 ms beside the server's slower half, 0.93 ms beside its
faster half).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import bench_gpu_server as bgs  # noqa: E402

WARM_LENGTHS = bgs.PROFILE_LENGTHS          # the server bench's profile lengths
# A fixed CPU workload, timed over and over: "<end unix time> <seconds>" per line.
HOST_PROBE = ("import sys, time\nout = open(sys.argv[1], 'w', buffering=1)\nwhile True:\n"
              "    t = time.perf_counter()\n    sum(i * i for i in range(20000))\n"
              "    out.write(f'{time.time()} {time.perf_counter() - t}\\n')\n    time.sleep(0.02)\n")


def host_times(path: str) -> list[tuple[float, float]]:
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:
                rows.append((float(parts[0]), float(parts[1])))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--idle", type=int, default=6)
    ap.add_argument("--pause", type=float, default=0.3, help="seconds of the idle pause")
    ap.add_argument("--server-env", action="append", default=[], metavar="K=V")
    args = ap.parse_args()
    args.server, args.server_env = "transformers", dict(kv.split("=", 1) for kv in args.server_env)
    bgs.ARGS = args
    scratch = tempfile.mkdtemp(prefix="diag-server-fresh-")
    model_dir = bgs.make_model("/tmp/qwen2-1.5b-random-chat" if args.device != "cpu" else os.path.join(scratch, "data"),
                               args.device, qwen_chat=True)
    port = bgs.free_port()
    log = open(os.path.join(scratch, "server.log"), "w")
    proc = subprocess.Popen(bgs.server_cmd(args, model_dir, port), env=bgs.env_for(scratch, args.server_env),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=scratch)
    host_log = os.path.join(scratch, "host.txt")
    host = subprocess.Popen([sys.executable, "-c", HOST_PROBE, host_log])
    variant = iter(range(10_000))
    sent: list[dict] = []

    def ask(kind: str, length: int, messages=None) -> tuple[float, list]:
        msgs, n = bgs.chat_messages(model_dir, length, next(variant)) if messages is None else (messages, length)
        t0 = time.time()
        r = bgs.request(port, model_dir, msgs, 4)
        sent.append({"kind": kind, "length": n, "ttft_ms": round(r["ttft"] * 1e3, 2), "t0": t0, "t1": time.time()})
        return r["ttft"] * 1e3, msgs

    try:
        bgs.wait_http(f"http://127.0.0.1:{port}/health", time.time() + 300, proc)
        for n in WARM_LENGTHS:
            for _ in range(3):
                ask("warm", n)
        used = set(WARM_LENGTHS)
        fresh = [n for n in range(183, 320, 4) if n not in used][:args.pairs]
        rows = []
        for i, n in enumerate(fresh):
            new, _ = ask("new", n)
            again, msgs = ask("again", n)
            same, _ = ask("same_text", n, msgs)
            switch, _ = ask("switch", WARM_LENGTHS[i % len(WARM_LENGTHS)])
            rows.append({"length": n, "new": new, "again": again, "same_text": same, "switch": switch})
            print(f"L {n}: new {new:.1f}  again {again:.1f}  same text {same:.1f}  switch {switch:.1f} ms", flush=True)
        idle = []
        for _ in range(args.idle):
            time.sleep(args.pause)
            after, _ = ask("after_idle", 230)
            b2b, _ = ask("back_to_back", 230)
            idle.append({"after_idle": after, "back_to_back": b2b})
            print(f"idle {args.pause} s: {after:.1f}  then {b2b:.1f} ms", flush=True)
    finally:
        bgs.stop(proc)
        host.kill()
        log.close()
    # the host workload's median time within 0.5 s of each request
    probe = host_times(host_log)
    for r in sent:
        near = [d for t, d in probe if r["t0"] - 0.5 <= t <= r["t1"] + 0.5]
        r["host_ms"] = round(statistics.median(near) * 1e3, 3) if near else None
        r.pop("t0"), r.pop("t1")
    timed = [r for r in sent if r["host_ms"] is not None and r["kind"] != "warm"]
    cut = statistics.median(r["ttft_ms"] for r in timed) if timed else 0
    slow = [r["host_ms"] for r in timed if r["ttft_ms"] > cut]
    fast = [r["host_ms"] for r in timed if r["ttft_ms"] <= cut]

    def med(key, src):
        return round(statistics.median(r[key] for r in src), 2)
    summary = {k: med(k, rows) for k in ("new", "again", "same_text", "switch")}
    summary["new_minus_again_ms_median"] = round(statistics.median(r["new"] - r["again"] for r in rows), 2)
    summary["switch_minus_again_ms_median"] = round(statistics.median(r["switch"] - r["again"] for r in rows), 2)
    summary.update({k: med(k, idle) for k in ("after_idle", "back_to_back")})
    summary["idle_minus_b2b_ms_median"] = round(statistics.median(r["after_idle"] - r["back_to_back"] for r in idle), 2)
    if slow and fast:
        # the host workload's time beside the server's slower half of requests, over its faster half
        summary["host_ms_slow_half"] = round(statistics.median(slow), 3)
        summary["host_ms_fast_half"] = round(statistics.median(fast), 3)
    print(summary, flush=True)
    if args.out:
        from bench.provenance import provenance, write_result
        write_result(args.out, {"benchmark": "diag_server_fresh", "server": "transformers serve",
                                "server_env": args.server_env, "pause_seconds": args.pause, "medians_ms": summary,
                                "pairs": rows, "idle": idle, "requests": sent, **provenance()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
