"""Call a function every `interval` seconds on a daemon thread.

The first call comes one interval after start(), and stop() is prompt: the wait is on
an Event, not a sleep.  `fn` handles its own errors; an exception ends the loop.
"""
from __future__ import annotations

import threading
from typing import Callable


class Periodic:
    def __init__(self, interval: float, fn: Callable[[], object], name: str):
        """interval: seconds between calls; name: the thread's name."""
        self.interval, self._fn, self.name = interval, fn, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the loop; after stop() this starts a fresh one (a re-warm does)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._fn()

    def stop(self, timeout: float = 1.0) -> None:
        """End the loop, waiting up to `timeout` s for a call in progress.  Safe before
        start() and from inside `fn`."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()
