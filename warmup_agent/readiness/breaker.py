"""The fallback breaker: closed -> open -> half-open -> closed.

  closed     the window's P90 over the tail threshold on `trip_after` consecutive
             samples trips it (cause "slow"), and so do `fail_after` failed probes in
             a row (cause: the failure's reason).
  open       the main path is frozen for `open_seconds`, or the failure's own freeze.
  half_open  probes reach the main engine again, each judged alone (the window still
             holds the samples that tripped it); `half_open_probes` good ones in a
             row close the breaker, one bad one re-opens it.

The breaker only decides; readiness.runtime moves the state machine and exports it.
The clock is injected so tests need not sleep.  State changes hold a lock.
"""
from __future__ import annotations

import enum
import threading
import time
from typing import Any


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    def __init__(self, trip_after: int = 3, open_seconds: float = 30.0, half_open_probes: int = 3,
                 clock: Any = time.monotonic, on_change: Any = None, fail_after: int = 1) -> None:
        self.trip_after, self.open_seconds, self.half_open_probes = trip_after, open_seconds, half_open_probes
        self.fail_after = fail_after
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.trips = 0
        self.opened_at: float | None = None
        #: Why the breaker is (or last was) open: "slow" or a failed probe's reason.
        self.cause: str | None = None
        #: The current freeze in seconds (open_seconds, or a failure's own).
        self.freeze = open_seconds
        self._over = 0          # consecutive over-threshold evaluations while closed
        self._failed = 0        # consecutive failed probes while closed
        self._good = 0          # consecutive good probes while half-open
        self._on_change = on_change or (lambda frm, to: None)
        self._lock = threading.RLock()

    def _move(self, to: BreakerState) -> None:
        frm, self.state = self.state, to
        self._over = self._good = self._failed = 0
        if to == BreakerState.OPEN:
            self.opened_at = self.clock()
        self._on_change(frm, to)

    @property
    def main_frozen(self) -> bool:
        """True while user traffic must not reach the main engine (open or half-open)."""
        return self.state != BreakerState.CLOSED

    def frozen_remaining(self) -> float:
        """Seconds until an open breaker lets probes through (0 when not open)."""
        if self.state != BreakerState.OPEN or self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.freeze - self.clock())

    def tick(self) -> BreakerState:
        """Open -> half-open once the freeze has elapsed.  Call before deciding to probe."""
        with self._lock:
            if self.state == BreakerState.OPEN and self.frozen_remaining() <= 0:
                self._move(BreakerState.HALF_OPEN)
            return self.state

    def closed_sample(self, p90_over: bool) -> bool:
        """Judge one closed-state sample; returns True if it tripped the breaker."""
        with self._lock:
            if self.state != BreakerState.CLOSED:
                return False
            self._failed = 0      # the engine answered
            self._over = self._over + 1 if p90_over else 0
            if self._over >= self.trip_after:
                self._trip("slow", self.open_seconds)
                return True
            return False

    def _trip(self, cause: str, freeze: float) -> None:
        self.cause, self.freeze = cause, freeze
        if self.state == BreakerState.CLOSED:
            self.trips += 1
        self._move(BreakerState.OPEN)

    def failure(self, cause: str, freeze: float | None = None) -> BreakerState:
        """Count a failed probe.  `freeze` overrides open_seconds for this failure."""
        with self._lock:
            freeze = self.open_seconds if freeze is None else freeze
            if self.state == BreakerState.CLOSED:
                self._failed += 1
                if self._failed >= self.fail_after:
                    self._trip(cause, freeze)
            elif self.state == BreakerState.HALF_OPEN:
                self._trip(cause, freeze)
            return self.state

    def half_open_now(self) -> bool:
        """Open -> half-open before the freeze ends; returns whether it moved."""
        with self._lock:
            if self.state != BreakerState.OPEN:
                return False
            self._move(BreakerState.HALF_OPEN)
            return True

    def reset(self) -> bool:
        """Close at once without a transition (a re-warm); returns whether it was not closed."""
        with self._lock:
            was = self.state != BreakerState.CLOSED
            self.state = BreakerState.CLOSED
            self._over = self._good = self._failed = 0
            return was

    def half_open_probe(self, over: bool) -> BreakerState:
        """Judge one half-open probe."""
        with self._lock:
            if self.state != BreakerState.HALF_OPEN:
                return self.state
            if over:
                self._trip("slow", self.open_seconds)
            else:
                self._good += 1
                if self._good >= self.half_open_probes:
                    self._move(BreakerState.CLOSED)
            return self.state
