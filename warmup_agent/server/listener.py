"""The proxy's listening socket, which may be bound long before the proxy runs.

A socket that listens queues its clients' connections in the kernel until someone
accepts them.  So `cli.main` binds the proxy's address first thing, beside the early
spawn of a supervised server (early_spawn.py): a user who arrives while the
agent is still importing is connected and held, not refused, and their client does
not spend a retry.  Only `socket` is imported here: this runs before the agent's imports.
"""
from __future__ import annotations

import socket


def parse(listen: str) -> tuple[str, int]:
    """proxy.listen ("HOST:PORT", "[::1]:PORT") as (host, port)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def backlog() -> int:
    """somaxconn, and at least 1024: a burst of clients must not wait on SYN retries."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(1024, int(f.read().strip()))
    except (OSError, ValueError):
        return 1024


def bind(listen: tuple[str, int]) -> socket.socket:
    """A listening, non-blocking socket on `listen`; OSError when the address is taken."""
    host, port = listen
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog())
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
