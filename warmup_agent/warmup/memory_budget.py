"""A memory budget for the warmup grid: drop the largest batch sizes instead of failing.

On a busy host, or on the CPU where only the OOM killer stops a process, the largest
shapes may not fit.  `plan` drops batch sizes by an estimate before traffic; `BackOff`
drops them on an out-of-memory error during it.  Only a smallest batch that does not fit fails.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from warmup_agent.errors import ReasonedError

log = logging.getLogger("warmup_agent.memory_budget")

REASON = "prewarm_memory_budget_exceeded"


class BudgetExceeded(ReasonedError):
    """Not even the smallest batch fits; `reason` is always REASON."""

    def __init__(self, message: str):
        super().__init__(REASON, message)


@dataclass
class Plan:
    batches: list[int]                       # ascending
    dropped: list[int]
    estimate_bytes: dict[int, int] = field(default_factory=dict)   # batch -> bytes at max_length


def plan(batches: list[int], max_length: int, bytes_per_token: float, budget_bytes: int) -> Plan:
    """Keep the batch sizes whose batch x max_length x bytes_per_token fits the budget (<= 0: none)."""
    ordered = sorted(set(batches))
    estimate = {b: int(math.ceil(b * max_length * max(bytes_per_token, 0.0))) for b in ordered}
    if budget_bytes <= 0:
        return Plan(ordered, [], estimate)
    kept = [b for b in ordered if estimate[b] <= budget_bytes]
    dropped = [b for b in ordered if b not in kept]
    if not kept:
        b = ordered[0]
        raise BudgetExceeded(f"key 'prewarm.memory_budget_bytes': batch {b} x {max_length} tokens needs about "
                             f"{estimate[b]} bytes; the budget is {budget_bytes}")
    if dropped:
        log.warning("prewarm memory budget %d bytes: dropping batch sizes %s (estimated %s bytes at %d tokens)",
                    budget_bytes, dropped, [estimate[b] for b in dropped], max_length)
    return Plan(kept, dropped, estimate)


def measure_peak_rss(fn: Callable[[], object], interval: float = 0.001) -> tuple[object, int]:
    """Run fn(); return its result and peak RSS growth, sampled (a short peak is missed; BackOff catches it)."""
    import psutil
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval):
            peak[0] = max(peak[0], proc.memory_info().rss)

    t = threading.Thread(target=sample, name="rss-peak", daemon=True)
    t.start()
    try:
        result = fn()
        peak[0] = max(peak[0], proc.memory_info().rss)
    finally:
        done.set()
        t.join()
    return result, max(0, peak[0] - base)


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":   # torch.OutOfMemoryError, any device
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class BackOff:
    """Runtime back-off over the batch sizes of the grid."""

    def __init__(self) -> None:
        self.limit = math.inf       # batch sizes >= limit are skipped
        self.dropped_at: list[tuple[int, str]] = []   # (batch, error)

    def allows(self, batch: int) -> bool:
        return batch < self.limit

    def run(self, batch: int, fn: Callable[[], object]) -> Any:
        """Run fn(); on out-of-memory drop this batch size and every larger one, and return None."""
        if not self.allows(batch):
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - only memory errors are handled; the rest re-raised
            if not is_out_of_memory(e):
                raise
            if batch <= 1:   # nothing smaller to fall back to
                raise BudgetExceeded(f"batch {batch} ran out of memory during prewarm: {type(e).__name__}") from None
            self.limit = min(self.limit, batch)
            self.dropped_at.append((batch, type(e).__name__))
            log.warning("prewarm: batch %d ran out of memory (%s); warming only batch sizes below %d",
                        batch, type(e).__name__, batch)
            return None
