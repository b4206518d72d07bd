"""Other clients' requests, as the supervised server's own log shows them.

Why: after SERVING the agent keeps probing every few seconds. A server that answers
one request at a time (`transformers serve`; llama.cpp with one slot) makes a probe
that arrives during a user's answer wait for the whole answer. On the H200, probes
sent while an outside client streamed 48-token answers from `transformers serve`
read 1.48 s to first token against 45 ms when the server was idle: the window's P99
and the engine-busy seconds then described the agent's own wait, which no user met,
and a healthy pod fired WarmupAgentFirstTokenSLOBreach (all 5 starts) and
WarmupAgentCostRatioHigh (1 start).

uvicorn's access line (`transformers serve`, vLLM, SGLang) carries each request's
method and path, and so does llama.cpp's `request: POST /v1/...` line where it is
logged: older builds log it by default, the vendored 0.3.36 tree only at its trace
level. llama.cpp serves a probe in a slot of its own beside users anyway (H200 runs:
no alert), so its probes go on.
Each request the agent sends leaves a credit that its own line takes; a request line
that finds no credit is another client's. A credit lapses `slack` seconds after its
request ended (llama.cpp writes its line then), so a server that logs none of them
does not hoard credits. Two lines that cross (a user's line taking the credit of a
probe in flight) still count one line as another client's. The watch loop skips a
probe while such a line is recent. A server the agent did not start has no log here:
its probes go on as before.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable

REQUEST_LINE = re.compile(r"POST /v1/(?:chat/)?completions\b")


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
