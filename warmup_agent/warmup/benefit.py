"""Warmup by measured benefit: warm each path (endpoint x family x batch x prompt length) until it is warm.

A first call is cold only by what it pays beyond its control (`Controlled`): servers have
ordinary costs that are not cold start, such as llama.cpp's slower slot after a longer or
concurrent request.  `send` is given by the caller, so the rules run without a server.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: Absolute slack on comparisons, so jitter on a short request does not count as slower.
SLACK_SECONDS = 0.002
#: The slack on the server's own prefill clock (no HTTP, no client).
SERVER_SLACK_SECONDS = 0.0005


@dataclass(frozen=True)
class Path:
    endpoint: str          # "chat" or "completions"
    family: str            # sampling family (traffic.FAMILY_DEFAULTS)
    batch: int             # requests sent at once
    prompt_tokens: int

    @property
    def label(self) -> str:
        return f"{self.endpoint}/{self.family}/batch{self.batch}/len{self.prompt_tokens}"


@dataclass(frozen=True)
class Call:
    """One warmup call of a path (for a batch: its slowest request)."""
    ttft: float
    total: float
    output_tokens: int
    prompt_tokens: int = 0
    server_prefill: float | None = None    # the server's own prefill time, where it reports one

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a one-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.total - self.ttft) / (self.output_tokens - 1)


def call_of(results: Sequence) -> Call:
    """One batch's engine results as one Call: its slowest first token and slowest request."""
    slow = max(results, key=lambda r: r.total_seconds)
    prefills = [r.server_prefill_seconds for r in results if r.server_prefill_seconds is not None]
    return Call(max(r.first_token_seconds for r in results), slow.total_seconds, slow.output_tokens, slow.prompt_tokens,
                max(prefills) if len(prefills) == len(results) else None)


def within(value: float, ref: float, tol: float, slack: float = SLACK_SECONDS) -> bool:
    return value <= ref * (1 + tol) + slack


@dataclass(frozen=True)
class Controlled:
    """A first call and its control: the same shape with a fresh prompt, after the same predecessor."""
    first: Call
    control: Call

    def cold(self, tol: float) -> bool:
        """The first call paid more than its control, beyond tol (TTFT, or TPOT where both decoded)."""
        if not within(self.first.ttft, self.control.ttft, tol):
            return True
        f, c = self.first.tpot, self.control.tpot
        return f is not None and c is not None and not within(f, c, tol)

    def ttft_tax(self, steady_ttft: float) -> float:
        """1 + (first - control) TTFT / steady, never below 1 (a slower control is noise)."""
        return 1 + max(0.0, self.first.ttft - self.control.ttft) / steady_ttft

    def total_tax(self, steady_total: float) -> float:
        """`ttft_tax` on the whole answer."""
        return 1 + max(0.0, self.first.total - self.control.total) / steady_total

    def excess(self) -> dict[str, float]:
        """What the first paid beyond its control, as fractions of the control's TTFT and total."""
        return {"ttft": round(max(0.0, self.first.ttft - self.control.ttft) / self.control.ttft, 4),
                "total": round(max(0.0, self.first.total - self.control.total) / self.control.total, 4),
                "first_ttft_seconds": round(self.first.ttft, 6)}

    def as_dict(self) -> dict:
        return {"first_ttft_ms": round(self.first.ttft * 1e3, 2), "control_ttft_ms": round(self.control.ttft * 1e3, 2),
                "first_total_ms": round(self.first.total * 1e3, 2), "control_total_ms": round(self.control.total * 1e3, 2)}


def harder_predecessor(at_once: int, longest_prompt: int, batch: int, length: int) -> bool:
    """Whether the last requests are a harder predecessor than this call (then re-send them before its control)."""
    return at_once > batch or longest_prompt > length


ORDINARY = "its control, sent after the same predecessor, paid the same: the server's ordinary cost, not a cold start"


def stopped_improving(prev: Call, cur: Call, tol: float) -> bool:
    """`cur` is not faster than `prev` by more than tol (TTFT, and TPOT when both decoded)."""
    if not within(prev.ttft, cur.ttft, tol):
        return False
    if prev.tpot is not None and cur.tpot is not None and not within(prev.tpot, cur.tpot, tol):
        return False
    return True


