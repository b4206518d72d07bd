"""Quantile error of the readiness window against exact quantiles, and its cost.

For each distribution (uniform, lognormal, bimodal, and time-to-first-token
samples recorded from a real run of the embedded model) and window size, a
stream of samples goes through `SlidingWindow`; at regular points its P50/P90/
P99 are compared with numpy's exact quantile of the same last-N samples
(method "inverted_cdf", the nearest-rank definition the window states).  The
window is exact by construction, so the stated bound is 0 relative error; the
table shows the measured maximum and the cost of an update and of a read.

    .venv/bin/python -m bench.bench_quantiles   ->  bench/results/quantiles_cpu.json
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.provenance import provenance, write_result  # noqa: E402


def recorded_probes(n: int) -> list[float]:
    """Times to first token of the real embedded model (torch engine), measured now:
    a cold first request, then steady ones, as the readiness window sees them."""
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.model.embedded import ensure_embedded_model
    from warmup_agent.warmup.traffic import PromptFactory
    engine = TorchEngine(ensure_embedded_model(os.path.join(ROOT, ".cache", "test-data")))
    engine.load_tokenizer()
    engine.load_weights()
    prompts = PromptFactory(engine.tokenize)
    out = [engine.generate([prompts.prompt(16 + (i % 4) * 16)], warmup=True)[0].first_token_seconds for i in range(n)]
    engine.close()
    return out




def main() -> int:
    import numpy as np

    from warmup_agent.readiness.window import SlidingWindow

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--recorded", type=int, default=2000, help="probes to record from the embedded model")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "quantiles_cpu.json"))
    args = p.parse_args()

    rng = np.random.default_rng(0)
    n = args.samples
    dists = {
        "uniform": rng.uniform(0.005, 0.5, n),
        "lognormal": rng.lognormal(math.log(0.03), 0.8, n),
        "bimodal": np.where(rng.random(n) < 0.85, rng.normal(0.02, 0.003, n), rng.normal(0.6, 0.1, n)).clip(1e-4),
        "recorded_embedded_ttft": np.array(recorded_probes(args.recorded)),
    }
    rows = []
    for name, values in dists.items():
        for size in (100, 1000):
            w = SlidingWindow(size)
            max_err, checks, add_s, read_s, reads = 0.0, 0, 0.0, 0.0, 0
            for i, v in enumerate(values):
                t0 = time.perf_counter()
                w.add(float(v))
                add_s += time.perf_counter() - t0
                if i % 25 == 0 or i == len(values) - 1:
                    t0 = time.perf_counter()
                    got = w.quantiles((0.5, 0.9, 0.99))
                    read_s += time.perf_counter() - t0
                    reads += 1
                    tail = values[max(0, i + 1 - size): i + 1]
                    for q in (0.5, 0.9, 0.99):
                        exact = float(np.quantile(tail, q, method="inverted_cdf"))
                        max_err = max(max_err, abs(got[q] - exact) / exact)
                        checks += 1
            rows.append({"distribution": name, "window": size, "samples": len(values), "comparisons": checks,
                         "max_rel_error": max_err, "add_us": round(add_s / len(values) * 1e6, 3),
                         "quantiles_us": round(read_s / reads * 1e6, 3)})
            print(f"{name:24s} N={size:5d} max_rel_error={max_err:.3g} add={rows[-1]['add_us']}us "
                  f"p50/p90/p99={rows[-1]['quantiles_us']}us")
    result = {
        "benchmark": "quantiles",
        "quantile_max_rel_error": max(r["max_rel_error"] for r in rows),
        "stated_bound": 0.0,
        "definition": "nearest-rank (numpy inverted_cdf) over the last N samples; exact, no sketch",
        "table": rows,
        **provenance(),
    }
    write_result(args.out, result)
    print(f"quantile_max_rel_error={result['quantile_max_rel_error']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
