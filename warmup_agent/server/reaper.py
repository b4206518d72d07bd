"""A minimal init for the agent as PID 1 of its container (the chart's entrypoint mode).

Orphans of a supervised server become zombies unless PID 1 reaps them, and the kernel
ignores SIGTERM to a PID 1 without a handler.  The chart sets the container's command,
bypassing any init in the image, so the agent forks once and the parent stays as init:
it forwards signals, reaps every child and exits with the agent's status.  Reaping in the
agent itself would race subprocess.Popen.wait() for the server's exit code.
WARMUP_NO_INIT=1 turns this off.
"""
from __future__ import annotations

import os
import signal

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_WAITED = set(FORWARDED) | {signal.SIGCHLD}


def init_if_pid1() -> None:
    """When PID 1, fork and stay behind as init; only the child returns.  Call before any thread starts."""
    if os.getpid() != 1 or os.environ.get("WARMUP_NO_INIT"):
        return
    # Blocked before the fork so none is lost in between; the init collects them with sigtimedwait.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    agent = os.fork()
    if agent == 0:
        # Own process group: a terminal's Ctrl-C reaches only the init, which forwards it once.
        os.setpgid(0, 0)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAITED)
        return
    os._exit(supervise(agent))


def supervise(agent: int) -> int:
    """Forward signals to `agent` and reap children until it exits; return its exit code."""
    while True:
        status = reap(agent)
        if status is not None:
            return status
        # The timeout covers SIGCHLDs merged into one.
        info = signal.sigtimedwait(_WAITED, 1.0)
        if info is not None and info.si_signo != signal.SIGCHLD:
            try:
                os.kill(agent, info.si_signo)
            except ProcessLookupError:
                pass


def reap(agent: int) -> int | None:
    """Wait for every child that has exited; the agent's exit code if it was one of them."""
    result = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 1 if result is None else result  # no child at all: the agent is gone
        if pid == 0:
            return result
        if pid == agent:
            code = os.waitstatus_to_exitcode(status)
            result = code if code >= 0 else 128 - code

