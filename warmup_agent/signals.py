"""SIGTERM / SIGINT handling that works on a GPU host.

Why not just `signal.signal(...)` and `Event.wait()`: CPython runs a Python
signal handler only on the main thread, and only once that thread gets back to
the interpreter loop.  The kernel may deliver a process-directed signal to any
thread that does not block it; on a GPU host (dozens of CUDA, NVML and HTTP
threads) it lands on another thread, so CPython's C-level handler sets its
"tripped" flag but the main thread, asleep in an untimed `Event.wait()` (a
`sem_wait` that only EINTR wakes), never looks at it: no drain, SIGKILL after
the grace period.

Two independent paths, either of which is enough:
1. the C handler also writes the signal number to a wakeup socket
   (`signal.set_wakeup_fd`), whichever thread it runs on; a small watcher
   thread blocks on that socket and calls `on_signal` itself, so a drain starts
   even while the main thread is busy in a long native call;
2. the main thread never waits untimed (`wait_until_stopped` wakes every
   `poll` seconds), so the interpreter runs the Python handler within that time.
`on_signal` must be idempotent (both paths usually see the same delivery); a
lock serialises the calls.
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
        """Block the main thread until a signal was handled, waking every `poll` s
        so the interpreter can run a pending Python-level handler."""
        while not self.stopped.wait(self.poll):
            pass

    # The Python-level handler: runs on the main thread, whenever it gets there.
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
        # One delivery usually reaches both paths (the wakeup byte and, later, the
        # Python handler); on_signal must be idempotent, and the lock keeps two
        # calls from interleaving.
        with self._lock:
            if not self.stopped.is_set():
                log.info("signal %d: draining (seen by the %s)", signum, source)
            try:
                self._on_signal(signum)
            finally:
                self.stopped.set()
