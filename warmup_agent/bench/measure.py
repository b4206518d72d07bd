"""What a start measures once its server is ready, step by step in bench/start.py's
order, every request sent to what users reach (the server, or the agent's proxy).
Each figure goes into the start's record as soon as it is measured."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from warmup_agent.bench import client
from warmup_agent.bench.traffic import MIN_APART, Shape, Traffic

BEHIND_TIMEOUT = 60.0    # seconds the bench waits for the warm-up behind the users to finish
BEHIND_POLL = 0.1        # seconds between its reads of that while it waits

#: Reads the agent's warmup_behind_users_pending (1: requests left; None: unreadable).
Pending = Callable[[], float | None]


@dataclass
class Steady:
    """The steady requests' medians: what an answer of n tokens takes on a warm server."""
    ttft: float
    total: float
    tpot: float | None      # None where every steady answer was one chunk

    def total_for(self, a: client.Answer) -> float:
        """A steady answer as long as `a`: TTFT + (its tokens - 1) x time per token.  The
        first answer of a random or sampled model can run much longer than the steady
        ones; dividing by their plain median would count its length as cold start."""
        if self.tpot is None:
            return self.total
        return self.ttft + max(0, a.chunks - 1) * self.tpot

    def tax(self, a: client.Answer) -> dict[str, float | None]:
        return {"ttft": a.ttft / self.ttft, "total": a.total / self.total_for(a),
                "tpot": a.tpot / self.tpot if a.tpot is not None and self.tpot else None}


@dataclass
class Requests:
    """A start's requests: `send()` a new request of its shape (or of another) to `base`."""
    base: str
    model: str | None
    traffic: Traffic
    shape: Shape
    start: int              # the start's index: its new length is the same in every condition

    def send(self, shape: Shape | None = None) -> client.Answer:
        return client.stream_chat(self.base, self.model, self.traffic.request(shape or self.shape))


def first_and_steady(r: Requests, n: int, out: dict[str, Any], pending: Pending | None = None) -> Steady:
    """The first request, then `n` one by one, each noted as sent while `pending` read 1 or not."""
    first = r.send()
    out["first"] = first.as_dict()
    answers, during = [], []
    for _ in range(n):
        if pending is not None:
            during.append(pending() == 1)
        answers.append(r.send())
    tpots = [t for a in answers if (t := a.tpot) is not None]
    steady = Steady(statistics.median(a.ttft for a in answers), statistics.median(a.total for a in answers),
                    statistics.median(tpots) if tpots else None)
    tax = steady.tax(first)
    out.update(steady_ttft_seconds=steady.ttft, steady_total_seconds=steady.total, steady_tpot_seconds=steady.tpot,
               first_ttft_tax=tax["ttft"], first_total_tax=tax["total"], first_tpot_tax=tax["tpot"],
               steady_ttft_all_seconds=[a.ttft for a in answers])
    if pending is not None:
        out["steady_sent_while_behind"] = during
    return steady


def controls(r: Requests, steady: Steady, idle: float, out: dict[str, Any]) -> None:
    """After `idle` seconds of quiet: the warm control, then a prompt longer than any before it."""
    time.sleep(idle)
    warm = steady.tax(r.send())
    longer = r.send(r.traffic.longer(r.shape))
    out.update(warm_control_ttft_ratio=warm["ttft"], warm_control_total_ratio=warm["total"],
               new_length_ttft_ratio=longer.ttft / steady.ttft)


def burst(r: Requests, steady: Steady, n: int, out: dict[str, Any]) -> None:
    if n <= 1:
        return
    bodies = [r.traffic.request(r.shape) for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda b: client.stream_chat(r.base, r.model, b), bodies))
    ttft = statistics.median(a.ttft for a in answers)
    out.update(burst_ttft_median_seconds=ttft, burst_total_max_seconds=max(a.total for a in answers),
               burst_ttft_over_steady=ttft / steady.ttft)


def after_background(r: Requests, n: int, out: dict[str, Any], pending: Pending,
                     behind_seconds: Callable[[], float | None], timeout: float = BEHIND_TIMEOUT) -> None:
    """Wait until `pending` reads 0 (at most `timeout` s), then `n` requests one by one, the
    yardstick of those sent while it read 1."""
    t0 = time.monotonic()
    while not (finished := pending() == 0) and time.monotonic() - t0 < timeout:
        time.sleep(BEHIND_POLL)
    out.update(behind_users_finished=finished, behind_users_waited_seconds=time.monotonic() - t0,
               behind_users_seconds=behind_seconds() if finished else None)
    after = statistics.median(r.send().ttft for _ in range(n))
    sent_while = [t for t, p in zip(out["steady_ttft_all_seconds"], out.get("steady_sent_while_behind") or [],
                                    strict=False) if p]
    out.update(steady_after_background_ttft_seconds=after,
               background_user_ttft_over_steady=statistics.median(sent_while) / after if sent_while else None)


def new_length(r: Requests, out: dict[str, Any]) -> None:
    """A prompt length inside the traffic's range that this start has not sent, twice:
    the first TTFT over the second."""
    used = [r.shape.prompt_words, r.traffic.longer(r.shape).prompt_words]
    words = r.traffic.unused_length(r.start, used)
    if words is None:
        lo, hi = r.traffic.length_range()
        out["new_length_after_background"] = {"words": None, "why": f"no length within the traffic's {lo}-{hi} "
                                               f"words is {MIN_APART} words from this start's {used}"}
        out["new_length_after_background_ttft_tax"] = None
        return
    shape = r.traffic.at_length(r.shape, words)
    first, second = r.send(shape), r.send(shape)
    out["new_length_after_background"] = {
        "words": shape.prompt_words, "words_from_used": min(abs(words - u) for u in used),
        "first_ttft_seconds": first.ttft, "second_ttft_seconds": second.ttft}
    out["new_length_after_background_ttft_tax"] = first.ttft / second.ttft
