"""The users' real first request: computed once, here (issue 41).

The proxy reports every user request the main engine answered with status 200
(`Readiness.user_answer`): time to the first body chunk, time to the end of the
body, and the answer's output tokens where it knows them.  The first answer
after a gate opened (PRIME -> SERVING; a re-warm's gate starts again) is held;
the `steady_requests` users' answers after it are its steady level:

  first user request tax (TTFT)   first TTFT / median TTFT of the answers after it
  whole-answer tax                first whole answer / (steady TTFT +
                                  (first's tokens - 1) x median time per output
                                  token of the answers after it)

The steady level is the users' own later answers, not the probes': the same
traffic, through the same proxy, so the figure is what an outside client
measures as "first request over steady", and a user whose prompts are longer
than the probes' does not read as a cold start.  The whole answer is compared
at the first answer's own length (answers differ in length), from the later
answers' decode rate: (whole - TTFT) / (tokens - 1).  The proxy knows the tokens
from an answer's usage, or for a stream without usage from its content chunks
(proxy/stream_tokens.py).  Without token counts the whole-answer figure is not
computed (None; the gauge stays 0), rather than dividing answers of different lengths.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class UserAnswer:
    ttft: float
    total: float
    output_tokens: int | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, or None (one token, or unknown)."""
        if self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.total - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class FirstUserFigures:
    first: UserAnswer
    later: tuple[UserAnswer, ...]
    steady_ttft: float
    steady_total: float | None

    @property
    def ttft_tax(self) -> float:
        return self.first.ttft / self.steady_ttft if self.steady_ttft > 0 else 0.0

    @property
    def total_tax(self) -> float | None:
        return self.first.total / self.steady_total if self.steady_total else None


def figures(first: UserAnswer, later: list[UserAnswer]) -> FirstUserFigures:
    """The first user request's figures against the answers after it (non-empty)."""
    steady_ttft = statistics.median(a.ttft for a in later)
    steady_total: float | None = None
    if first.output_tokens is not None:
        if first.output_tokens < 2:
            steady_total = steady_ttft
        else:
            tpots = [t for a in later if (t := a.tpot) is not None]
            if tpots:
                steady_total = steady_ttft + (first.output_tokens - 1) * statistics.median(tpots)
    return FirstUserFigures(first, tuple(later), steady_ttft, steady_total)


class FirstUserRequest:
    """One gate's users' first request: held, then compared once `steady_requests`
    answers after it are in.  Not thread-safe (Readiness holds a lock)."""

    def __init__(self, steady_requests: int = 5) -> None:
        self.steady_requests = steady_requests
        self.first: UserAnswer | None = None
        self.later: list[UserAnswer] = []
        self.figures: FirstUserFigures | None = None

    def add(self, answer: UserAnswer) -> FirstUserFigures | None:
        """One user answer; the figures when this one completed them (once)."""
        if self.figures is not None:
            return None
        if self.first is None:
            self.first = answer
            return None
        self.later.append(answer)
        if len(self.later) < self.steady_requests:
            return None
        self.figures = figures(self.first, self.later)
        return self.figures
