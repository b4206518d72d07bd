"""What a prewarm stage record says it sent (issue 30's measured-benefit warmup):
each path's calls (a batch path sends `batch` requests per call), the two
per-length test calls and the decode-coverage tiles."""
from __future__ import annotations

import re


def requests_in_record(prewarm_detail: dict, ready_detail: dict | None = None) -> int:
    """Warmup requests the record accounts for: every path's calls, the per-length test's
    firsts and controls, decode coverage, and the predecessors replayed before controls
    (prewarm's, and the ready stage's before the first probe's control), and the settle
    waves (prewarm's, and the ready stage's just before SERVING)."""
    sent = 0
    for p in prewarm_detail["paths"]:
        batch = int(re.search(r"/batch(\d+)/", p["path"]).group(1))
        sent += p["calls"] * batch
    warmup = prewarm_detail["warmup"]
    replayed = warmup.get("replayed_requests", 0) + warmup.get("settle_requests", 0) + sum(p.get("replayed_requests", 0)
                                                         for p in (ready_detail or {}).get("first_probe_pairs", []))
    replayed += (ready_detail or {}).get("settle_requests", 0)
    return (sent + 2 * len(warmup["per_length"].get("lengths", [])) + len(warmup["decode_coverage"]["tiles"])
            + replayed)
