"""The routing proxy: users' requests to the main engine, the fallback or a 503 (routing.py),
over an HTTP upstream client made for relaying (upstream.py)."""
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
    from_config,
    listen_backlog,
)
from warmup_agent.proxy.upstream import UPSTREAM_CONNECTIONS, BackendUnavailable, UpstreamBackend

__all__ = ["DEFAULT_MAX_BODY_BYTES", "GET_PATHS", "POST_PATHS", "UPSTREAM_CONNECTIONS", "WARMUP_HEADER", "Backend",
           "BackendResponse", "BackendUnavailable", "Gate", "RoutedAgent", "RoutingProxy", "UpstreamBackend",
           "from_config", "listen_backlog"]
