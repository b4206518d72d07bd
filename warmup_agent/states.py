"""The warmup state machine (seed 000 §3.3).

    INIT -> PRELOAD -> PRIME -> SERVING,  plus DEGRADED, SLEEPING, DRAINING, FAILED.

States are an ordered enum: the order is the order of a normal warmup, and the
states from DRAINING on are terminal for the pod (no way back to serving).
`TRANSITIONS` is the one table of legal moves; anything else is rejected,
logged and counted with `from`/`to` labels, and never applied.

The seed names seven illegal jumps among the four warmup states; with the table
below they are exactly: INIT->PRIME, INIT->SERVING, PRELOAD->INIT,
PRELOAD->SERVING, PRIME->INIT, SERVING->INIT, SERVING->PRIME.  (PRIME->PRELOAD
and SERVING->PRELOAD are legal: an engine restart reloads the model.)
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from exporter.recorder import FailureStats, Known, StateStats
from warmup_agent.failures import REASONS
from warmup_agent.periodic import Periodic

if TYPE_CHECKING:
    from exporter.recorder import Recorder

log = logging.getLogger("warmup_agent.states")


class State(enum.IntEnum):
    INIT = 0
    PRELOAD = 1
    PRIME = 2
    SERVING = 3
    DEGRADED = 4      # fallback active, main path frozen (breaker open)
    SLEEPING = 5      # the server sleeps as its operator asked (not an outage)
    DRAINING = 6      # terminal marker: from here on the pod only winds down
    FAILED = 7

    @property
    def terminal(self) -> bool:
        return self >= State.DRAINING


# The one source of state names outside this module: warmup_state's `state` label
# values, in warmup order (dashboards/generate.py, alerts/generate.py read these).
STATE_NAMES: tuple[str, ...] = tuple(s.name for s in State)
# The states of a warmup still under way (not yet SERVING, not terminal).
WARMING: tuple[State, ...] = (State.INIT, State.PRELOAD, State.PRIME)

TRANSITIONS: dict[State, frozenset[State]] = {
    State.INIT: frozenset({State.PRELOAD, State.FAILED, State.DRAINING}),
    State.PRELOAD: frozenset({State.PRIME, State.FAILED, State.DRAINING}),
    State.PRIME: frozenset({State.SERVING, State.PRELOAD, State.FAILED, State.DRAINING}),
    State.SERVING: frozenset({State.DEGRADED, State.PRELOAD, State.SLEEPING, State.DRAINING, State.FAILED}),
    State.DEGRADED: frozenset({State.SERVING, State.PRELOAD, State.DRAINING, State.FAILED}),
    State.SLEEPING: frozenset({State.SERVING, State.PRELOAD, State.DEGRADED, State.DRAINING, State.FAILED}),
    State.DRAINING: frozenset(),
    State.FAILED: frozenset(),
}

# The seed's seven illegal jumps (see module docstring); tests assert each is rejected.
SEED_ILLEGAL = (
    (State.INIT, State.PRIME), (State.INIT, State.SERVING), (State.PRELOAD, State.INIT),
    (State.PRELOAD, State.SERVING), (State.PRIME, State.INIT), (State.SERVING, State.INIT),
    (State.SERVING, State.PRIME),
)


def illegal_pairs() -> list[tuple[State, State]]:
    """Every move between two different states that the table rejects, from a
    state that is not terminal (the seed's seven among them): the label pairs of
    warmup_illegal_transitions_total that the agent exports as 0 from start-up."""
    return [(frm, to) for frm in State if not frm.terminal
            for to in State if to != frm and to not in TRANSITIONS[frm]]


class StateMachine:
    """Holds the current state, applies legal transitions, enforces deadlines.

    `deadlines` maps a state to the seconds the agent may stay in it (0 or
    missing: no deadline).  `check_deadline()` fails the machine with reason
    "<state>_deadline_exceeded" once the time is up; `start_watchdog()` calls it
    from a daemon thread so a stuck stage cannot hold the pod forever.
    """

    def __init__(self, recorder: Recorder | None = None, deadlines: dict[State, float] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._recorder = recorder
        self._deadlines = {s: d for s, d in (deadlines or {}).items() if d and d > 0}
        self._clock = clock
        self._lock = threading.RLock()
        self.state = State.INIT
        self.entered_at = clock()
        self.history: list[tuple[State, float]] = [(State.INIT, self.entered_at)]
        self.failure_reason: str | None = None
        self.failure_message: str | None = None
        self.fingerprint: str | None = None   # weight fingerprint taken at PRELOAD
        self._listeners: list[Callable[[State, State], None]] = []
        self._before: list[Callable[[State, State], None]] = []
        self._watchdog: Periodic | None = None
        if recorder is not None:
            recorder.declare_series(Known(
                states=STATE_NAMES, initial_state=State.INIT.name, failure_reasons=tuple(REASONS),
                illegal_transitions=[(frm.name, to.name) for frm, to in illegal_pairs()]))

    def begin(self, at: float) -> None:
        """The warmup starts now: INIT (and its deadline) counts from `at`."""
        with self._lock:
            if self.state == State.INIT:
                self.entered_at = at
                self.history[0] = (State.INIT, at)

    # -- observers -------------------------------------------------------------------
    def on_change(self, fn: Callable[[State, State], None]) -> None:
        self._listeners.append(fn)

    def before_change(self, fn: Callable[[State, State], None]) -> None:
        """`fn(frm, to)` runs inside the lock before readers see `to`: keep it short."""
        self._before.append(fn)

    def _record(self, s: StateStats | FailureStats) -> None:
        if self._recorder is None:
            return
        if isinstance(s, StateStats):
            self._recorder.state(s)
        else:
            self._recorder.failure(s)

    # -- transitions -----------------------------------------------------------------
    def can(self, to: State) -> bool:
        return to in TRANSITIONS[self.state]

    def transition(self, to: State) -> bool:
        """Apply `to` if the table allows it; otherwise reject, log and count it.
        Returns whether it was applied."""
        with self._lock:
            frm = self.state
            if to not in TRANSITIONS[frm]:
                log.warning("illegal state transition %s -> %s rejected", frm.name, to.name)
                self._record(StateStats(frm.name, rejected=to.name))
                return False
            for fn in self._before:
                fn(frm, to)
            self.entered_at = self._clock()
            self.history.append((to, self.entered_at))   # before the state: readers see its time with it
            self.state = to
            self._record(StateStats(to.name, before=frm.name))
        log.info("state %s -> %s", frm.name, to.name)
        for fn in self._listeners:
            fn(frm, to)
        return True

    def fail(self, reason: str, message: str = "") -> None:
        """Move to FAILED with a named reason (counted in model_loading_failures_total).
        The first failure wins; later calls only log."""
        with self._lock:
            if self.state == State.FAILED:
                return
            self.failure_reason = reason
            self.failure_message = message or reason
            self._record(FailureStats(reason))
            self.transition(State.FAILED)

    def record_fingerprint(self, fingerprint: str) -> None:
        """Taken at PRELOAD, once the weights are loaded."""
        self.fingerprint = fingerprint

    def serve(self, fingerprint_now: str) -> bool:
        """PRIME -> SERVING, only if the weights still match the PRELOAD fingerprint."""
        with self._lock:
            if self.fingerprint is not None and fingerprint_now != self.fingerprint:
                self.fail("weight_fingerprint_mismatch",
                          f"weights changed between PRELOAD and SERVING (fingerprint {self.fingerprint[:12]} -> {fingerprint_now[:12]})")
                return False
            return self.transition(State.SERVING)

    # -- deadlines ---------------------------------------------------------------------
    def deadline_remaining(self) -> float | None:
        """Seconds left in the current state, or None without a deadline."""
        limit = self._deadlines.get(self.state)
        if limit is None:
            return None
        return limit - (self._clock() - self.entered_at)

    def check_deadline(self) -> str | None:
        """Fail the machine if the current state's deadline has passed; return the reason."""
        with self._lock:
            remaining = self.deadline_remaining()
            if remaining is None or remaining > 0 or self.state.terminal:
                return None
            state = self.state
            reason = f"{state.name.lower()}_deadline_exceeded"
            self._record(StateStats(state.name, deadline_exceeded=True))
            self.fail(reason, f"{state.name} took longer than its deadline of {self._deadlines[state]:g} s")
            return reason

    def start_watchdog(self, interval: float = 0.05) -> None:
        """Check the deadline every `interval` seconds; a re-warm starts it again
        after the first run stopped it, and a second start replaces the first."""
        if self._watchdog is not None:
            self._watchdog.stop()
        self._watchdog = Periodic(interval, self.check_deadline, name="state-deadline-watchdog")
        self._watchdog.start()

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop(timeout=1)
