"""When this process started, from the kernel: imports before `Agent.run()` count towards time to ready."""
from __future__ import annotations

import os
import time
from typing import Callable


def process_age_seconds() -> float | None:
    """Seconds since this process was created, or None if the OS will not say.

    On Linux from /proc/self/stat against CLOCK_BOOTTIME: psutil adds a boot time in whole
    seconds, so it can be up to 1 s off."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        # Field 22, counted from the ")" because the command name may hold spaces.
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
    """The process start on `clock`."""
    age = process_age_seconds()
    return None if age is None else clock() - age
