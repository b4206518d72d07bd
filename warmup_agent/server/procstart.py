"""When this process started, on the agent's clock.

`warmup_time_to_ready_seconds` promises "process start to SERVING".  Before the
agent's first line runs, the interpreter has started and the CLI has imported
torch and transformers and perhaps created the embedded model: seconds on a
first run that a clock started in `Agent.run()` would not see.  The kernel
records the start of every process; this module reads it.
"""
from __future__ import annotations

import os
import time
from typing import Callable


def process_age_seconds() -> float | None:
    """Seconds since this process was created, or None if the OS will not say.

    Linux: the start time in /proc/self/stat (clock ticks since boot) against
    CLOCK_BOOTTIME, both counted from boot: 10 ms resolution.  (psutil's
    create_time() adds the boot time from /proc/stat, which is whole seconds,
    so it can be up to 1 s off against time.time().)  Elsewhere: psutil's
    create_time() against time.time().
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        # Field 22 (starttime); the command name (field 2) may hold spaces, so
        # count from the closing parenthesis.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return age if age >= 0 else None
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil
        age = time.time() - psutil.Process().create_time()
        return age if age >= 0 else None
    except Exception:  # noqa: BLE001 - no start time is a missing fact, not an error
        return None


def process_started(clock: Callable[[], float] = time.perf_counter) -> float | None:
    """The process start expressed on `clock` (so `clock() - result` is its age)."""
    age = process_age_seconds()
    return None if age is None else clock() - age
