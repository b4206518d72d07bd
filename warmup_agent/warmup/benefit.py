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

A path's first call that does not match steady is judged against a control
(`Controlled`, issue 40): the same shape with a fresh prompt, sent after the same
predecessor (`replay` re-sends it where the path's own first call would not be one:
a longer prompt, or more requests at once).  A server has ordinary costs that are
not cold start: on llama.cpp a request right after a much longer one, or after
concurrent ones, spends 60-100 ms more in its slot, warm or not.  The control pays
them too; only what the first call pays beyond its control is cold.  The same
measurement judges the readiness probes and gives the exported first-request
figures (warmup_agent/readiness/probes.py).
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


@dataclass(frozen=True)
class Controlled:
    """A "first" call and its control: the same shape with a fresh prompt, sent after
    the same predecessor (prompt length, requests at once).  The one cold-start
    measurement: the warmup's stop rule (`warm_path`, `warm_wave`), the readiness
    gate and the exported first-request figures (readiness/probes.py) all read it."""
    first: Call
    control: Call

    def cold(self, tol: float) -> bool:
        """The first call paid more than its control, beyond tol (TTFT, or TPOT where both decoded)."""
        if not within(self.first.ttft, self.control.ttft, tol):
            return True
        f, c = self.first.tpot, self.control.tpot
        return f is not None and c is not None and not within(f, c, tol)

    def ttft_tax(self, steady_ttft: float) -> float:
        """The first call's time to first token over `steady_ttft`, less what its control
        paid too: 1 + (first - control) / steady, never below 1.0 (nothing was cold): a
        control slower than its first is noise, not a cold start below zero."""
        return 1 + max(0.0, self.first.ttft - self.control.ttft) / steady_ttft

    def total_tax(self, steady_total: float) -> float:
        """The same on the whole answer."""
        return 1 + max(0.0, self.first.total - self.control.total) / steady_total

    def excess(self) -> dict[str, float]:
        """What the first paid beyond its control, as fractions of the control's time to
        first token and whole answer (never below 0): the taxes above with the control
        as the steady level, kept where a later start reuses them (warmup/findings.py)."""
        return {"ttft": round(max(0.0, self.first.ttft - self.control.ttft) / self.control.ttft, 4),
                "total": round(max(0.0, self.first.total - self.control.total) / self.control.total, 4)}

    def as_dict(self) -> dict:
        return {"first_ttft_ms": round(self.first.ttft * 1e3, 2), "control_ttft_ms": round(self.control.ttft * 1e3, 2),
                "first_total_ms": round(self.first.total * 1e3, 2), "control_total_ms": round(self.control.total * 1e3, 2)}


def harder_predecessor(at_once: int, longest_prompt: int, batch: int, length: int) -> bool:
    """Whether the last requests (`at_once` of them, the longest prompt `longest_prompt`
    tokens) are a harder predecessor than a call of `batch` requests of `length` tokens:
    then a control must follow them again (they are re-sent) to meet what its first met
    (on llama.cpp a request after a longer one or after concurrent ones pays 60-100 ms in
    its slot, warm or not)."""
    return at_once > batch or longest_prompt > length


#: Why a path got one call only although its first did not match steady (the record).
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
        """Steady TTFT of the nearest warm length >= `length` (prefill grows with
        length, so that is an upper bound); above every warm length, the longest
        one scaled by the length ratio (an upper bound again)."""
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
              tol: float, max_calls: int, replay: Callable[[], None] | None = None,
              calls: Sequence[Call] = ()) -> Outcome:
    """Send `path` until it is warm (see the module docstring); record its steady level.
    `replay`: re-sends the first call's predecessor before the control (None: the
    path's own first call is as good a predecessor).  `calls`: calls already made
    (a wave's first call and its control, `warm_wave`): the rules go on from there."""
    out = Outcome(path, "skipped", calls=list(calls))
    if len(out.calls) >= 2:
        out.result = "still_improving"
        if not Controlled(out.calls[0], out.calls[1]).cold(tol):
            out.result, out.reason = "warm_on_first_call", ORDINARY
            return out      # calls sent at once are no steady level (see warm_wave)
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
            out.result, out.reason = "warm_on_first_call", ORDINARY   # the second call was its control
            break
        elif steady.matches(path, call, tol) or stopped_improving(out.calls[-2], call, tol):
            out.result = "converged"      # at the steady level other paths measured, or no faster
            break
    else:
        out.result, out.reason = "still_improving", f"prewarm.max_calls_per_path {max_calls} reached"
    alone = out.calls[len(calls):]      # the given calls were sent at once: no steady level
    if alone:
        # The fastest call is the steady level: a path that "stopped getting faster"
        # because its last call hit a noise spike must not lift the reference that
        # every later path is judged against (seen: 24 then 377 ms on shared cores).
        steady.add(out.path, min(alone, key=lambda c: c.ttft))
    return out


def warm_wave(paths: Sequence[Path], send_wave: Callable[[Sequence[Path]], list[Call]], send: Callable[[Path], Call],
              steady: SteadyLevels, budget: Budget, tol: float, max_calls: int) -> list[Outcome]:
    """One call per path, all sent at once (`send_wave`: concurrently, as many at a
    time as the server takes), then the same wave again as their controls: each call
    of the second wave has the same predecessors as its first.  A path whose first
    call was not cold beyond its control is done; a cold one goes on alone
    (`warm_path`).  Calls at once pay the server's concurrency cost, so they are judged
    against each other, never against the steady levels of calls sent alone."""
    if not paths:
        return []
    if budget.exhausted():
        return [Outcome(p, "skipped", "budget") for p in paths]
    first = send_wave(paths)
    control = send_wave(paths)
    return [warm_path(p, send, steady, budget, tol, max_calls, calls=[f, c])
            for p, f, c in zip(paths, first, control, strict=True)]


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


def prefill_cold(pair: Controlled, tol: float) -> bool:
    """Whether a fresh prompt length's first token cost more than its control's (the
    same length again, after the same predecessor), beyond tol / 2: then other prompt
    lengths are worth warming.  Half the path tolerance, because this predicts lengths
    nobody measured and a first token is mostly fixed cost.

    Where the server times its own prefill (llama-server's timings.prompt_ms), that
    clock decides: the client's 30 ms first token hides an 8 ms prefill, and a
    request's wait in its slot after a longer or concurrent one is not prefill."""
    f, c = pair.first.server_prefill, pair.control.server_prefill
    if f is not None and c is not None:
        return not within(f, c, tol / 2, SERVER_SLACK_SECONDS)
    return not within(pair.first.ttft, pair.control.ttft, tol / 2)


def pays_per_length(pairs: Sequence[Controlled], ratio: float) -> tuple[bool, list[float]]:
    """Whether decode at new sequence lengths is slower than at the same lengths again
    (their controls) by more than `ratio`, on every pair, and there are two pairs at least
    (the per-length test): one slow pair on shared cores is noise as often as not (a CPU
    transformers serve read 4.2x on a lone pair, and decode coverage would then spend the
    warmup's budget for nothing)."""
    ratios = [f / c for p in pairs if (f := p.first.tpot) is not None and (c := p.control.tpot)]
    pays = len(ratios) >= 2 and len(ratios) == len(pairs) and all(r > ratio for r in ratios)
    return pays, [round(r, 3) for r in ratios]
