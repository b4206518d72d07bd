"""The users' real first request, computed once, here.

The first 200 the main engine gives a user after a gate opens is held, and the
`steady_requests` answers after it are its steady level:

  first user request tax (TTFT)  first TTFT / median later TTFT
  whole-answer tax               first whole answer / (steady TTFT + (first's tokens - 1)
                                 x median later time per output token)

The steady level is the users' own later answers, not the probes', so the figure is
what an outside client measures and a user with long prompts does not read as a cold
start.  Without token counts the whole-answer tax is None rather than a comparison of
answers of different lengths.
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
    """One gate's first user request.  Not thread-safe; Readiness holds a lock."""

    def __init__(self, steady_requests: int = 5, opened_at: float | None = None) -> None:
        self.steady_requests = steady_requests
        self.opened_at = opened_at      # when its gate opened (the state machine's clock)
        self.first: UserAnswer | None = None
        self.later: list[UserAnswer] = []
        self.figures: FirstUserFigures | None = None

    def add(self, answer: UserAnswer) -> FirstUserFigures | None:
        """Add one user answer; returns the figures once, when this one completes them."""
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
