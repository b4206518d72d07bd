"""Facts about the machine the agent runs on (hardware.py: CPUs, memory, GPUs,
topology, CPU pinning) and the agent process's own resident-memory jitter (memory.py)."""
