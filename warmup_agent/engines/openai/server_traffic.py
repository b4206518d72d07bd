"""Other clients' requests, as the supervised server's log shows them.

On a server that answers one request at a time, a probe sent during a user's answer
times that wait, so the watch loop skips probes while another client is active.  Each
agent request leaves a credit its own log line takes; a line without one is another
client's.  Credits lapse, so a server that logs no request lines hoards none.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable

from warmup_agent.server.kinds import REQUEST_LOG


class ServerTraffic:
    """`slack`: seconds a credit outlives its request (log lines are read a little late);
    `request_line`: a request's log line (the server kind's `request_log`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, slack: float = 0.5,
                 request_log: str = REQUEST_LOG) -> None:
        self._clock, self.slack = clock, slack
        self.request_line = re.compile(request_log)
        self._lock = threading.Lock()
        self._credits: list[list[float]] = []    # one per own request: [end time, inf while in flight]
        self._last_other: float | None = None
        self.others_seen = 0

    def own_started(self) -> list[float]:
        credit = [float("inf")]
        with self._lock:
            self._drop_lapsed(self._clock())
            self._credits.append(credit)
        return credit

    def own_ended(self, credit: list[float]) -> None:
        with self._lock:
            credit[0] = self._clock()

    def log_line(self, line: str) -> None:
        if not self.request_line.search(line):
            return
        with self._lock:
            self._drop_lapsed(self._clock())
            if self._credits:
                self._credits.pop(0)          # this line is ours
                return
            self._last_other = self._clock()
            self.others_seen += 1

    def _drop_lapsed(self, now: float) -> None:
        self._credits = [c for c in self._credits if now - c[0] <= self.slack]

    def others_within(self, seconds: float) -> float | None:
        """Seconds since another client's last request line, if at most `seconds`; else None."""
        with self._lock:
            if self._last_other is None:
                return None
            age = self._clock() - self._last_other
            return age if age <= seconds else None
