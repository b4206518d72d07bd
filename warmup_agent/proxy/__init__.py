"""The routing proxy: users' requests to the main engine, the fallback or a 503 (routing.py),
over an HTTP upstream client made for relaying (upstream.py); in a process of its own where
the main engine is an HTTP server (process.py)."""
from warmup_agent.proxy.process import ProxyProcess, from_config
from warmup_agent.proxy.routing import (
    DEFAULT_MAX_BODY_BYTES,
    GET_PATHS,
    POST_PATHS,
    WARMUP_HEADER,
    Backend,
    BackendResponse,
    Gate,
    RoutedAgent,
    RoutingProxy,
    listen_backlog,
)
from warmup_agent.proxy.upstream import UPSTREAM_CONNECTIONS, BackendUnavailable, UpstreamBackend

__all__ = ["DEFAULT_MAX_BODY_BYTES", "GET_PATHS", "POST_PATHS", "UPSTREAM_CONNECTIONS", "WARMUP_HEADER", "Backend",
           "BackendResponse", "BackendUnavailable", "Gate", "ProxyProcess", "RoutedAgent", "RoutingProxy", "UpstreamBackend",
           "from_config", "listen_backlog"]
