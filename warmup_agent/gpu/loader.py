"""Progressive weight loading (stage 2): safetensors shards read in forward-pass order into pinned
buffers, copied to the device on a side stream while the next chunk is read.

The skeleton is built on the meta device and the loaded tensors become its parameters
without a copy.  On a CPU, or where the stored dtype differs, a plain path copies with a
cast.  Shards are checked against the config (names, shapes, dtypes) and an optional manifest.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from warmup_agent.errors import EngineError

_ST_TORCH = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_EMBED = re.compile(r"(embed_tokens|wte|word_embeddings|embed_in)\.")
_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")
_HEAD = re.compile(r"^(lm_head|embed_out|output)\.")


def forward_rank(name: str) -> tuple:
    """Sort key: embeddings, layers in numeric order, the rest, the LM head last."""
    if _EMBED.search(name):
        return (0, 0, name)
    m = _LAYER.search(name)
    if m:
        return (1, int(m.group(1)), name)
    if _HEAD.search(name):
        return (3, 0, name)
    return (2, 0, name)


@dataclass
class TensorSlot:
    name: str
    shard: str
    offset: int            # absolute file offset of the tensor's first byte
    nbytes: int
    dtype: str             # torch dtype name as stored
    shape: tuple


@dataclass
class LoadReport:
    path: str                              # "pinned_overlapped" | "plain"
    reason: str = ""                       # why the plain path was taken
    bytes: int = 0
    seconds: float = 0.0
    tensors: int = 0
    order: list[str] = field(default_factory=list)   # first few tensor names, in load order
    chunk_bytes: int = 0
    buffers: int = 0

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["order"] = d["order"][:6]
        return d


def checkpoint_slots(shards: list[str], read_header: Any) -> list[TensorSlot]:
    """Every tensor of every shard with its absolute file offset, in forward order."""
    import struct
    slots = []
    for shard in shards:
        tensors = read_header(shard)
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        for name, meta in tensors.items():
            begin, end = meta["data_offsets"]
            slots.append(TensorSlot(name, shard, 8 + n + begin, end - begin,
                                    _ST_TORCH.get(meta["dtype"], meta["dtype"]), tuple(meta["shape"])))
    return sorted(slots, key=lambda s: forward_rank(s.name))


def check_against_skeleton(path: str, slots: list[TensorSlot], expected: dict[str, tuple], tied: set[str],
                           config_dtype: str | None, keep: Any = lambda name: False) -> None:
    found = {s.name: s for s in slots}
    for name in sorted(found):
        if name in expected and tuple(expected[name]) != found[name].shape:
            raise EngineError("weights_shape_mismatch",
                              f"{path}: tensor {name} has shape {list(found[name].shape)} in the checkpoint but config.json implies {list(expected[name])}")
    missing = sorted(set(expected) - set(found) - tied)
    if missing:
        raise EngineError("weights_incomplete", f"{path}: {len(missing)} tensors missing from the checkpoint (first: {missing[0]})")
    if config_dtype:
        # FP8 weights and their float32 scales (keep) are stored so on purpose.
        odd = [s for s in slots if s.name in expected and s.dtype.startswith(("float", "bfloat")) and s.dtype != config_dtype
               and not s.dtype.startswith("float8") and not keep(s.name)]
        if odd:
            raise EngineError("weights_corrupt",
                              f"{path}: tensor {odd[0].name} is stored as {odd[0].dtype} but config.json says torch_dtype {config_dtype}")


def check_manifest(path: str, manifest: str) -> int:
    """Verify shards against a sha256sum-format manifest; return files checked."""
    try:
        with open(manifest, encoding="utf-8") as f:
            lines = [ln.split() for ln in f if ln.strip()]
    except OSError as e:
        raise EngineError("weights_corrupt", f"{manifest}: cannot read the SHA-256 manifest: {e.strerror}") from None
    for parts in lines:
        if len(parts) != 2 or len(parts[0]) != 64:
            raise EngineError("weights_corrupt", f"{manifest}: expected lines '<sha256>  <file>', got {' '.join(parts)!r}")
        want, name = parts[0].lower(), parts[1].lstrip("*")
        h = hashlib.sha256()
        try:
            with open(os.path.join(path, name), "rb") as f:
                for block in iter(lambda: f.read(16 << 20), b""):
                    h.update(block)
        except OSError as e:
            raise EngineError("weights_corrupt", f"{path}/{name}: listed in {manifest} but unreadable: {e.strerror}") from None
        if h.hexdigest() != want:
            raise EngineError("weights_corrupt", f"{path}/{name}: SHA-256 {h.hexdigest()[:16]}... does not match the manifest's {want[:16]}...")
    return len(lines)


def build_meta_skeleton(config_path: str, dtype: Any) -> Any:
    """(model on the meta device, expected shapes, tied names); a thread can build it while weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(config_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    return model, expected, tied


def allocate(slots: list[TensorSlot], dtype: Any, device: Any, keep: Any = lambda name: False) -> dict:
    """Empty destination tensors by name, floats in `dtype` unless FP8 or `keep`; needs no model or transformers."""
    import torch
    out = {}
    for s in slots:
        stored = getattr(torch, s.dtype, None)
        if not isinstance(stored, torch.dtype):
            raise EngineError("weights_corrupt", f"{s.shard}: tensor {s.name} has dtype {s.dtype}, which this loader cannot read")
        cast = stored.is_floating_point and stored.itemsize > 1 and not keep(s.name)
        out[s.name] = torch.empty(s.shape, dtype=dtype if cast else stored, device=device)
    return out


def bind(model: Any, tensors: dict, device: Any) -> Any:
    """Make the tensors the parameters of a meta-device skeleton, rebuilding non-persistent buffers first."""
    want = model.state_dict()
    # A module the model keeps in another dtype (say float32 norms) gets a cast copy.
    tensors = {k: v if k not in want or v.dtype == want[k].dtype else v.to(want[k].dtype) for k, v in tensors.items()}
    _rebuild_nonpersistent(model, device)
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    unfilled = sorted(n for n, t in model.state_dict().items() if t.is_meta)
    if unfilled:
        raise EngineError("weights_incomplete", f"{len(unfilled)} tensors were not loaded (first: {unfilled[0]})")
    return model.eval()


def _rebuild_nonpersistent(model: Any, device: Any) -> None:
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not getattr(child, "_non_persistent_buffers_set", None):
                continue
            cfg = getattr(child, "config", None) or model.config
            try:
                fresh = type(child)(config=cfg)
            except TypeError:
                fresh = type(child)(cfg)
            setattr(parent, child_name, fresh.to(device))


def _dest_tensors(model: Any) -> dict:
    """name -> the parameter or persistent buffer to fill (tied names map to one tensor)."""
    return dict(model.state_dict(keep_vars=True))


def load(model: Any, slots: list[TensorSlot], device: Any, chunk_bytes: int = 64 << 20, buffers: int = 4,
         workers: int = 4) -> LoadReport:
    """Fill `model` (or a dict from allocate()) from the checkpoint; pinned and overlapped on CUDA."""
    dest = model if isinstance(model, dict) else _dest_tensors(model)
    slots = [s for s in slots if s.name in dest]
    t0 = time.perf_counter()
    reason = ""
    if device.type != "cuda":
        reason = "not a CUDA device (no pinned staging)"
    elif any(str(dest[s.name].dtype).replace("torch.", "") != s.dtype for s in slots):
        reason = "stored dtype differs from the target dtype (cast on copy)"
    if reason:
        report = _load_plain(dest, slots)
        report.reason = reason
    else:
        report = _load_pinned(dest, slots, device, chunk_bytes, buffers, workers)
    report.seconds = time.perf_counter() - t0
    report.tensors = len(slots)
    report.order = [s.name for s in slots]
    return report


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise EngineError("weights_corrupt", f"unexpected end of file at byte {offset + done}")
        done += n


def _load_plain(dest: Any, slots: Any) -> LoadReport:
    """Read each tensor straight into place where dtypes match, else through one reused buffer and a cast."""
    import numpy as np
    import torch
    total = 0
    fds: dict[str, int] = {}
    staging = None
    try:
        with torch.no_grad():
            for s in slots:
                fd = fds.get(s.shard) or fds.setdefault(s.shard, os.open(s.shard, os.O_RDONLY))
                d = dest[s.name].data
                if str(d.dtype).replace("torch.", "") == s.dtype and d.is_contiguous() and d.device.type == "cpu":
                    _pread_into(fd, memoryview(d.view(-1).view(torch.uint8).numpy()), s.offset)
                else:
                    if staging is None or staging.nbytes < s.nbytes:
                        staging = np.empty(max(s.nbytes, max(x.nbytes for x in slots)), dtype=np.uint8)
                    raw = staging[:s.nbytes]
                    _pread_into(fd, raw.data, s.offset)
                    d.copy_(torch.from_numpy(raw).view(getattr(torch, s.dtype)).reshape(s.shape))
                total += s.nbytes
    finally:
        for fd in fds.values():
            os.close(fd)
    return LoadReport(path="plain", bytes=total)


def _load_pinned(dest: Any, slots: Any, device: Any, chunk_bytes: Any, nbuf: Any, workers: Any) -> LoadReport:
    import torch
    chunks = []   # (shard, file offset, nbytes, destination byte view, start)
    for s in slots:
        flat = dest[s.name].data.view(-1).view(torch.uint8)
        for start in range(0, s.nbytes, chunk_bytes):
            chunks.append((s.shard, s.offset + start, min(chunk_bytes, s.nbytes - start), flat, start))
    size = min(chunk_bytes, max((c[2] for c in chunks), default=1))
    bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)]
    views = [memoryview(b.numpy()) for b in bufs]
    done_events = [torch.cuda.Event() for _ in range(nbuf)]
    stream = torch.cuda.Stream(device)
    fds = {shard: os.open(shard, os.O_RDONLY) for shard in {c[0] for c in chunks}}

    def read(i: Any) -> None:
        shard, off, n, _, _ = chunks[i]
        k = i % nbuf
        done_events[k].synchronize()           # the copy out of this buffer has finished
        _pread_into(fds[shard], views[k][:n], off)

    total = 0
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, nbuf)) as pool, torch.no_grad():
            futures = {i: pool.submit(read, i) for i in range(min(nbuf, len(chunks)))}
            for i, (_, _, n, flat, start) in enumerate(chunks):
                futures.pop(i).result()
                k = i % nbuf
                with torch.cuda.stream(stream):
                    flat[start:start + n].copy_(bufs[k][:n], non_blocking=True)
                    done_events[k].record(stream)
                total += n
                if i + nbuf < len(chunks):
                    futures[i + nbuf] = pool.submit(read, i + nbuf)
        stream.synchronize()
    finally:
        for fd in fds.values():
            os.close(fd)
    return LoadReport(path="pinned_overlapped", bytes=total, chunk_bytes=size, buffers=nbuf)
