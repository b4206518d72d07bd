"""What a prewarm stage record says it sent (issue 30's measured-benefit warmup):
each path's calls (a batch path sends `batch` requests per call), the
decode-coverage tiles, the replays, the settle requests and the length ladder (the per-length test's fresh
length is the gate's first probe pair: probes)."""
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
    per_length = warmup["per_length"]
    ready_pairs = (ready_detail or {}).get("first_probe_pairs", [])
    # the first pairs prewarm sent: their replays are in warmup's
    ready_pairs = ready_pairs[(ready_detail or {}).get("first_pairs_from_prewarm", 0):]
    replayed = (warmup.get("replayed_requests", 0) + warmup.get("settle_requests", 0)
                + sum(p.get("replayed_requests", 0) for p in ready_pairs))
    replayed += (ready_detail or {}).get("settle_requests", 0)
    replayed += warmup.get("ladder_requests", 0)        # the length ladder, one request per rung
    assert warmup.get("ladder_requests", 0) == len(per_length.get("ladder", []))
    # the per-length test sends probes, not warmup: the gate's first pair(s), or its first
    # probe alone where a remembered finding spares the pair (probe_pair false)
    assert per_length.get("probe_pair") or not per_length.get("pairs"), per_length
    return sent + len(warmup["decode_coverage"]["tiles"]) + replayed


def exported_pair(ready_detail: dict, prewarm_detail: dict | None = None) -> int:
    """Index, among the gate's probes, of the first probe whose pair the exported
    first-request figures are (stages/ready.py): pair k is probes 2k and 2k + 1; the
    last pair's, or prewarm's second (the second fresh length's) where it found that each
    new prompt length pays."""
    pairs = ready_detail["first_probe_pairs"]
    per_length = ((prewarm_detail or {}).get("warmup") or {}).get("per_length") or {}
    if not per_length.get("prefill_pays_each_new_length"):
        return 2 * (len(pairs) - 1)
    # each new length pays: the second fresh length's pair where prewarm sent both; the
    # gate's own first pair where it sent a new one (decode pays: after decode coverage)
    return 2 if ready_detail.get("first_pairs_from_prewarm", 0) >= 2 else 0


def controlled_tax(values: list[float], first: int) -> float:
    """1 + (values[first] - its control values[first + 1], never below 0) / the median of
    the values after the first: readiness/probes.py's definition, computed independently."""
    import statistics
    return 1 + max(0.0, values[first] - values[first + 1]) / statistics.median(values[first + 1:])


def controlled_total_tax(ttfts: list[float], totals: list[float], tokens: list[int], first: int) -> float:
    """The whole-answer tax of readiness/probes.py, computed independently: 1 + (the
    first probe's whole answer - its control's, never below 0) / the steady whole
    answer of the first's length (the later probes' median when all answered as many
    tokens, else the steady TTFT + (tokens - 1) x the later probes' median time per
    output token)."""
    import statistics
    later = range(first + 1, len(ttfts))
    if all(tokens[i] == tokens[first] for i in later):
        steady = statistics.median(totals[i] for i in later)
    else:
        tpot = statistics.median((totals[i] - ttfts[i]) / (tokens[i] - 1) for i in later if tokens[i] > 1)
        steady = statistics.median(ttfts[i] for i in later) + (tokens[first] - 1) * tpot
    return 1 + max(0.0, totals[first] - totals[first + 1]) / steady
