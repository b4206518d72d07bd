"""Soak: the real agent (CLI, embedded model) kept SERVING for 10 minutes with
probes every second -- its own readiness probes (readiness.watch_interval_seconds
= 1) and a kubelet-like client hitting /healthz, /readyz, /startupz and /metrics
once a second -- while its resident memory is sampled.

soak_rss_growth_ratio = (median RSS of the last minute - median RSS of the first
minute after SERVING) / median RSS of the first minute (target <= 0.05).
Writes bench/results/soak_<date>.json.

    .venv/bin/python bench/bench_soak.py [--seconds 600]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import loadgen  # noqa: E402
from bench.provenance import provenance, write_result  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600.0, help="soak length after SERVING")
    p.add_argument("--data-dir")
    p.add_argument("--out")
    args = p.parse_args()
    from tests.helpers.servers import free_port
    work = tempfile.mkdtemp(prefix="bench-soak-")
    port = free_port()
    agent = loadgen.start_agent(port, work, {"WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "1"}, args.data_dir)
    proc = psutil.Process(agent.pid)
    samples: list[tuple[float, int]] = []
    errors, probes = [], 0
    try:
        loadgen.wait_for(port, "SERVING", 300, agent)
        start = time.monotonic()
        tick = start
        while tick - start < args.seconds:
            for path in ("/healthz", "/readyz", "/startupz", "/metrics"):
                try:
                    status, _ = loadgen.request(port, "GET", path)
                    if status != 200:
                        errors.append(f"{path}: {status}")
                except OSError as e:
                    errors.append(f"{path}: {e}")
                probes += 1
            samples.append((tick - start, proc.memory_info().rss))
            tick += 1.0
            time.sleep(max(0.0, tick - time.monotonic()))   # one round per second
        _, metrics = loadgen.request(port, "GET", "/metrics")
    finally:
        rc = loadgen.stop_agent(agent)
    first = statistics.median(r for t, r in samples if t < 60)
    last = statistics.median(r for t, r in samples if t >= samples[-1][0] - 60)
    agent_probes = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.decode().splitlines()
                       if line.startswith('warmup_requests_total{kind="probe"}'))
    result = {
        "benchmark": "soak",
        "soak_rss_growth_ratio": round((last - first) / first, 5),
        "target_ratio": 0.05,
        "meets_target": (last - first) / first <= 0.05 and not errors,
        "rss_first_minute_median_bytes": int(first),
        "rss_last_minute_median_bytes": int(last),
        "rss_max_bytes": max(r for _, r in samples),
        "seconds": args.seconds,
        "http_probes": probes,
        "http_errors": len(errors),
        "error_samples": errors[:5],
        "agent_probes": agent_probes,
        "agent_exit_code": rc,
        "rss_per_minute_bytes": [int(statistics.median(r for t, r in samples if m * 60 <= t < (m + 1) * 60))
                                 for m in range(int(samples[-1][0] // 60) + 1)],
        **provenance(),
    }
    out = args.out or os.path.join(loadgen.ROOT, "bench", "results", f"soak_{datetime.date.today().isoformat()}.json")
    write_result(out, result)
    print(json.dumps({k: result[k] for k in ("soak_rss_growth_ratio", "http_errors", "agent_probes")}))
    print(f"wrote {out}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
