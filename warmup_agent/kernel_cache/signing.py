"""HMAC-SHA256 signatures of shared entries, and where the secret comes from.

The signature covers the entry's key (namespace, kind, relative path, file
mode) and its bytes, so a flipped byte, an entry moved under another key or a
different secret all fail verification.  Without a secret the shared tier is
off: an unsigned cache shared by a fleet would let anyone who can write to
Redis run code in every pod.
"""
from __future__ import annotations

import hashlib
import hmac

MIN_SECRET_BYTES = 16


def load_secret(secret: str | None, secret_file: str | None) -> tuple[bytes | None, str]:
    """Return (secret, "") or (None, why the shared tier is off)."""
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                raw = f.read().strip()
        except OSError as e:
            return None, f"cannot read kernel_cache.secret_file {secret_file}: {e.strerror}"
        where = f"kernel_cache.secret_file {secret_file}"
    elif secret:
        raw = secret.encode().strip()
        where = "kernel_cache.secret"
    else:
        return None, "no secret configured (kernel_cache.secret_file or kernel_cache.secret)"
    if len(raw) < MIN_SECRET_BYTES:
        return None, f"{where} holds {len(raw)} bytes; expected at least {MIN_SECRET_BYTES}"
    return raw, ""


def entry_key(namespace: str, kind: str, relpath: str, mode: int) -> bytes:
    return f"{namespace}\0{kind}\0{relpath}\0{mode:o}\0".encode()


def sign(secret: bytes, key: bytes, data: bytes) -> str:
    return hmac.new(secret, key + data, hashlib.sha256).hexdigest()


def verify(secret: bytes, key: bytes, data: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(secret, key, data), signature)
