"""Run one step under a deadline, because CUDA context creation and kernel compilation hang rather than fail.

Past the deadline the thread is abandoned (it cannot be killed) and the process is expected to restart."""
from __future__ import annotations

import threading
from typing import Any

from warmup_agent.errors import EngineError


def run_with_deadline(fn: Any, seconds: float, reason: str, what: str) -> Any:
    if not seconds or seconds <= 0:
        return fn()
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e
    t = threading.Thread(target=target, name=f"deadline-{reason}", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise EngineError(reason, f"{what} did not finish within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")
