"""Load on the exporter while a warmup runs: 200 requests/s of /metrics and
/readyz for 60 s against the real agent (CLI, embedded model, 127.0.0.1).

Warmups keep running for the whole test: every time the agent reaches SERVING
the benchmark asks for a re-warm (POST /admin/rewarm), so the load meets the
agent while it loads weights, sends warmup traffic and probes.

Writes bench/results/load_<date>.json with load_p99_ms (target <= 50 ms) and
load_errors (target 0).

    .venv/bin/python bench/bench_load.py [--rate 200] [--seconds 60]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import loadgen  # noqa: E402
from bench.provenance import provenance, write_result  # noqa: E402
from warmup_agent.readiness.window import nearest_rank  # noqa: E402


def pct(values: list[float], q: float) -> float:
    return nearest_rank(sorted(values), q)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=200.0, help="requests per second offered")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--data-dir", help="where the embedded model lives (default: the agent's)")
    p.add_argument("--out")
    args = p.parse_args()
    from tests.helpers.servers import free_port
    work = tempfile.mkdtemp(prefix="bench-load-")
    port = free_port()
    agent = loadgen.start_agent(port, work, {"WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "1"}, args.data_dir)
    try:
        # Load starts as soon as the endpoint answers: the first warmup is under load too.
        loadgen.wait_for(port, lambda s: s != "DOWN", 120, agent)
        rewarmer = loadgen.Rewarmer(port)
        rewarmer.start()
        results, elapsed = loadgen.run_load(port, args.rate, args.seconds)
        rewarmer.stop_event.set()
        rewarmer.join()
    finally:
        rc = loadgen.stop_agent(agent)
    lat = [r[1] for r in results]
    errors = [r for r in results if r[2]]
    by_path = collections.defaultdict(list)
    for path, latency, _ in results:
        by_path[path].append(latency)
    ms = lambda s: round(s * 1000, 3)  # noqa: E731
    result = {
        "benchmark": "load",
        "load_p99_ms": ms(pct(lat, 0.99)),
        "load_p50_ms": ms(pct(lat, 0.50)),
        "load_max_ms": ms(max(lat)),
        "load_errors": len(errors),
        "target_p99_ms": 50.0,
        "meets_target": pct(lat, 0.99) * 1000 <= 50.0 and not errors,
        "per_path_p99_ms": {k: ms(pct(v, 0.99)) for k, v in sorted(by_path.items())},
        "requests": len(results),
        "offered_rate_per_second": args.rate,
        "achieved_rate_per_second": round(len(results) / elapsed, 1),
        "seconds": args.seconds,
        "rewarms_during_load": rewarmer.rewarms,
        "agent_exit_code": rc,
        "error_samples": [e[2] for e in errors[:5]],
        "definition": "latency from send to last byte, new connection per request, open-loop schedule; error = "
                      "connection failure, timeout, or /metrics != 200, /readyz not in (200, 503)",
        **provenance(),
    }
    out = args.out or os.path.join(loadgen.ROOT, "bench", "results", f"load_{datetime.date.today().isoformat()}.json")
    write_result(out, result)
    print(json.dumps({k: result[k] for k in ("load_p99_ms", "load_errors", "requests", "rewarms_during_load")}))
    print(f"wrote {out}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
