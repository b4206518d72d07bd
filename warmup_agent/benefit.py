"""Warmup by measured benefit (issue 30): warm a path until it is warm, and no longer.

A *path* is what a server may pay a first-call cost for: endpoint x sampling
family x batch size x prompt length.  Each path gets requests with fresh
prompts (no prefix cache can answer them) until its requests stop getting
faster; a path whose first call already matches the steady level that other
paths measured gets no second call.  The whole warmup has a time budget
(`Budget`, sized by the caller from the server's own start-up); a path the
budget did not reach is recorded as skipped, with that reason.

Nothing here talks to a server: `send(path, answer_tokens) -> Call` is given by
the caller (stages/prewarm.py), so the rules are unit-tested on their own.

The rules, with `tol` = prewarm.converge_tolerance and a slack of SLACK_SECONDS
so that a 6 ms request is not "slower" for 1 ms of jitter:
- matches steady: TTFT <= (1 + tol) x the steady TTFT of the nearest warm length
  at or above this one (a longer prompt's prefill is an upper bound), and, when
  the call decoded, TPOT <= (1 + tol) x the steady TPOT of its batch size;
- stopped getting faster: the later of two calls is not faster than the earlier
  by more than tol, on TTFT and on TPOT; or a later call matches steady.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

SLACK_SECONDS = 0.002
#: The slack on the server's own clock (a prefill it times itself: no HTTP, no client).
SERVER_SLACK_SECONDS = 0.0005


@dataclass(frozen=True)
class Path:
    endpoint: str          # "chat" or "completions"
    family: str            # sampling family (traffic.FAMILY_DEFAULTS)
    batch: int             # requests sent at once
    prompt_tokens: int     # the length this path is warmed at

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
    """One batch's engine results (engines.base.RequestResult) as one Call: the
    slowest first token and the slowest request (the openai profile warmup and
    the torch/vllm shape grid both judge a batch by it)."""
    slow = max(results, key=lambda r: r.total_seconds)
    prefills = [r.server_prefill_seconds for r in results if r.server_prefill_seconds is not None]
    return Call(max(r.first_token_seconds for r in results), slow.total_seconds, slow.output_tokens, slow.prompt_tokens,
                max(prefills) if len(prefills) == len(results) else None)   # only when every request has one


def within(value: float, ref: float, tol: float, slack: float = SLACK_SECONDS) -> bool:
    return value <= ref * (1 + tol) + slack


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
        self._prefill: dict[int, dict[int, float]] = {}   # the server's own prefill times, where reported
        self._tpot: dict[int, list[float]] = {}

    def add(self, path: Path, call: Call) -> None:
        by_len = self._ttft.setdefault(path.batch, {})
        by_len[path.prompt_tokens] = min(by_len.get(path.prompt_tokens, call.ttft), call.ttft)
        if call.server_prefill is not None:
            pre = self._prefill.setdefault(path.batch, {})
            pre[path.prompt_tokens] = min(pre.get(path.prompt_tokens, call.server_prefill), call.server_prefill)
        if call.tpot is not None:
            self._tpot.setdefault(path.batch, []).append(call.tpot)

    def ttft_ref(self, batch: int, length: int) -> float | None:
        """Steady TTFT of the nearest warm length >= `length` (prefill grows with
        length, so that is an upper bound); above every warm length, the longest
        one scaled by the length ratio (an upper bound again)."""
        return _nearest_above(self._ttft.get(batch), length)

    def prefill_ref(self, batch: int, length: int) -> float | None:
        """The same over the server's own prefill times; None where it reported none."""
        return _nearest_above(self._prefill.get(batch), length)

    def prefill_ref_at(self, batch: int, length: int) -> float | None:
        """The server's steady prefill scaled to `length` from the nearest warm length
        (by the length ratio, down as well as up). The server's own clock has no HTTP
        cost in it, so its prefill is close to proportional to the prompt: the upper
        bound of prefill_ref hid a cold length. H200 llama.cpp run 9: the anchor at 310
        tokens read 17.7 ms steady, fresh lengths 223 and 266 read 14.9 and 16.3 ms
        (under the bound, so warm), the lengths were skipped and the user's 243-token
        first request prefilled in 1.95x its steady time (1.29x on the client)."""
        known = self._prefill.get(batch)
        if not known:
            return None
        nearest = _nearest_length(known, length)
        return known[nearest] * length / nearest

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


