"""Metrics of the two-tier kernel cache (warmup_agent/kernel_cache/).

One "request" is one artifact file looked up in one tier while restoring.
"""
from __future__ import annotations

from exporter.metric_spec import MetricSpec

# Seconds; a loser waits for the winner's compile up to kernel_cache.lock_wait_seconds.
LOCK_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("warmup_kernel_cache_requests_total", "counter",
               "Kernel cache entry lookups by tier (local, shared) and result (hit, miss, rejected, error).",
               labels=("tier", "result"), unit="short",
               doc="rejected: a shared entry failed its HMAC-SHA256 signature, digest or path check and was not used. "
                   "error: the shared tier could not answer (unreachable, timeout, full); the agent continued local-only."),
    MetricSpec("warmup_kernel_cache_bytes", "gauge",
               "Bytes held by the kernel cache per tier: files in the local directories, entries of this namespace in Redis.",
               labels=("tier",), unit="bytes"),
    MetricSpec("warmup_kernel_cache_lock_waits_total", "counter",
               "Times this agent waited because another pod held the compile lock for the same key.",
               unit="short"),
    MetricSpec("warmup_kernel_cache_lock_wait_seconds", "histogram",
               "Seconds spent waiting for another pod's compile (until its publish, the lock's release or the deadline).",
               buckets=LOCK_WAIT_BUCKETS, unit="s"),
    MetricSpec("warmup_kernel_cache_publishes_total", "counter",
               "Entries (artifact files) this agent wrote to the shared tier.",
               unit="short"),
    MetricSpec("warmup_kernel_cache_degraded", "gauge",
               "1 while the shared tier is off (no Redis URL or no secret) or unreachable, so the cache runs local-only; else 0.",
               unit="short"),
    MetricSpec("warmup_kernel_cache_evictions_total", "counter",
               "Entries removed to respect the size bound, by tier (local: LRU over the cache directories).",
               labels=("tier",), unit="short"),
    MetricSpec("warmup_kernel_cache_invalidations_total", "counter",
               "Invalidations of this agent's namespace applied (kernel_schema_change messages and purges).",
               unit="short"),
    MetricSpec("warmup_kernel_cache_publish_skipped_total", "counter",
               "Entries not published to the shared tier, by reason (too_large: over kernel_cache.max_entry_bytes).",
               labels=("reason",), unit="short"),
)
