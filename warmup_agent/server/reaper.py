"""PID 1 duties, for the agent as a container's entrypoint.

In the chart's `entrypoint` mode the agent is PID 1 of its container.  When the
vLLM server it supervises dies, the server's own children (vLLM's engine-core
processes, anything they spawned) are re-parented to PID 1; when they exit they
stay zombies until PID 1 waits for them, and a pod that restarts vLLM a few
times fills the process table.  The kernel also ignores SIGTERM sent to PID 1
unless PID 1 has a handler.

Instead of requiring an init such as tini in every image (the chart sets the
container's command, which would bypass an image's init), the agent brings its
own: when it finds itself PID 1 it forks once.  The child returns and runs the
agent as before; this process stays behind as a minimal init that

- forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to the agent, so
  SIGTERM still drains;
- reaps every child it gets, adopted orphans included;
- exits with the agent's exit status (128 + N when the agent died of signal N),
  which ends the container and with it whatever was left.

Why not reap in the agent itself: a reaper thread calling waitpid(-1) would race
with subprocess.Popen.wait() of the supervised server and steal its exit code.
Under tini or `docker run --init` the agent is not PID 1 and none of this runs.
WARMUP_NO_INIT=1 turns it off (the tests use it to show the zombie that is left
without an init; not a WARMUP_AGENT_* name, which the config would reject).
"""
from __future__ import annotations

import os
import signal

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_WAITED = set(FORWARDED) | {signal.SIGCHLD}


def init_if_pid1() -> None:
    """When this process is PID 1, fork and stay behind as the init described above;
    only the child returns.  Call before any thread starts (fork copies one thread)."""
    if os.getpid() != 1 or os.environ.get("WARMUP_NO_INIT"):
        return
    # Blocked before the fork, so that no signal arriving in between is lost: the
    # init collects them with sigtimedwait; the child unblocks them at once.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    agent = os.fork()
    if agent == 0:
        # Own process group: a Ctrl-C at a terminal reaches the init only, which
        # forwards it once (a second SIGINT would skip the agent's drain).
        os.setpgid(0, 0)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAITED)
        return
    os._exit(supervise(agent))


def supervise(agent: int) -> int:
    """Forward signals to `agent` and reap every child until `agent` exits; its exit code."""
    while True:
        status = reap(agent)
        if status is not None:
            return status
        # The timeout covers SIGCHLDs merged into one (two children exiting at once).
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