def _nearest_length(known: dict[int, float], length: int) -> int:
    """The shortest known length >= `length`; above all of them, the longest."""
    above = [n for n in known if n >= length]
    return min(above) if above else max(known)


def _nearest_above(known: dict[int, float] | None, length: int) -> float | None:
    """The level of the nearest length >= `length`; above all, the longest scaled by the length ratio."""
    if not known:
        return None
    nearest = _nearest_length(known, length)
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
    """The warmup budget: `fixed` when set (> 0), else ratio x the server's own
    start-up (spawn to healthy), at least min_seconds; a server already running
    (start-up unknown) gets unknown_start_seconds."""
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
    """What happened to one path: `result` is one of
    warm_on_first_call  the first call matched steady: no second call
    converged           later calls stopped getting faster
    still_improving     max calls reached while still getting faster
    skipped             not sent (`reason`: budget, refused family, ...)"""
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
              tol: float, max_calls: int) -> Outcome:
    """Send `path` until it is warm (see the module docstring); record its steady level."""
    out = Outcome(path, "skipped")
    while len(out.calls) < max_calls:
        if budget.exhausted():
            if not out.calls:
                out.reason = "budget"
                return out
            out.result, out.reason = "still_improving", "budget ran out on this path"
            break
        call = send(path)
        out.calls.append(call)
        if len(out.calls) == 1:
            if steady.matches(path, call, tol):
                out.result = "warm_on_first_call"
                break
        elif steady.matches(path, call, tol) or stopped_improving(out.calls[-2], call, tol):
            out.result = "converged"      # at the steady level other paths measured, or no faster
            break
    else:
        out.result, out.reason = "still_improving", f"prewarm.max_calls_per_path {max_calls} reached"
    if out.calls:
        # The fastest call is the steady level: a path that "stopped getting faster"
        # because its last call hit a noise spike must not lift the reference that
        # every later path is judged against (seen: 24 then 377 ms on shared cores).
        steady.add(path, min(out.calls, key=lambda c: c.ttft))
    return out


def fresh_lengths(lo: int, hi: int, used: Sequence[tuple[int, int]], count: int, answer: int) -> list[int]:
    """`count` prompt lengths whose decode ranges [n, n + answer] overlap none of
    the `used` (start, end) ranges: inside [lo, hi] where there is room, else
    above everything used."""
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


def prefill_warm(tested: Sequence[tuple[int, Call]], steady: SteadyLevels, batch: int, tol: float) -> bool:
    """Whether every (prompt length, call) of the per-length test, at lengths no
    request had reached, had its first token within tol / 2 of the steady TTFT
    (`SteadyLevels.ttft_ref`): then warming other prompt lengths buys nothing.

    Half the path tolerance, because this predicts lengths nobody measured and a
    first token is mostly fixed cost.  On llama.cpp (H200, 1.5B) a new length's
    prefill took 13-23 ms on the server against 8-10 ms warm, so fresh lengths came
    1.14-1.56x the anchor's 30 ms first token; one start judged 1.20x warm under the
    full 20 % + 2 ms, skipped the lengths, and the user's first request paid 1.32x.

    Where the server times its own prefill (llama-server's timings.prompt_ms), that
    clock decides: a later H200 run read fresh lengths at 1.09x and 1.15x the
    anchor's first token (inside tol / 2 + 2 ms), skipped the lengths, and the user's
    first request then prefilled in 16.1 ms on the server against 8.7 ms steady
    (1.33x on the client): the client's 30 ms first token hides an 8 ms prefill."""
    if not tested:
        return False
    for length, call in tested:
        server_ref = steady.prefill_ref_at(batch, length)
        if call.server_prefill is not None and server_ref is not None:
            if not within(call.server_prefill, server_ref, tol / 2, SERVER_SLACK_SECONDS):
                return False
            continue
        ref = steady.ttft_ref(batch, length)
        if ref is None or not within(call.ttft, ref, tol / 2):
            return False
    return True


def pays_per_length(calls: Sequence[Call], steady_tpot: float | None, ratio: float) -> tuple[bool, list[float]]:
    """Whether decode at new sequence lengths is slower than steady by more than
    `ratio`, on every one of `calls` (the per-length test)."""
    if steady_tpot is None or steady_tpot <= 0:
        return False, []
    ratios = [c.tpot / steady_tpot for c in calls if c.tpot is not None]
    return bool(ratios) and all(r > ratio for r in ratios), [round(r, 3) for r in ratios]
