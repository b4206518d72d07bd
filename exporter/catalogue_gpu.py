"""Metrics of the GPU-grade torch engine (warmup_agent/gpu): reservation, weight
loading, CUDA graphs and the utilisation ramp.  Absent without a GPU except
where noted.  Per-GPU series carry `gpu` (the physical NVML index, as
nvidia-smi shows it) and `uuid` (stable across restarts and
CUDA_VISIBLE_DEVICES re-ordering): docs/metrics.md, "Per-GPU series"."""
from exporter.metric_spec import MetricSpec

SPECS = (
    MetricSpec("warmup_gpu_utilization_ramp_slope", "gauge",
               "Least-squares slope of NVML GPU utilisation (0..1) against time over the warmup (prewarm and solidify), per second.",
               labels=("gpu", "uuid"), unit="short", requires="gpu",
               doc="Sampled every gpu.ramp_sample_interval_seconds (seed 000 §2.3: 50 ms). Seed SOTA line: >= 0.147/s (14.7 %/s)."),
    MetricSpec("warmup_gpu_memory_reserved_bytes", "gauge",
               "GPU memory the caching allocator holds for this process after stage 1 reserved and touched it.",
               labels=("gpu", "uuid"), unit="bytes", requires="gpu",
               doc="Sized from the weights, the KV bytes per token (2 x layers x kv_heads x head_dim x dtype bytes) for the warmup grid, and activation headroom."),
    MetricSpec("warmup_weight_load_bytes_per_second", "gauge",
               "Weight bytes loaded onto the device divided by the seconds the load took, in the latest warmup.",
               unit="bytes", doc="Compare with the pinned host-to-device bandwidth and the read bandwidth of the model's storage."),
    MetricSpec("warmup_cuda_graphs", "gauge",
               "CUDA graphs captured by solidify: one decode step per warmed batch size, plus one padded prefill per warmed (length, batch) with the native model; 0 when it fell back to eager.",
               labels=("gpu", "uuid"), unit="short", requires="gpu"),
    MetricSpec("warmup_solidify_fallbacks_total", "counter",
               "Times solidify fell back to eager execution, by named reason (no_cuda_device, capture_failed, ...).",
               labels=("reason",), unit="short", requires="gpu",
               doc="Present once a fallback happened (normally only on a GPU host: on a CPU the default is replay, not a fallback)."),
)
