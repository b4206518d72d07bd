"""GPU parts of the torch engine's stages; every function has a CPU path, since CI has no GPU."""
