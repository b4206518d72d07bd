"""Where the agent keeps its data when `data_dir` is not set (config.py's default;
tools/build_llama_server.py follows the same rule, tested)."""
from __future__ import annotations

import os


def default_data_dir() -> str:
    """$XDG_CACHE_HOME/warmup-agent, else ~/.cache/warmup-agent."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "warmup-agent")
