"""The readiness gate's verdict: open or not, and why.

The gate opens when the time-to-first-token window holds enough probes, its P50 and
P90 are at or under their thresholds and, where probes time decode, decode has
converged.  A closed verdict names the failure reason.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from warmup_agent.readiness.thresholds import Thresholds
from warmup_agent.readiness.window import SlidingWindow, nearest_rank


@dataclass(frozen=True)
class Verdict:
    open: bool
    reason: str = ""        # a failure reason when not open
    message: str = ""       # one line: the figures against what was needed


@dataclass(frozen=True)
class DecodeTest:
    """P90 time per output token at most `p90_max`, and the older half of the last
    probes at most `ratio` x the newer half's median (math.inf: no ratio)."""
    window: SlidingWindow
    p90_max: float
    ratio: float = math.inf


def decode_converged(window: SlidingWindow, min_probes: int, p90_max: float, ratio: float) -> bool:
    """Medians of two halves, not a P90/P50 spread: a healthy server on a noisy host has
    a wide spread forever, but its cold phase ends."""
    values = window.values()
    if len(values) < max(min_probes, 1 if ratio == math.inf else 2):
        return False
    if nearest_rank(sorted(values), 0.9) > p90_max:
        return False
    if ratio == math.inf:
        return True
    recent = values[-max(min_probes, 2):]
    half = len(recent) // 2
    return statistics.median(recent[:half]) <= ratio * statistics.median(recent[half:])


def judge(window: SlidingWindow, thresholds: Thresholds, min_probes: int,
          decode: DecodeTest | None = None) -> Verdict:
    """The gate's verdict over `window`, needing at least `min_probes` samples."""
    values = sorted(window.values())     # one read: a time-bounded window ages between reads
    if not values or len(values) < min_probes:
        return Verdict(False, "readiness_thresholds_not_met",
                       f"{len(values)} of the {min_probes} probes needed are in the window")
    p50, p90 = nearest_rank(values, 0.5), nearest_rank(values, 0.9)
    if not (p50 <= thresholds.p50 and thresholds.tail_ok(p90)):
        return Verdict(False, "readiness_thresholds_not_met",
                       f"the time to first token is P50 {p50 * 1000:.1f} ms / P90 {p90 * 1000:.1f} ms; "
                       f"thresholds {thresholds.p50 * 1000:.0f} ms / {thresholds.p90 * 1000:.0f} ms")
    if decode is not None and not decode_converged(decode.window, min_probes, decode.p90_max, decode.ratio):
        t = decode.window.quantiles((0.5, 0.9))
        needed = f"P90 <= {decode.p90_max * 1000:.0f} ms"
        if decode.ratio != math.inf:
            needed += f" and the older half of the last probes at most {decode.ratio:g} x slower than the newer half"
        return Verdict(False, "decode_not_converged",
                       f"the time per output token is P50 {t.get(0.5, 0) * 1000:.2f} ms / "
                       f"P90 {t.get(0.9, 0) * 1000:.2f} ms; needed {needed}")
    return Verdict(True)
