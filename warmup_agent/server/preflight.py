"""Configuration checks that need several keys, the server command or a socket, made before a spawn.

A server may take minutes to load, so a mistake in the agent's own settings must fail first.
Standard library only besides config and command.py: this runs before the heavy imports.
"""
from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from warmup_agent.config import ConfigError
from warmup_agent.server.command import fix_command, http_url, listen_address

if TYPE_CHECKING:
    from warmup_agent.config_sections import ExporterSection, ProxySection

#: Engines that answer users in the agent's own process (Engine.openai_backend).
LOCAL_BACKEND_ENGINES = ("torch",)


def server_url(engine: str, openai_url: str | None, command: list[str] | None) -> str | None:
    """Where the openai engine's server answers: openai.url, else the supervised command's address."""
    if engine != "openai":
        return None
    if openai_url:
        return openai_url.rstrip("/")
    if command:
        return http_url(*listen_address(fix_command(command)))
    return None


def main_url(engine: str, openai_url: str | None, proxy: ProxySection, command: list[str] | None) -> str | None:
    """The proxy's main engine URL; None for an in-process engine or when unknown."""
    if proxy.upstream_url:
        return proxy.upstream_url
    if engine in LOCAL_BACKEND_ENGINES:
        return None
    return server_url(engine, openai_url, command)


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def _can_listen(key: str, listen: str) -> None:
    """Bind HOST:PORT and release it; ConfigError naming `key` where it cannot."""
    host, port = _split(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ConfigError(f"key '{key}': cannot listen on {listen}: {e.strerror or e}", key) from None
    except (OverflowError, ValueError) as e:
        raise ConfigError(f"key '{key}': cannot listen on {listen}: {e}", key) from None
    finally:
        sock.close()


def _check_proxy(engine: str, openai_url: str | None, pc: ProxySection, command: list[str] | None) -> None:
    if not pc.listen:
        return
    url = main_url(engine, openai_url, pc, command)
    if url is None and engine not in LOCAL_BACKEND_ENGINES:
        raise ConfigError("key 'proxy.upstream_url': the proxy needs the main engine's URL (proxy.upstream_url; "
                          "with --engine openai, openai.url or a server command after --)", "proxy.upstream_url")
    if url is not None and not url.startswith(("http://", "https://")):
        raise ConfigError(f"key 'proxy.upstream_url': got {url!r}; expected a URL starting with http:// or https://",
                          "proxy.upstream_url")


def _check_addresses(exporter: ExporterSection, proxy: ProxySection, server_command: list[str] | None,
                     proxy_bound: bool = False) -> None:
    """The exporter's and the proxy's addresses: free (the proxy's: unless this process
    bound it already, at the early spawn), and not the supervised server's own."""
    server = listen_address(fix_command(server_command)) if server_command else None
    taken: list[tuple[str, int, str]] = []
    if server is not None:
        taken.append((server[0], server[1], f"the server's own address (its command listens on port {server[1]})"))
    for key, listen in (("exporter.listen", exporter.listen), ("proxy.listen", proxy.listen)):
        if not listen:
            continue
        host, port = _split(listen)
        for other_host, other_port, what in taken:
            if port and port == other_port and _overlap(host, other_host):
                raise ConfigError(f"key '{key}': {listen} is {what}; give it a port of its own", key)
        if port and not (key == "proxy.listen" and proxy_bound):
            _can_listen(key, listen)
        taken.append((host, port, f"already {key}'s"))


def _overlap(a: str, b: str) -> bool:
    """Whether listeners on hosts `a` and `b` would want the same socket."""
    wild = ("", "0.0.0.0", "::")
    return a == b or a in wild or b in wild


def check(engine: str, openai_url: str | None, exporter: ExporterSection, proxy: ProxySection,
          command: list[str] | None, proxy_bound: bool = False) -> None:
    """Run every check that needs no server; ConfigError names the key.  `proxy_bound`:
    proxy.listen is this process's own already (server/listener.py)."""
    _check_proxy(engine, openai_url, proxy, command)
    _check_addresses(exporter, proxy, command if engine == "openai" else None, proxy_bound)
