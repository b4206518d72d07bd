"""The server's life after SERVING: restarts, hangs, sleep and wake.

Every watch interval `ServerLife.watch()` says what to do, from reads that give the
server no task (a probe is a task: it resets a sleeping server's idle timer):

  PROBE    awake, same process: probe as usual.
  WAIT     send nothing now: asleep, watched by reads alone, or unreachable.
  REWARM   cold: a new process, or it woke.  The agent warms it before SERVING.

Sleep is a state of the pod (SLEEPING), not an outage: nothing is probed, and a wake
is warmed before the pod is SERVING again.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from exporter.recorder import Known, LifeStats, Recorder
from warmup_agent.readiness.breaker import Breaker, BreakerState
from warmup_agent.states import State, StateMachine

if TYPE_CHECKING:
    from warmup_agent.server.signals import ServerSignals

log = logging.getLogger("warmup_agent.readiness.life")

Action = Literal["probe", "wait", "rewarm"]
#: Two reads of one process's start time agree within this: one source read twice differs
#: by nothing or rounding (the clock ticks are 10 ms).  Not more: a server restarted within
#: a second of the last (a CPU llama-server re-warms in 0.5 s) is a new process.
SAME_PROCESS_SECONDS = 0.05
_WORDS = {"unreachable": "connection refused or reset", "timeout": "no answer in time",
          "server_error": "not 200"}


class Judge(Protocol):
    """What the life watch asks of readiness (runtime.Readiness is one)."""
    breaker: Breaker

    def probe_failure(self, cause: str, message: str) -> str: ...

    def server_answered(self) -> None: ...

    def health_answered(self) -> None: ...


@dataclass
class Wake:
    """A wake under way: when it started (clock seconds) and why."""
    cause: str
    started: float


class ServerLife:
    """`sleeps_when_idle`: the server sleeps after an idle time, so it is watched by
    reads only.  Without `has_fallback` or `holds_users`, users' requests reach the
    sleeping server and the first pays its reload; with `holds_users` the proxy holds
    them while the wake is warmed (a wake is a start)."""

    def __init__(self, signals: ServerSignals, sm: StateMachine, readiness: Judge, recorder: Recorder,
                 sleeps_when_idle: bool, ready_while_asleep: bool, has_fallback: bool,
                 clock: Callable[[], float] = time.monotonic, holds_users: bool = False):
        self.signals = signals
        self.sm = sm
        self.readiness = readiness
        self.recorder = recorder
        self.sleeps_when_idle = sleeps_when_idle
        self.ready_while_asleep = ready_while_asleep
        self.has_fallback = has_fallback
        self.holds_users = holds_users
        self.clock = clock
        self.identity: float | None = None     # the serving process's start time, once read
        self.wake: Wake | None = None          # under way until SERVING again
        self._awaiting_user = False            # the users' first request after the latest wake
        self.last_wake_seconds: float | None = None
        self._asleep_at: float | None = None
        self.unhealthy = False                 # the last watch found /health failing
        self._lock = threading.Lock()
        #: Set by the agent: start a re-warm now, not at the next tick.
        self.start_rewarm: Callable[[str], None] = lambda why: None
        recorder.declare_series(Known(life=True))
        sm.on_change(self._state_moved)

    # -- what the proxy and /readyz ask ---------------------------------------------------
    @property
    def users_wake_it(self) -> bool:
        """Users' requests go to the sleeping server, which wakes on them."""
        kind = self.signals.kind
        return (self.ready_while_asleep and not self.has_fallback and not self.holds_users
                and kind is not None and kind.wakes_on_request)

    def main_open(self) -> bool:
        """While SLEEPING, or warming after a wake: may users reach the main server?"""
        state = self.sm.state
        if state == State.SLEEPING:
            return self.users_wake_it
        return self.wake is not None and state in (State.PRELOAD, State.PRIME) and self.users_wake_it

    def ready(self) -> bool:
        """/readyz beyond SERVING: asleep or waking, where readiness.ready_while_asleep."""
        state = self.sm.state
        if state == State.SLEEPING:
            return self.ready_while_asleep
        return self.wake is not None and state in (State.PRELOAD, State.PRIME) and self.ready_while_asleep

    # -- the watch loop --------------------------------------------------------------------
    def watch(self) -> Action:
        state = self.sm.state
        if state not in (State.SERVING, State.DEGRADED, State.SLEEPING):
            return "wait"
        self._count_asleep()
        cause = self.signals.health()
        self.unhealthy = cause is not None
        if cause is not None:
            self.readiness.probe_failure(cause, f"GET {self.signals.url}{self.signals.health_path}: {_WORDS[cause]}")
            return "wait"
        restart = self._restarted()
        if restart is None:
            self.readiness.health_answered()
        if restart is not None:
            log.warning("the model server restarted (%s): it is cold, warming it again before SERVING",
                        restart.replace("_", " "))
            self.recorder.life(LifeStats(restart=restart))
            return "rewarm"
        if self.signals.kind is not None and self.signals.kind.can_sleep:
            sleeping = self.signals.sleeping()
            if state == State.SLEEPING:
                if sleeping is False:
                    self._woke("other")
                    return "rewarm"
                return "wait"
            if sleeping and state == State.SERVING:
                self._fell_asleep()
                return "wait"
        if self.sleeps_when_idle:
            self.readiness.server_answered()
            return "wait"
        return "probe"

    def remember_identity(self) -> None:
        """Read the serving process's start time now (at SERVING), so that a restart
        before the first watch tick is a new start time, not the first one read."""
        self.identity = self.signals.identity()

    def _restarted(self) -> str | None:
        """How a restart shows: "start_time", "came_back" (answering after unreachable) or None.

        An identity that could not be read (None) is unknown, never a restart by itself."""
        now = self.signals.identity()
        before = self.identity
        if self.identity is None:
            self.identity = now
        breaker = self.readiness.breaker
        came_back = breaker.state != BreakerState.CLOSED and breaker.cause == "unreachable"
        if now is not None and before is not None and abs(now - before) > SAME_PROCESS_SECONDS:
            return "start_time"
        if came_back and (now is None or before is None):
            return "came_back"
        return None

    # -- sleep and wake --------------------------------------------------------------------
    def _fell_asleep(self) -> bool:
        """SERVING -> SLEEPING, once (the watch and a wake call may both see it)."""
        with self._lock:
            if self.sm.state != State.SERVING:
                return False
            self._asleep_at = self.clock()
            self.sm.transition(State.SLEEPING)
        log.info("the model server sleeps (its operator asked it to when idle): SLEEPING, no probes until it wakes")
        self.recorder.life(LifeStats(sleeping=True))
        return True

    def _count_asleep(self) -> None:
        with self._lock:
            if self._asleep_at is None:
                return
            now = self.clock()
            seconds, self._asleep_at = now - self._asleep_at, (now if self.sm.state == State.SLEEPING else None)
        self.recorder.life(LifeStats(asleep_seconds=seconds, sleeping=self._asleep_at is not None))

    def _woke(self, cause: str) -> bool:
        """A wake starts now (or was seen now); False when one is already under way."""
        with self._lock:
            if self.wake is not None:
                return False
            self.wake = Wake(cause, self.clock())
            self._awaiting_user = True
        self._count_asleep()
        log.info("the model server wakes (%s): warming it before SERVING", cause)
        self.recorder.life(LifeStats(wake_cause=cause, sleeping=False))
        return True

    def request_wake(self) -> bool:
        """POST /admin/wake: wake a sleeping server and warm it.  The server's own word
        decides, read now: it may have fallen asleep since the last watch.  False unless
        it sleeps."""
        kind = self.signals.kind
        if (self.sm.state == State.SERVING and kind is not None and kind.can_sleep
                and self.signals.sleeping() is True):
            self._fell_asleep()
        if self.sm.state != State.SLEEPING or not self._woke("ahead"):
            return False
        self.start_rewarm("wake")
        return True

    def wake_server(self) -> None:
        """Call the kind's wake endpoint, if any, before the wake's warm."""
        if self.wake is not None:
            self.signals.wake()

    def user_request(self) -> None:
        """A user request arrived at the proxy: while asleep it starts a wake."""
        if self.sm.state == State.SLEEPING and self._woke("request"):
            self.start_rewarm("wake")

    def user_answer(self, ttft: float) -> None:
        """Record the first user answer since the wake started."""
        with self._lock:
            if not self._awaiting_user:
                return
            self._awaiting_user = False
        self.recorder.life(LifeStats(wake_first_user_seconds=ttft))
        log.info("the users' first request after the wake: time to first token %.1f ms", ttft * 1000)

    def warm_in_seconds(self) -> float | None:
        """What /admin/wake promises: the latest wake's duration, None before one."""
        return self.last_wake_seconds

    def _state_moved(self, frm: State, to: State) -> None:
        if to == State.SERVING:
            self.identity = None        # the warmed process: read again at the next tick
            with self._lock:
                wake = self.wake
                if wake is None or frm != State.PRIME:
                    return
                self.last_wake_seconds = self.clock() - wake.started
                self.wake = None
            self.recorder.life(LifeStats(wake_seconds=self.last_wake_seconds))
            log.info("warm again %.2f s after the wake began (%s)", self.last_wake_seconds, wake.cause)
        elif to.terminal or to == State.SLEEPING:
            self.wake = None
