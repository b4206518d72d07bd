"""Cheap checks of a Hugging Face-layout model directory before any weight is read (no torch)."""
from __future__ import annotations

import json
import os
import struct

from warmup_agent.errors import EngineError


def check_model_dir(path: str) -> dict:
    """Check config.json and the shards' structure; return config.json.

    A polluted cache (empty config, truncated shards) gets a named reason, not a library traceback."""
    if not os.path.isdir(path):
        raise EngineError("model_dir_missing", f"{path}: model directory does not exist")
    if not os.access(path, os.R_OK | os.X_OK):
        raise EngineError("model_dir_unreadable", f"{path}: model directory is not readable")
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise EngineError("config_missing", f"{cfg_path}: missing; expected a Hugging Face config.json") from None
    except (OSError, UnicodeDecodeError) as e:
        raise EngineError("config_invalid", f"{cfg_path}: cannot read: {e}") from None
    if not text.strip():
        raise EngineError("config_invalid", f"{cfg_path}: file is empty; expected a JSON object")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineError("config_invalid", f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise EngineError("config_invalid", f"{cfg_path}: expected a JSON object with a 'model_type' key")
    shards = safetensors_files(path)
    if not shards:
        raise EngineError("weights_missing", f"{path}: no *.safetensors weight files")
    for shard in shards:
        check_safetensors_header(shard)
    return config


def safetensors_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                   "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def read_safetensors_header(shard: str) -> dict:
    """A shard's JSON header, checked so the tensors' byte ranges exactly tile the rest of the file."""
    size = os.path.getsize(shard)
    try:
        with open(shard, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise EngineError("weights_corrupt", f"{shard}: truncated ({size} bytes; no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100 * 1024 * 1024:
                raise EngineError("weights_corrupt", f"{shard}: header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise EngineError("weights_corrupt", f"{shard}: unreadable safetensors header ({e})") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    cursor = 0
    for name, meta in sorted(tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = meta["data_offsets"]
        numel = 1
        for d in meta["shape"]:
            numel *= d
        want = numel * _ST_DTYPE_BYTES.get(meta["dtype"], 0)
        if begin != cursor or end - begin != want:
            raise EngineError("weights_corrupt",
                              f"{shard}: header lies about tensor {name}: bytes [{begin}, {end}) for {meta['dtype']} {meta['shape']} ({want} bytes expected at offset {cursor})")
        cursor = end
    if 8 + n + cursor != size:
        raise EngineError("weights_corrupt",
                          f"{shard}: header promises {cursor} bytes of tensor data but the file holds {size - 8 - n} (truncated or padded shard)")
    return tensors


def check_safetensors_header(shard: str) -> int:
    """Bytes of tensor data in a verified shard."""
    tensors = read_safetensors_header(shard)
    return max((m["data_offsets"][1] for m in tensors.values()), default=0)
