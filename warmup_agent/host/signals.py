"""SIGTERM / SIGINT handling that works when the signal lands on another thread.

CPython runs a Python signal handler only on the main thread, and only when that
thread returns to the interpreter loop.  The kernel may deliver the signal to any
thread, and on a host with many native threads it usually does; a main thread asleep
in an untimed `Event.wait()` then never runs the handler, and the pod is killed after
its grace period instead of draining.

Two independent paths, either enough:
1. `signal.set_wakeup_fd` writes the signal number to a socket from whichever thread
   the C handler runs on; a watcher thread reads it and calls `on_signal`;
2. the main thread never waits untimed, so the Python handler runs within `poll` s.
`on_signal` must be idempotent: both paths usually see the same delivery.
"""
from __future__ import annotations

import logging
import signal
import socket
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

HANDLED = (signal.SIGTERM, signal.SIGINT)


class SignalWatcher:
    """Calls `on_signal(signum)` for SIGTERM/SIGINT, from whichever path sees it
    first.  Install from the main thread (CPython requires it)."""

    def __init__(self, on_signal: Callable[[int], None], poll: float = 0.2):
        self._on_signal = on_signal
        self.poll = poll
        self._lock = threading.RLock()  # the Python handler can re-enter on the main thread
        self._rsock: socket.socket | None = None
        self._wsock: socket.socket | None = None
        self._old_wakeup = -1
        self._old_handlers: dict[int, object] = {}
        self.stopped = threading.Event()

    def install(self) -> "SignalWatcher":
        self._rsock, self._wsock = socket.socketpair()
        self._wsock.setblocking(False)   # set_wakeup_fd requires a non-blocking fd
        for sig in HANDLED:
            self._old_handlers[sig] = signal.signal(sig, self._python_handler)
        self._old_wakeup = signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="signal-watcher", daemon=True).start()
        return self

    def uninstall(self) -> None:
        try:
            signal.set_wakeup_fd(self._old_wakeup)
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)  # type: ignore[arg-type]
        except ValueError:   # not the main thread: the process is ending anyway
            pass
        for s in (self._wsock, self._rsock):
            if s is not None:
                s.close()

    def wait_until_stopped(self) -> None:
        """Block the main thread until a signal was handled, waking every `poll` s."""
        while not self.stopped.wait(self.poll):
            pass

    def _python_handler(self, signum: Any, frame: Any) -> None:
        self._handle(signum, source="handler")

    def _watch(self) -> None:
        rsock = self._rsock
        assert rsock is not None, "the watcher starts after the socket pair exists"
        while True:
            try:
                data = rsock.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in HANDLED:
                    self._handle(signum, source="wakeup")

    def _handle(self, signum: int, source: str) -> None:
        # The lock keeps the two paths' calls from interleaving.
        with self._lock:
            if not self.stopped.is_set():
                log.info("signal %d: draining (seen by the %s)", signum, source)
            try:
                self._on_signal(signum)
            finally:
                self.stopped.set()
