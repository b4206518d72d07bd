"""Other clients' requests, as the supervised server's own log shows them.

A server that answers one request at a time (`transformers serve`; llama.cpp with one
slot) makes a probe sent during a user's answer wait for the whole answer: the window
would then describe the agent's own wait, which no user met, and fire first-token alerts
on a healthy pod (docs/benchmarks.md, "Probes beside a busy server").  So the watch loop
skips a probe while another client's request line is recent.

Each request the agent sends leaves a credit that its own log line takes; a request line
that finds no credit is another client's.  A credit lapses `slack` seconds after its
request ended, so a server that logs no request lines hoards none.  A server the agent
did not start has no log here: its probes go on.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable

from warmup_agent.server.kinds import REQUEST_LOG

REQUEST_LINE = re.compile(REQUEST_LOG)


class ServerTraffic:
    """`slack`: seconds after one of the agent's requests ends during which its credit
    still stands (a log line is read a little after it is written)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, slack: float = 0.5) -> None:
        self._clock, self.slack = clock, slack
        self._lock = threading.Lock()
        self._credits: list[list[float]] = []    # one per own request: [end time, inf while in flight]
        self._last_other: float | None = None
        self.others_seen = 0

    def own_started(self) -> list[float]:
        credit = [float("inf")]
        with self._lock:
            self._drop_lapsed(self._clock())    # a server with no log never takes them
            self._credits.append(credit)
        return credit

    def own_ended(self, credit: list[float]) -> None:
        with self._lock:
            credit[0] = self._clock()

    def log_line(self, line: str) -> None:
        if not REQUEST_LINE.search(line):
            return
        with self._lock:
            self._drop_lapsed(self._clock())
            if self._credits:
                self._credits.pop(0)          # the oldest of our requests: this line is ours
                return
            self._last_other = self._clock()
            self.others_seen += 1

    def _drop_lapsed(self, now: float) -> None:
        self._credits = [c for c in self._credits if now - c[0] <= self.slack]

    def others_within(self, seconds: float) -> float | None:
        """Seconds since the last request line of another client, if it is at most
        `seconds` old; None otherwise."""
        with self._lock:
            if self._last_other is None:
                return None
            age = self._clock() - self._last_other
            return age if age <= seconds else None
