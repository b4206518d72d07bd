"""The server findings shared by every pod, through the kernel cache's Redis.

A new pod's data directory is empty, so without this a freshly scaled pod would
measure the per-length test again, though the answer is the server's, not the pod's.
The findings live in one hash, `{key_prefix}:findings`, a field per server key, each
entry signed with the kernel cache's HMAC secret.  Without the secret nothing is
shared: an unsigned entry would let anyone who reaches Redis decide what pods measure.

Trouble with Redis is one warning line, never a failed start.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from warmup_agent.kernel_cache.signing import load_secret, sign, verify

if TYPE_CHECKING:
    from warmup_agent.config_sections import KernelCacheSection

log = logging.getLogger("warmup_agent.warmup")

_SIGNED = b"server-findings\0"


class SharedFindings:
    """The findings hash in the kernel cache's Redis."""

    def __init__(self, url: str, prefix: str, secret: bytes, socket_timeout: float, ttl_seconds: int):
        import redis
        self.url, self.secret, self.ttl = url, secret, ttl_seconds
        self.hash = f"{prefix}:findings"
        self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)

    @classmethod
    def from_config(cls, kc: KernelCacheSection) -> SharedFindings | None:
        """The store, where there is a Redis URL, a secret and the `redis` extra."""
        if not kc.redis_url:
            return None
        secret, _ = load_secret(kc.secret, kc.secret_file)
        if secret is None:
            return None
        try:
            return cls(kc.redis_url, kc.key_prefix, secret, kc.socket_timeout_seconds, kc.ttl_seconds)
        except ImportError:
            return None

    @property
    def where(self) -> str:
        """Where an entry came from, for the record (no password in it)."""
        host = self.url.split("@")[-1]
        return f"redis {host.split('://')[-1]} {self.hash}"

    @staticmethod
    def _signed_key(key: str) -> bytes:
        """What the signature covers besides the entry: the hash's name and the field."""
        return _SIGNED + key.encode() + b"\0"

    def get(self, key: str) -> dict | None:
        """The entry for `key`, when one is there and its signature verifies."""
        try:
            raw = self.client.hget(self.hash, key)
        except self._errors as e:
            log.warning("server findings not read from %s: %s; this start uses its own", self.where, e)
            return None
        if raw is None:
            return None
        try:
            value = json.loads(raw)
            payload = json.dumps(value["entry"], sort_keys=True).encode()
            ok = verify(self.secret, self._signed_key(key), payload, str(value["signature"]))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            log.warning("server findings in %s for %s: not signed with this secret; measuring again", self.where, key)
            return None
        entry: Any = value["entry"]
        return entry if isinstance(entry, dict) else None

    def put(self, key: str, entry: dict) -> None:
        """Share `entry` for `key`; the hash lives kernel_cache.ttl_seconds after the last write."""
        payload = json.dumps(entry, sort_keys=True).encode()
        value = json.dumps({"entry": entry, "signature": sign(self.secret, self._signed_key(key), payload)},
                           sort_keys=True)
        try:
            with self.client.pipeline(transaction=True) as p:
                p.hset(self.hash, key, value)
                p.expire(self.hash, self.ttl)
                p.execute()
        except self._errors as e:
            log.warning("server findings not shared through %s: %s", self.where, e)
