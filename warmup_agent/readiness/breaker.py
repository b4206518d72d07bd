"""The fallback breaker (seed 000 §4.4, seed 003): closed -> open -> half-open -> closed.

  closed     every sample goes into the window; the window's P90 over the tail
             threshold on `trip_after` consecutive samples trips the breaker
             (cause "slow"), and so do `fail_after` failed probes in a row (cause
             the failure's reason: unreachable, timeout, server_error, bad_answer).
  open       main path frozen: fallback active, no probes and no user traffic to
             the main engine.  The freeze is `open_seconds`, or the one the owner
             gave for the failure (readiness.runtime re-probes an unreachable
             server at the next watch interval).
  half_open  after the freeze, probes go to the main engine again; each is judged
             alone against the tail threshold (the window still holds the slow
             samples that tripped it, so it starts empty).  `half_open_probes`
             good probes in a row close the breaker; one slow or failed probe
             re-opens it.

The breaker only decides; its owner (readiness.runtime) moves the state machine
(SERVING -> DEGRADED on trip, DEGRADED -> SERVING on close) and exports it.
Time comes from an injected clock, so the logic is tested without sleeping.
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
        """While closed: one sample was added and the window's P90 is (not) over the
        tail threshold.  Returns True if this evaluation tripped the breaker."""
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
        """A probe of the main engine failed (no answer, an error status, a broken
        stream) with the named `cause`.  Closed: `fail_after` in a row trip the
        breaker; half-open: re-opens it.  `freeze`: how long this failure freezes
        the main path (default open_seconds)."""
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
        """Open -> half-open before the freeze ends (the owner saw the engine answer
        again).  Returns whether it moved."""
        with self._lock:
            if self.state != BreakerState.OPEN:
                return False
            self._move(BreakerState.HALF_OPEN)
            return True

    def reset(self) -> bool:
        """Closed at once, without a transition (a re-warm judges the engine afresh).
        Returns whether it was not closed."""
        with self._lock:
            was = self.state != BreakerState.CLOSED
            self.state = BreakerState.CLOSED
            self._over = self._good = self._failed = 0
            return was

    def half_open_probe(self, over: bool) -> BreakerState:
        """While half-open: one probe of the main engine, over the threshold or not."""
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
