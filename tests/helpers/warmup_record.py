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


def exported_pair(ready_detail: dict, prewarm_detail: dict | None = None) -> int:
    """Index, among the gate's probes, of the first probe whose pair the exported
    first-request figures are (stages/ready.py): pair k is probes 2k and 2k + 1; the
    last pair's, or the first's where prewarm found that each new prompt length pays."""
    pairs = ready_detail["first_probe_pairs"]
    per_length = ((prewarm_detail or {}).get("warmup") or {}).get("per_length") or {}
    return 0 if per_length.get("prefill_pays_each_new_length") else 2 * (len(pairs) - 1)


def controlled_tax(values: list[float], first: int) -> float:
    """1 + (values[first] - its control values[first + 1], never below 0) / the median of
    the values after the first: readiness/probes.py's definition, computed independently."""
    import statistics
    return 1 + max(0.0, values[first] - values[first + 1]) / statistics.median(values[first + 1:])