class SteadyLevels:
    """What warm paths measured: steady TTFT per (batch, length), TPOT per batch."""

    def __init__(self) -> None:
        self._ttft: dict[int, dict[int, float]] = {}
        self._tpot: dict[int, list[float]] = {}

    def add(self, path: Path, call: Call) -> None:
        by_len = self._ttft.setdefault(path.batch, {})
        by_len[path.prompt_tokens] = min(by_len.get(path.prompt_tokens, call.ttft), call.ttft)
        if call.tpot is not None:
            self._tpot.setdefault(path.batch, []).append(call.tpot)

    def ttft_ref(self, batch: int, length: int) -> float | None:
        """Steady TTFT of the nearest warm length >= `length` (an upper bound: prefill grows with length)."""
        return _nearest_above(self._ttft.get(batch), length)

    def tpot_ref(self, batch: int) -> float | None:
        values = self._tpot.get(batch)
        return statistics.median(values) if values else None

    def matches(self, path: Path, call: Call, tol: float) -> bool:
        ref = self.ttft_ref(path.batch, path.prompt_tokens)
        if ref is None or not within(call.ttft, ref, tol):
            return False
        tpot_ref = self.tpot_ref(path.batch)
        if call.tpot is not None:
            return tpot_ref is not None and within(call.tpot, tpot_ref, tol)
        return True


def _nearest_above(known: dict[int, float] | None, length: int) -> float | None:
    """The level of the nearest length >= `length`; above all, the longest scaled by the length ratio."""
    if not known:
        return None
    above = [n for n in known if n >= length]
    nearest = min(above) if above else max(known)
    return known[nearest] * max(1.0, length / nearest)


class Budget:
    """Seconds the warmup may take; `why` says where the number came from."""

    def __init__(self, seconds: float, why: str, clock: Callable[[], float] = time.perf_counter):
        self.seconds, self.why, self._clock = seconds, why, clock
        self._start = clock()

    def spent(self) -> float:
        return self._clock() - self._start

    def exhausted(self) -> bool:
        return self.seconds > 0 and self.spent() >= self.seconds

    def as_dict(self) -> dict:
        return {"seconds": round(self.seconds, 3), "spent_seconds": round(self.spent(), 3),
                "exhausted": self.exhausted(), "why": self.why}


def budget_for(server_start_seconds: float | None, ratio: float, min_seconds: float, fixed: float,
               unknown_start_seconds: float = 30.0) -> tuple[float, str]:
    """The warmup budget and why: `fixed` if > 0, else ratio x the server's start-up, at least min_seconds."""
    if fixed > 0:
        return fixed, "prewarm.budget_seconds"
    if server_start_seconds is None:
        return max(min_seconds, unknown_start_seconds), (
            f"server already running (start-up unknown): {unknown_start_seconds:g} s")
    seconds = max(min_seconds, ratio * server_start_seconds)
    return seconds, (f"{ratio:g} x the server's start-up of {server_start_seconds:.2f} s"
                     + (f", at least prewarm.budget_min_seconds {min_seconds:g} s" if seconds == min_seconds else ""))


@dataclass
class Outcome:
    """What happened to one path: warm_on_first_call, converged, still_improving or skipped (see `reason`)."""
    path: Path
    result: str
    reason: str = ""
    calls: list[Call] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"path": self.path.label, "result": self.result, "reason": self.reason,
                "calls": len(self.calls),
                "ttft_ms": [round(c.ttft * 1e3, 2) for c in self.calls],
                "tpot_ms": [None if c.tpot is None else round(c.tpot * 1e3, 2) for c in self.calls]}


