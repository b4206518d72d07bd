"""GPU memory for stage 1 (the reservation) and the fragmentation gauge.

The reservation is touched once so every page is mapped before a user's first token, then
released to PyTorch's caching allocator, not the driver, so later allocations need no cudaMalloc.
"""
from __future__ import annotations

from typing import Any


def _live(block: dict) -> bool:
    return block.get("state") != "inactive"      # active_allocated or active_pending_free


def fragmentation_from_snapshot(snapshot: list[dict]) -> dict[int, float]:
    """Per device: free bytes in segments that also hold a live block, over reserved bytes.

    Such blocks cannot go back to the driver and serve only requests that fit them (the
    allocator's `inactive_split_bytes`, computed here so recorded snapshots can be tested).
    Over reserved rather than free bytes, which a well-sized warmed pod has little of."""
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
    """The old definition, 1 - largest free block / free bytes, kept for comparison."""
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
    """Reserve and touch `nbytes` on a CUDA device; return the bytes the allocator now holds (CPU: 0)."""
    import torch
    if device.type != "cuda" or nbytes <= 0:
        return 0
    block = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
    block.fill_(0)                      # map every page now
    torch.cuda.synchronize(device)
    del block                           # back to the caching allocator, still reserved
    return int(torch.cuda.memory_reserved(device))
