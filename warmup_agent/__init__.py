"""warmup-agent: a cold-start warmup agent for LLM inference servers."""
__version__ = "0.1.0"
