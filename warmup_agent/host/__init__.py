"""Facts about the machine the agent runs on, and the agent process's own memory jitter."""
