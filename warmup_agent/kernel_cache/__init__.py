"""Two-tier kernel cache: local directories with LRU eviction + a signed, shared Redis tier.

See cache.py for the facade (KernelCache), local.py, shared.py, signing.py and
namespace.py for the parts, cli.py for `warmup-agent cache ...`.

The names below load on first use (PEP 562): `warmup-agent run` builds its argument
parser with `cache`'s subcommand (cli.py) before it spawns a supervised server, and
importing the facade there pulled in the Redis client (and its OpenTelemetry
modules), 0.2-0.3 s on the critical path of every start.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warmup_agent.kernel_cache.cache import KernelCache, Settings
    from warmup_agent.kernel_cache.local import ENV_VARS, KINDS
    from warmup_agent.kernel_cache.shared import CHANNEL

__all__ = ["KernelCache", "Settings", "ENV_VARS", "KINDS", "CHANNEL"]
_WHERE = {"KernelCache": "cache", "Settings": "cache", "ENV_VARS": "local", "KINDS": "local", "CHANNEL": "shared"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
