"""The probe log: every readiness probe, and the first-request figures computed
once, here, from them (issues 30, 40).

The gate's first probe stands for the pod's first user request, and its control
(the same shape, a fresh prompt, sent after the same predecessor: the ready stage
re-sends the last warmup requests first where they were longer or more at once)
says which part of it the server pays anyway (benefit.Controlled): on llama.cpp a
request right after a much longer one, or after concurrent ones, pays 60-100 ms
more in its slot, warm or not.  The probes after the control give the steady level.
  first-request tax (TTFT)  1 + (first probe's TTFT - its control's, never below 0)
                            / steady TTFT,
                            the steady TTFT being the median of the probes after
                            the first (the control among them)
  whole-answer tax          the same on the whole answer, over the steady whole
                            answer of the same length: the median of the later
                            probes' whole answers when they have as many output
                            tokens, else steady TTFT + (tokens - 1) x median steady
                            time per output token
Where a first probe was cold beyond its control, the gate sends another pair.  The
figures are the last pair's (the first probe paid a one-time cost for everyone: a
user meets the state after it), except where prewarm's per-length test found that
each new prompt length pays once: then a user's first request, at a length no
request reached, meets what the first pair's first probe met, and the figures stay
the first pair's.
A start that skipped the pairs because this server was measured before
(warmup/findings.py) exports what the second fresh length paid then, over its
control: 1 + the remembered excess (`FirstRequest.new_length`); its own first probe
holds the start's one-time costs too, which no user meets.
Such a start sends its first probe alone (no control, no later probe before SERVING:
stages/prewarm.py, first_probe_alone), so it has no steady level of its own; its figures
need none.
Without a control (a gate of one probe), the first probe over the steady level.
On a server that pays per decode length, the whole-answer tax is the one a
user's first request meets after the probes have warmed their own lengths
(warmup_agent/readiness/cold_decode.py); `measured_total_tax` keeps the first probe's.
The figures are frozen when the gate opens (`freeze`): probes after SERVING
(one token each, to keep the window fresh) do not change what the first
request met.  With a single probe there is no steady level and both are None.
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
    #: A server that pays per decode length: the first user's whole answer predicted
    #: (cold_decode.first_answer's dict, its "total_tax" and what it was made of).
    cold_decode: dict | None = None
    #: The first probe's control (same shape, same predecessor); None: not sent.
    control: Call | None = None
    #: Where this start skipped the second fresh length (warmup/findings.py): what it paid
    #: beyond its control when the server was measured ({"ttft", "total": fractions of the
    #: control's times, "measured_at"}): the exported taxes are 1 + those.
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
        """The exported whole-answer tax: the cold-decode prediction where there is one,
        the remembered new-length excess where the second pair was skipped."""
        if self.cold_decode:
            return self.cold_decode["total_tax"]
        if self.new_length is not None:
            return 1 + self.new_length["total"]
        return self.measured_total_tax


def first_request(probes: list[Probe], first: int = 0, control: int | None = None) -> FirstRequest | None:
    """The first-request figures of `probes`: probes[first] against the probes after
    it, and against probes[control] (its control) when given."""
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
    """Every probe, in order (a re-warm's too); the decode window (time per output
    token of the probes that decoded); the first-request figures of the current
    gate: from its first probe (`restart`) to the one that opened it (`freeze`)."""

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
        """Put a probe's time per output token, the interval between streamed tokens,
        into the decode window; False (nothing added) for a one-token answer."""
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
        """The gate's probes `first` and `control` (indices within gate_probes) are a
        first and its control, and the first-request figures are theirs."""
        self._pair = (first, control)
        probes = self.gate_probes
        return Controlled(probes[first], probes[control])

    def remembered_new_length(self, excess: dict) -> None:
        """This gate skipped the second fresh length (warmup/findings.py): its figures are
        1 + `excess` (FirstRequest.new_length), not its first pair's."""
        self._new_length = dict(excess)

    def freeze(self, cold_decode: Callable[[FirstRequest, list[Probe]], dict | None] | None = None) -> FirstRequest | None:
        """Fix the first-request figures to the gate's probes so far (the gate opened).
        `cold_decode(figures, gate probes)`: on a server that pays per decode length,
        the first user's whole answer predicted from them (readiness/cold_decode.py)."""
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
