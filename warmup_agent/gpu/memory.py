"""GPU memory for stage 1 and the fragmentation gauge.

Reservation: one allocation of the planned size through PyTorch's caching
allocator, written once so that every page is mapped (seed 000 §2.1: the first
touch of device pages costs 8-12 ms of jitter on a user's first token), then
released *to the allocator*, not to the driver: it stays reserved by this
process, and the weights, KV cache and activations are carved out of it without
another cudaMalloc.

Fragmentation (gpu_fragmentation_rate): 1 - largest free block / free bytes
inside the segments the allocator holds, from torch.cuda.memory_snapshot().
0 when the free reserved memory is one block (any request up to that size fits
without a new cudaMalloc); close to 1 when it is scattered in small pieces.
"""
from __future__ import annotations


def fragmentation_from_snapshot(snapshot: list[dict]) -> dict[int, float]:
    """Per device: 1 - largest inactive block / sum of inactive blocks.  Devices
    with no free reserved bytes report 0.0."""
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


def reserve(device, nbytes: int) -> int:
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
