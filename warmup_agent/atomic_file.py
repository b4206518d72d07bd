"""Whole files or none: write a temporary file beside the target, then rename it in place.

A reader sees the old file or the new one, never half of one.  A failed write removes
its temporary file and raises again.  No fsync: the rename is atomic against other
processes, not against a power cut.  Imports only the standard library.
"""
from __future__ import annotations

import errno
import json
import os
from typing import Any

__all__ = ["write_bytes_atomic", "write_json_atomic"]


def _open_temporary(directory: str, prefix: str, suffix: str, perms: int) -> tuple[int, str]:
    """Create a new file in `directory` with `perms` (less the umask).  Named from
    os.urandom, which costs no import, unlike `tempfile`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f"{prefix}{os.urandom(6).hex()}{suffix}")
        try:
            return os.open(tmp, flags, perms), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", directory)


def _write_atomic(path: str, write: Any, binary: bool, mode: int | None, prefix: str | None) -> None:
    directory = os.path.dirname(path) or "."
    if prefix is None:
        prefix = f".{os.path.basename(path)}."
    # With a mode, create private and chmod once written.
    fd, tmp = _open_temporary(directory, prefix, ".tmp", 0o666 if mode is None else 0o600)
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_bytes_atomic(path: str, data: bytes, *, mode: int | None = None, prefix: str | None = None) -> None:
    """Replace `path` with `data`.  `prefix` names the temporary file (default
    `.<name>.`), for directories whose readers skip names of their own."""
    _write_atomic(path, lambda f: f.write(data), True, mode, prefix)


def write_json_atomic(path: str, obj: Any, *, mode: int | None = None, prefix: str | None = None,
                      **json_kwargs: Any) -> None:
    """Replace `path` with `obj` as UTF-8 JSON; `json_kwargs` go to json.dump."""
    _write_atomic(path, lambda f: json.dump(obj, f, **json_kwargs), False, mode, prefix)
