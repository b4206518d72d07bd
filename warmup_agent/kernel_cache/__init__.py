"""Two-tier kernel cache: local directories with LRU eviction + a signed, shared Redis tier.

See cache.py for the facade (KernelCache), local.py, shared.py, signing.py and
namespace.py for the parts, cli.py for `warmup-agent cache ...`.
"""
from warmup_agent.kernel_cache.cache import KernelCache, Settings
from warmup_agent.kernel_cache.local import ENV_VARS, KINDS
from warmup_agent.kernel_cache.shared import CHANNEL

__all__ = ["KernelCache", "Settings", "ENV_VARS", "KINDS", "CHANNEL"]
