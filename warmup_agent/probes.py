"""The probe log: every readiness probe, and the first-request figures computed
once, here, from them (issue 30).

The first probe after warmup stands for the pod's first user request; the
probes after it (same prompt length, fresh prompts) give the steady level.
  first-request tax (TTFT)  first probe's TTFT / median TTFT of the later probes
  whole-answer tax          first probe's whole answer / the steady whole answer
                            of the same length: the median of the later probes'
                            whole answers when they have as many output tokens,
                            else steady TTFT + (tokens - 1) x median steady time
                            per output token (later probes may be shorter, to
                            keep readiness cheap on a slow server)
On a server that pays per decode length, the whole-answer tax is the one a
user's first request meets after the probes have warmed their own lengths
(warmup_agent/cold_decode.py); `measured_total_tax` keeps the first probe's.
The figures are frozen when the gate opens (`freeze`): probes after SERVING
(one token each, to keep the window fresh) do not change what the first
request met.  With a single probe there is no steady level and both are None.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from warmup_agent.benefit import Call
from warmup_agent.readiness.window import SlidingWindow

# A probe is timed like a warmup call: TTFT, whole answer, tokens, prompt length.
Probe = Call


@dataclass(frozen=True)
class FirstRequest:
    ttft_seconds: float
    total_seconds: float
    output_tokens: int
    prompt_tokens: int
    steady_ttft_seconds: float | None
    steady_total_seconds: float | None
    #: A server that pays per decode length: the first user's whole answer predicted
    #: (cold_decode.first_answer's dict, its "total_tax" and what it was made of).
    cold_decode: dict | None = None

    @property
    def ttft_tax(self) -> float | None:
        return self.ttft_seconds / self.steady_ttft_seconds if self.steady_ttft_seconds else None

    @property
    def measured_total_tax(self) -> float | None:
        """The first probe's whole answer over the steady whole answer."""
        return self.total_seconds / self.steady_total_seconds if self.steady_total_seconds else None

    @property
    def total_tax(self) -> float | None:
        """The exported whole-answer tax: the cold-decode prediction where there is one."""
        return self.cold_decode["total_tax"] if self.cold_decode else self.measured_total_tax


def first_request(probes: list[Probe]) -> FirstRequest | None:
    """The first-request figures of `probes` (the first one against the rest)."""
    if not probes:
        return None
    first, later = probes[0], probes[1:]
    steady_ttft = statistics.median(p.ttft for p in later) if later else None
    steady_total: float | None = None
    if later and all(p.output_tokens == first.output_tokens for p in later):
        steady_total = statistics.median(p.total for p in later)
    elif steady_ttft is not None:
        tpots = [t for p in later if (t := p.tpot) is not None]
        if first.output_tokens < 2:
            steady_total = steady_ttft
        elif tpots:
            steady_total = steady_ttft + (first.output_tokens - 1) * statistics.median(tpots)
    return FirstRequest(first.ttft, first.total, first.output_tokens, first.prompt_tokens, steady_ttft, steady_total)


class ProbeLog:
    """Every probe, in order (a re-warm's too); the decode window (time per output
    token of the probes that decoded); the first-request figures of the current
    gate: from its first probe (`restart`) to the one that opened it (`freeze`)."""

    def __init__(self, decode_window_size: int = 100) -> None:
        self.probes: list[Probe] = []
        #: Time per output token of the probes: (total - first token) / (output tokens - 1).
        self.decode = SlidingWindow(decode_window_size)
        self._start = 0                     # index of the current gate's first probe
        self._frozen: FirstRequest | None = None
        self._frozen_at: int | None = None

    def add(self, probe: Probe) -> None:
        self.probes.append(probe)

    def add_decode(self, probe: Probe) -> bool:
        """Put a probe's time per output token, the interval between streamed tokens,
        into the decode window; False (nothing added) for a one-token answer."""
        if probe.output_tokens <= 1:
            return False
        self.decode.add((probe.total - probe.ttft) / (probe.output_tokens - 1))
        return True

    def restart(self) -> None:
        """A new gate (a re-warm): its next probe is a first request again."""
        self._start = len(self.probes)
        self._frozen = None
        self._frozen_at = None

    def freeze(self, cold_decode: Callable[[FirstRequest, list[Probe]], dict | None] | None = None) -> FirstRequest | None:
        """Fix the first-request figures to the gate's probes so far (the gate opened).
        `cold_decode(figures, gate probes)`: on a server that pays per decode length,
        the first user's whole answer predicted from them (cold_decode.py)."""
        self._frozen_at = len(self.probes)
        figures = first_request(self.gate_probes)
        if figures is not None and cold_decode is not None:
            figures = replace(figures, cold_decode=cold_decode(figures, self.gate_probes))
        self._frozen = figures
        return figures

    @property
    def gate_probes(self) -> list[Probe]:
        """The probes of the current gate (up to the one that opened it, once open)."""
        end = len(self.probes) if self._frozen_at is None else self._frozen_at
        return self.probes[self._start:end]

    @property
    def figures(self) -> FirstRequest | None:
        return self._frozen if self._frozen_at is not None else first_request(self.gate_probes)

    @property
    def ttfts(self) -> list[float]:
        return [p.ttft for p in self.probes]

    @property
    def totals(self) -> list[float]:
        return [p.total for p in self.probes]