def warm_path(path: Path, send: Callable[[Path], Call], steady: SteadyLevels, budget: Budget,
              tol: float, max_calls: int, replay: Callable[[], None] | None = None,
              calls: Sequence[Call] = ()) -> Outcome:
    """Send `path` until it matches steady or stops getting faster; record its steady level.

    `replay` re-sends the first call's predecessor before the control; `calls` were already made."""
    out = Outcome(path, "skipped", calls=list(calls))
    if len(out.calls) >= 2:
        out.result = "still_improving"
        if not Controlled(out.calls[0], out.calls[1]).cold(tol):
            out.result, out.reason = "warm_on_first_call", ORDINARY
            return out
    while len(out.calls) < max_calls:
        if budget.exhausted():
            if not out.calls:
                out.reason = "budget"
                return out
            out.result, out.reason = "still_improving", "budget ran out on this path"
            break
        if len(out.calls) == 1 and replay is not None:
            replay()
        call = send(path)
        out.calls.append(call)
        if len(out.calls) == 1:
            if steady.matches(path, call, tol):
                out.result = "warm_on_first_call"
                break
        elif len(out.calls) == 2 and not Controlled(out.calls[0], call).cold(tol):
            out.result, out.reason = "warm_on_first_call", ORDINARY
            break
        elif steady.matches(path, call, tol) or stopped_improving(out.calls[-2], call, tol):
            out.result = "converged"
            break
    else:
        out.result, out.reason = "still_improving", f"prewarm.max_calls_per_path {max_calls} reached"
    alone = out.calls[len(calls):]      # calls sent at once set no steady level
    if alone:
        # The fastest call, so that one noise spike does not lift every later path's reference.
        steady.add(out.path, min(alone, key=lambda c: c.ttft))
    return out


def warm_wave(paths: Sequence[Path], send_wave: Callable[[Sequence[Path]], list[Call]], send: Callable[[Path], Call],
              steady: SteadyLevels, budget: Budget, tol: float, max_calls: int) -> list[Outcome]:
    """One call per path sent at once, then the same wave again as their controls; cold paths go on alone.

    Concurrent calls pay the server's concurrency cost, so they are judged only against each other."""
    if not paths:
        return []
    if budget.exhausted():
        return [Outcome(p, "skipped", "budget") for p in paths]
    first = send_wave(paths)
    control = send_wave(paths)
    return [warm_path(p, send, steady, budget, tol, max_calls, calls=[f, c])
            for p, f, c in zip(paths, first, control, strict=True)]


def fresh_lengths(lo: int, hi: int, used: Sequence[tuple[int, int]], count: int, answer: int) -> list[int]:
    """`count` prompt lengths whose [n, n + answer] ranges overlap none of `used`, in [lo, hi] where there is room."""
    picks: list[int] = []
    taken = list(used)

    def free(n: int) -> bool:
        return all(n + answer < a or n > b for a, b in taken)
    candidates = [lo + (hi - lo) * k // (count + 1) for k in range(1, count + 1)] + list(range(lo, hi + 1, max(1, answer + 1)))
    for n in candidates:
        if len(picks) == count:
            break
        if n >= 1 and free(n):
            picks.append(n)
            taken.append((n, n + answer))
    top = max([b for _, b in taken] + [hi])
    while len(picks) < count:
        top += answer + 2
        picks.append(top)
        taken.append((top, top + answer))
    return picks


def prefill_cold(pair: Controlled, tol: float) -> bool:
    """Whether a fresh length's first token cost more than its control's, beyond tol / 2 (it predicts
    unmeasured lengths).  The server's own prefill clock decides where it has one: it excludes slot waits."""
    f, c = pair.first.server_prefill, pair.control.server_prefill
    if f is not None and c is not None:
        return not within(f, c, tol / 2, SERVER_SLACK_SECONDS)
    return not within(pair.first.ttft, pair.control.ttft, tol / 2)


def pays_per_length(pairs: Sequence[Controlled], ratio: float) -> tuple[bool, list[float]]:
    """Whether decode at new lengths is slower than its controls by more than `ratio` on every pair,
    of two at least: one slow pair on shared cores is as often noise."""
    ratios = [f / c for p in pairs if (f := p.first.tpot) is not None and (c := p.control.tpot)]
    pays = len(ratios) >= 2 and len(ratios) == len(pairs) and all(r > ratio for r in ratios)
    return pays, [round(r, 3) for r in ratios]
