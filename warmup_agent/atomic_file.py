"""Whole files or none: write a temporary file beside the target, then rename it in place.

The one way the agent replaces a file of its own (the run record, the validation
baseline, the server findings, a model's tokenizer config, a kernel cache file):
a reader sees the old file or the new one, never half of one.  A write that fails
(an object JSON cannot serialize, a full disk, an interrupt) removes its temporary
file and raises again, so each caller keeps its own error handling and log lines.

The ground floor: imports only the standard library.  No fsync, as none of the
writers it replaced had one: the rename is atomic against other processes, not
against a power cut.
"""
from __future__ import annotations

import errno
import json
import os
from typing import Any

__all__ = ["write_bytes_atomic", "write_json_atomic"]


def _open_temporary(directory: str, prefix: str, suffix: str, perms: int) -> tuple[int, str]:
    """A new file of a name unused in `directory`, opened for writing, created with
    `perms` (less the umask, as open() does).  Named from os.urandom, which costs no
    import (`secrets` and `tempfile` import `random`)."""
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
    # mode None: the permissions open(path, "w") would give (0o666 less the umask);
    # otherwise created private and set to `mode` once written.
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
    """Replace `path` with `data`.  `mode`: the file's permissions (default: what
    open() gives a new file); `prefix`: the temporary file's name starts so
    (default `.<name>.`), for directories whose readers skip names of their own."""
    _write_atomic(path, lambda f: f.write(data), True, mode, prefix)


def write_json_atomic(path: str, obj: Any, *, mode: int | None = None, prefix: str | None = None,
                      **json_kwargs: Any) -> None:
    """Replace `path` with `obj` as JSON (UTF-8); `json_kwargs` go to json.dump
    (indent, sort_keys, default...).  `mode` and `prefix` as for write_bytes_atomic."""
    _write_atomic(path, lambda f: json.dump(obj, f, **json_kwargs), False, mode, prefix)
