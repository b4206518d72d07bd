"""The probe log: every readiness probe, and the first-request figures computed from
them once, here.  docs/readiness.md describes the figures in full.

The gate's first probe stands for the pod's first user request.  Its control (same
shape, fresh prompt, same predecessor) says which part of that the server pays anyway,
warm or not:

  first-request tax (TTFT)  1 + max(0, first TTFT - control TTFT) / steady TTFT
  whole-answer tax          the same on the whole answer, over the steady whole answer
                            of the same number of output tokens

The steady level is the median of the probes after the first.  Without a control the
tax is the first probe over the steady level.  A start that skipped the pairs because
the server was measured before exports 1 + the remembered excess (`new_length`).

The figures are frozen when the gate opens (`freeze`): later watch probes do not change
what the first request met.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from warmup_agent.readiness.window import SlidingWindow
from warmup_agent.warmup.benefit import Call, Controlled

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
    #: cold_decode.first_answer's prediction, on a server that pays per decode length.
    cold_decode: dict | None = None
    #: The first probe's control (same shape, same predecessor); None: not sent.
    control: Call | None = None
    #: Remembered excess over the control ({"ttft", "total", "measured_at"}, fractions)
    #: where this start skipped the second fresh length; the taxes are 1 + those.
    new_length: dict | None = None

    @property
    def pair(self) -> Controlled | None:
        if self.control is None:
            return None
        return Controlled(Call(self.ttft_seconds, self.total_seconds, self.output_tokens, self.prompt_tokens), self.control)

    @property
    def ttft_tax(self) -> float | None:
        if self.new_length is not None:     # no steady level needed: a first probe alone has none
            return 1 + self.new_length["ttft"]
        if not self.steady_ttft_seconds:
            return None
        pair = self.pair
        return pair.ttft_tax(self.steady_ttft_seconds) if pair else self.ttft_seconds / self.steady_ttft_seconds

    @property
    def measured_total_tax(self) -> float | None:
        """The first probe's whole answer over the steady whole answer (less its control's excess)."""
        if not self.steady_total_seconds:
            return None
        pair = self.pair
        return pair.total_tax(self.steady_total_seconds) if pair else self.total_seconds / self.steady_total_seconds

    @property
    def total_tax(self) -> float | None:
        """The exported whole-answer tax: the cold-decode prediction, else the remembered
        excess, else the measured tax."""
        if self.cold_decode:
            return self.cold_decode["total_tax"]
        if self.new_length is not None:
            return 1 + self.new_length["total"]
        return self.measured_total_tax


def first_request(probes: list[Probe], first: int = 0, control: int | None = None) -> FirstRequest | None:
    """probes[first] against the probes after it, and against probes[control] if given."""
    if len(probes) <= first:
        return None
    head, later = probes[first], probes[first + 1:]
    steady_ttft = statistics.median(p.ttft for p in later) if later else None
    steady_total: float | None = None
    if later and all(p.output_tokens == head.output_tokens for p in later):
        steady_total = statistics.median(p.total for p in later)
    elif steady_ttft is not None:
        tpots = [t for p in later if (t := p.tpot) is not None]
        if head.output_tokens < 2:
            steady_total = steady_ttft
        elif tpots:
            steady_total = steady_ttft + (head.output_tokens - 1) * statistics.median(tpots)
    ctl = probes[control] if control is not None and control < len(probes) else None
    return FirstRequest(head.ttft, head.total, head.output_tokens, head.prompt_tokens, steady_ttft, steady_total,
                        control=ctl)


class ProbeLog:
    """Every probe in order, the decode window, and the first-request figures of the
    current gate (from `restart` to `freeze`)."""

    def __init__(self, decode_window_size: int = 100) -> None:
        self.probes: list[Probe] = []
        #: Time per output token of the probes: (total - first token) / (output tokens - 1).
        self.decode = SlidingWindow(decode_window_size)
        self._start = 0                     # index of the current gate's first probe
        self._pair: tuple[int, int] | None = None   # (first, control) within the gate's probes
        self._frozen: FirstRequest | None = None
        self._frozen_at: int | None = None
        self._new_length: dict | None = None   # FirstRequest.new_length of the current gate

    def add(self, probe: Probe) -> None:
        self.probes.append(probe)

    def add_decode(self, probe: Probe) -> bool:
        """Add a probe's time per output token to the decode window; False for a
        one-token answer."""
        if probe.output_tokens <= 1:
            return False
        self.decode.add((probe.total - probe.ttft) / (probe.output_tokens - 1))
        return True

    def restart(self) -> None:
        """A new gate (a re-warm): its next probe is a first request again."""
        self._start = len(self.probes)
        self._pair = None
        self._frozen = None
        self._frozen_at = None
        self._new_length = None

    def pair(self, first: int, control: int) -> Controlled:
        """Make gate_probes[first] and [control] the pair the figures come from."""
        self._pair = (first, control)
        probes = self.gate_probes
        return Controlled(probes[first], probes[control])

    def remembered_new_length(self, excess: dict) -> None:
        """Take the figures from a remembered `excess` (FirstRequest.new_length)."""
        self._new_length = dict(excess)

    def freeze(self, cold_decode: Callable[[FirstRequest, list[Probe]], dict | None] | None = None) -> FirstRequest | None:
        """Fix the figures to the gate's probes so far.  `cold_decode(figures, probes)`
        predicts the first user's whole answer where the server pays per decode length."""
        self._frozen_at = len(self.probes)
        figures = self._figures()
        if figures is not None and cold_decode is not None:
            figures = replace(figures, cold_decode=cold_decode(figures, self.gate_probes))
        self._frozen = figures
        return figures

    @property
    def gate_start(self) -> int:
        """Index in `probes` of the current gate's first probe."""
        return self._start

    @property
    def gate_probes(self) -> list[Probe]:
        """The probes of the current gate (up to the one that opened it, once open)."""
        end = len(self.probes) if self._frozen_at is None else self._frozen_at
        return self.probes[self._start:end]

    @property
    def figures(self) -> FirstRequest | None:
        return self._frozen if self._frozen_at is not None else self._figures()

    def _figures(self) -> FirstRequest | None:
        first, control = self._pair if self._pair is not None else (0, None)
        figures = first_request(self.gate_probes, first, control)
        return replace(figures, new_length=self._new_length) if figures is not None and self._new_length else figures

    @property
    def ttfts(self) -> list[float]:
        return [p.ttft for p in self.probes]

    @property
    def totals(self) -> list[float]:
        return [p.total for p in self.probes]
