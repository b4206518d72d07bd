"""Added latency of the routing proxy, against direct access, in the same run.

Requests alternate between the upstream directly and the same upstream through
the proxy (warmup_agent/proxy.py), over loopback, each on its own keep-alive
connection, with a streamed (SSE) answer.  Per request we measure the time to
the first body byte (what a user feels as time to first token) and to the end
of the stream; the proxy's added latency at p50/p99 is the difference of the
two sides' quantiles.  Target: p99 added <= 1 ms.

The default upstream is a stdlib SSE server answering at once (so the figure is
the proxy's own cost, not an engine's variance); --upstream URL measures
against any OpenAI-compatible server (e.g. a CPU vLLM: its variance then
dominates).  Writes bench/results/proxy_<label>.json (or --out).

    .venv/bin/python -m bench.bench_proxy [--requests 3000] [--upstream URL]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.provenance import provenance, write_result  # noqa: E402
from tests.helpers.servers import SSEStandIn  # noqa: E402

EVENTS = [b'data: {"choices":[{"index":0,"text":" tok%d"}]}\n\n' % i for i in range(8)] + [b"data: [DONE]\n\n"]


def one(conn: http.client.HTTPConnection, body: bytes) -> tuple[float, float]:
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read1(65536)
    first = time.perf_counter() - t0
    resp.read()
    return first, time.perf_counter() - t0


def quantile(values: list[float], q: float) -> float:
    from warmup_agent.readiness.window import nearest_rank
    return nearest_rank(sorted(values), q)




def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3000, help="measured requests per side")
    p.add_argument("--warmup", type=int, default=200, help="unmeasured requests per side first")
    p.add_argument("--upstream", help="OpenAI-compatible base URL (default: a stdlib SSE server)")
    p.add_argument("--model", default="tiny", help="model name sent with --upstream")
    p.add_argument("--out", help="output JSON (default bench/results/proxy_<label>.json)")
    args = p.parse_args()

    from exporter.metrics import AgentMetrics
    from warmup_agent import config
    from warmup_agent.engines.base import Engine, EngineFacts, RequestResult
    from warmup_agent.pipeline import Agent
    from warmup_agent.proxy import RoutingProxy
    from warmup_agent.states import State

    class NoEngine(Engine):
        """The proxy never calls the agent's engine: the agent is moved to SERVING by hand."""
        name = "none"

        def load_tokenizer(self) -> None:
            pass

        def load_weights(self) -> None:
            pass

        def facts(self) -> EngineFacts:
            raise NotImplementedError("the proxy bench loads no model")

        def tokenize(self, text: str) -> list[int]:
            raise NotImplementedError("the proxy bench loads no model")

        def generate(self, prompts: list[list[int]], max_new_tokens: int = 1,
                     warmup: bool = False) -> list[RequestResult]:
            raise NotImplementedError("the proxy bench loads no model")

        def weight_fingerprint(self) -> str:
            raise NotImplementedError("the proxy bench loads no model")

    upstream = args.upstream or SSEStandIn(EVENTS, record=False).url
    label = "loopback_sse" if not args.upstream else "upstream"
    agent = Agent(config.load(env={}), NoEngine(), metrics=AgentMetrics())
    for s in (State.PRELOAD, State.PRIME, State.SERVING):
        agent.sm.transition(s)
    proxy = RoutingProxy(agent, upstream).start()

    host, port = upstream.split("//", 1)[1].split(":")
    direct = http.client.HTTPConnection(host, int(port.rstrip("/")), timeout=60)
    via = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    body = json.dumps({"model": args.model, "prompt": "hello", "max_tokens": 8, "temperature": 0,
                       "stream": True}).encode()
    samples: dict[str, tuple[list[float], list[float]]] = {"direct": ([], []), "proxy": ([], [])}
    for i in range(args.warmup + args.requests):
        # Alternate which side goes first so drift and caches hit both sides alike.
        order = (("direct", direct), ("proxy", via)) if i % 2 == 0 else (("proxy", via), ("direct", direct))
        for side, conn in order:
            first, total = one(conn, body)
            if i >= args.warmup:
                samples[side][0].append(first)
                samples[side][1].append(total)
    proxy.stop()
    # The proxy's own record of user traffic: every measured and warmup request.
    counted = agent.metrics.registry.get_sample_value("warmup_proxy_requests_total", {"route": "main", "code": "200"})
    assert counted == args.warmup + args.requests, counted

    def ms(x):
        return round(x * 1000, 4)

    table = {}
    for what, k in (("first_byte", 0), ("total", 1)):
        for q in (0.5, 0.9, 0.99):
            d, v = quantile(samples["direct"][k], q), quantile(samples["proxy"][k], q)
            table[f"{what}_p{q * 100:g}"] = {"direct_ms": ms(d), "proxy_ms": ms(v), "added_ms": ms(v - d)}
    result = {
        "benchmark": "proxy",
        "proxy_added_p50_ms": table["first_byte_p50"]["added_ms"],
        "proxy_added_p99_ms": table["first_byte_p99"]["added_ms"],
        "target_p99_ms": 1.0,
        "meets_target": table["first_byte_p99"]["added_ms"] <= 1.0,
        "definition": "quantile(time to first body byte through the proxy) - quantile(direct), same run, interleaved",
        "upstream": args.upstream or "stdlib SSE server on loopback (9 events, answers at once)",
        "requests_per_side": args.requests,
        "quantiles": table,
        **provenance(),
    }
    out = args.out or os.path.join(ROOT, "bench", "results", f"proxy_{label}.json")
    write_result(out, result)
    print(json.dumps({k: result[k] for k in ("proxy_added_p50_ms", "proxy_added_p99_ms", "meets_target")}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
