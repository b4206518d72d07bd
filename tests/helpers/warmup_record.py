"""What a prewarm stage record says it sent (issue 30's measured-benefit warmup):
each path's calls (a batch path sends `batch` requests per call), the two
per-length test calls and the decode-coverage tiles."""
from __future__ import annotations

import re


def requests_in_record(prewarm_detail: dict) -> int:
    sent = 0
    for p in prewarm_detail["paths"]:
        batch = int(re.search(r"/batch(\d+)/", p["path"]).group(1))
        sent += p["calls"] * batch
    warmup = prewarm_detail["warmup"]
    return sent + len(warmup["per_length"].get("lengths", [])) + len(warmup["decode_coverage"]["tiles"])
