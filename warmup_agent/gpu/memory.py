"""GPU memory for stage 1 and the fragmentation gauge.

Reservation: one allocation of the planned size through PyTorch's caching
allocator, written once so that every page is mapped (seed 000 §2.1: the first
touch of device pages costs 8-12 ms of jitter on a user's first token), then
released *to the allocator*, not to the driver: it stays reserved by this
process, and the weights, KV cache and activations are carved out of it without
another cudaMalloc.

Fragmentation (gpu_fragmentation_rate): free bytes stranded inside segments
that still hold a live allocation, over the bytes the allocator reserves, per
device, from torch.cuda.memory_snapshot().  See fragmentation_from_snapshot.
"""
from __future__ import annotations

from typing import Any


def _live(block: dict) -> bool:
    return block.get("state") != "inactive"      # active_allocated or active_pending_free


def fragmentation_from_snapshot(snapshot: list[dict]) -> dict[int, float]:
    """Per device: stranded free bytes / reserved bytes, in 0..1.

    Stranded: the inactive (free) blocks of every segment that also holds a live
    block.  The caching allocator cannot return such a segment to the driver
    and can reuse its free blocks only for requests that fit one of them, so
    they are the memory that splits into pieces as a pod runs for days (seed
    003: 12 % -> 43 % in 30 days).  This is the allocator's own
    `inactive_split_bytes` (torch.cuda.memory_stats), computed from the snapshot
    so it is testable on recorded snapshots.
    Not stranded: a segment that is wholly free (one block, reusable for any
    request that fits, releasable by empty_cache).
    Over *reserved* bytes, not free bytes: a warmed pod whose reservation was
    sized to its need holds little free memory, and a ratio over that little
    (1 - largest free block / free bytes) reads high on a healthy pod just
    because the allocator holds several segments.  Devices with
    nothing reserved report 0.0."""
    stranded: dict[int, int] = {}
    reserved: dict[int, int] = {}
    for seg in snapshot:
        dev = int(seg.get("device", 0))
        blocks = seg.get("blocks", [])
        reserved[dev] = reserved.get(dev, 0) + int(seg.get("total_size", sum(int(b["size"]) for b in blocks)))
        free = sum(int(b["size"]) for b in blocks if not _live(b))
        stranded[dev] = stranded.get(dev, 0) + (free if any(_live(b) for b in blocks) else 0)
    return {d: (stranded[d] / reserved[d]) if reserved[d] else 0.0 for d in reserved}


def reserved_from_snapshot(snapshot: list[dict]) -> dict[int, int]:
    """Per device: bytes of every segment the allocator holds."""
    out: dict[int, int] = {}
    for seg in snapshot:
        dev = int(seg.get("device", 0))
        out[dev] = out.get(dev, 0) + int(seg.get("total_size", sum(int(b["size"]) for b in seg.get("blocks", []))))
    return out


def old_fragmentation_from_snapshot(snapshot: list[dict]) -> dict[int, float]:
    """The definition before issue 13, kept for comparison only (bench and tests):
    1 - largest inactive block / sum of inactive blocks over all segments."""
    free: dict[int, int] = {}
    largest: dict[int, int] = {}
    for seg in snapshot:
        dev = int(seg.get("device", 0))
        free.setdefault(dev, 0)
        largest.setdefault(dev, 0)
        for block in seg.get("blocks", []):
            if block.get("state") == "inactive":
                free[dev] += int(block["size"])
                largest[dev] = max(largest[dev], int(block["size"]))
    return {d: (1.0 - largest[d] / free[d]) if free[d] else 0.0 for d in free}


def reserve(device: Any, nbytes: int) -> int:
    """Reserve and touch `nbytes` on a CUDA device; return the bytes the allocator
    now holds for this process on it.  CPU devices: nothing to reserve, 0."""
    import torch
    if device.type != "cuda" or nbytes <= 0:
        return 0
    block = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
    block.fill_(0)                      # touch: map every page now, not on a user's first token
    torch.cuda.synchronize(device)
    del block                           # back to the caching allocator, still reserved
    return int(torch.cuda.memory_reserved(device))
