"""The local tier: one directory per cache kind, bounded in size by LRU eviction.

Layout: <root>/<namespace>/<kind>/...  The engines write there in their own formats;
this module only lists, reads, writes and evicts files.  Recency is the later of
atime and mtime: the agent touches every file it restores or finds, so files in use
stay young.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

from warmup_agent.atomic_file import write_bytes_atomic

KINDS = ("inductor", "triton", "vllm")
# Environment variables that point each engine at its directory.
ENV_VARS = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR", "vllm": "VLLM_CACHE_ROOT"}


def _skip(relpath: str) -> bool:
    """Engine scratch files: lock files, temporaries being written."""
    parts = relpath.split(os.sep)
    name = parts[-1]
    return ("locks" in parts[:-1] or name.endswith(".lock") or name.startswith("tmp")
            or any(p.startswith("tmp") for p in parts[:-1]) or name.startswith(".wa-"))


def safe_relpath(relpath: str) -> bool:
    """True when relpath stays inside its directory (entries from Redis are checked)."""
    if not relpath or relpath.startswith("/") or "\\" in relpath or "\0" in relpath:
        return False
    parts = relpath.split("/")
    return all(p not in ("", ".", "..") for p in parts) and not _skip(relpath)


def scan(top: str) -> dict[str, os.stat_result]:
    """relpath ("/"-separated) -> stat for every cache file under top."""
    out = {}
    for dirpath, _dirs, names in os.walk(top):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, top)
            if _skip(rel) or os.path.islink(full):
                continue
            try:
                out[rel.replace(os.sep, "/")] = os.stat(full)
            except FileNotFoundError:  # removed by the engine meanwhile
                continue
    return out


class LocalTier:
    def __init__(self, root: str, namespace: str, max_bytes: int):
        self.root = root
        self.namespace = namespace
        self.base = os.path.join(root, namespace)
        self.max_bytes = max_bytes
        self._digests: dict[tuple[str, str], tuple[int, int, str]] = {}
        for kind in KINDS:
            os.makedirs(self.dir(kind), exist_ok=True)

    def dir(self, kind: str) -> str:
        return os.path.join(self.base, kind)

    def files(self, kind: str) -> dict[str, os.stat_result]:
        """relpath ("/"-separated) -> stat, for every cache file of a kind."""
        return scan(self.dir(kind))

    def path(self, kind: str, relpath: str) -> str:
        return os.path.join(self.dir(kind), *relpath.split("/"))

    def read(self, kind: str, relpath: str) -> bytes:
        with open(self.path(kind, relpath), "rb") as f:
            return f.read()

    def digest(self, kind: str, relpath: str, st: os.stat_result | None = None) -> str:
        """sha256 of a file, remembered while its size and mtime do not change."""
        st = st or os.stat(self.path(kind, relpath))
        cached = self._digests.get((kind, relpath))
        if cached and cached[:2] == (st.st_size, st.st_mtime_ns):
            return cached[2]
        d = hashlib.sha256(self.read(kind, relpath)).hexdigest()
        self._digests[(kind, relpath)] = (st.st_size, st.st_mtime_ns, d)
        return d

    def write(self, kind: str, relpath: str, data: bytes, mode: int) -> None:
        """Write atomically (temp file + rename): an engine never sees half a file."""
        target = self.path(kind, relpath)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # ".wa-": scan() and _skip() pass over the temporary file
        write_bytes_atomic(target, data, mode=mode & 0o777, prefix=".wa-")

    def touch(self, kind: str, relpath: str) -> None:
        try:
            os.utime(self.path(kind, relpath))
        except FileNotFoundError:
            pass

    def total_bytes(self) -> int:
        """Bytes of this namespace's files."""
        return sum(st.st_size for kind in KINDS for st in self.files(kind).values())

    def _all_entries(self) -> Any:
        """(recency, size, namespace, kind, relpath) for every file under the root.
        Other namespaces count toward the bound too, so stale ones go first."""
        for ns in os.listdir(self.root):
            if not os.path.isdir(os.path.join(self.root, ns)):
                continue
            for kind in KINDS:
                for rel, st in scan(os.path.join(self.root, ns, kind)).items():
                    yield max(st.st_atime, st.st_mtime), st.st_size, ns, kind, rel

    def evict(self) -> list[tuple[str, str, str]]:
        """Remove least recently used files until the root fits max_bytes; return those removed."""
        entries = sorted(self._all_entries())
        total = sum(e[1] for e in entries)
        removed = []
        for _recency, size, ns, kind, rel in entries:
            if total <= self.max_bytes:
                break
            try:
                os.unlink(os.path.join(self.root, ns, kind, *rel.split("/")))
            except FileNotFoundError:
                pass
            self._digests.pop((kind, rel), None)
            total -= size
            removed.append((ns, kind, rel))
        if removed:
            self._prune_empty_dirs()
        return removed

    def _prune_empty_dirs(self) -> None:
        for ns in os.listdir(self.root):
            for kind in KINDS:
                top = os.path.join(self.root, ns, kind)
                for dirpath, _dirs, _names in os.walk(top, topdown=False):
                    if dirpath != top and not os.listdir(dirpath):
                        try:
                            os.rmdir(dirpath)
                        except OSError:
                            pass

    def clear(self) -> int:
        """Delete every file of this namespace (an invalidation); return how many."""
        n = sum(len(self.files(kind)) for kind in KINDS)
        for kind in KINDS:
            shutil.rmtree(self.dir(kind), ignore_errors=True)
            os.makedirs(self.dir(kind), exist_ok=True)
        self._digests.clear()
        return n
