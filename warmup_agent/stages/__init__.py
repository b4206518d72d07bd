"""The four warmup stages.  Each module has one `run(agent)`; the pipeline times it."""
