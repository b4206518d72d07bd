"""GPU parts of the torch engine's stages: memory sizing and reservation,
progressive weight loading, CUDA graphs, the NVML utilisation-ramp sampler and
allocator fragmentation.  Every function has a CPU path (CI has no GPU)."""
