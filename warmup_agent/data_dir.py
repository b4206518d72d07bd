"""Where the agent keeps its data when `data_dir` is not set.  Its own module: the
early spawn (early_spawn.py) needs it before the configuration is imported."""
from __future__ import annotations

import os


def default_data_dir() -> str:
    """$XDG_CACHE_HOME/warmup-agent, else ~/.cache/warmup-agent."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "warmup-agent")
