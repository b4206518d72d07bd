"""The shared tier: Redis, guarded so that trouble there never stops the agent.

Keys (prefix default "warmup:kc", ns = namespace key):
  {prefix}:{ns}:index:{kind}   hash  relpath -> "sha256 size mode signature"
  {prefix}:{ns}:blob:{sha256}  bytes of one artifact (content-addressed)
  {prefix}:{ns}:info           JSON of the namespace components (for `cache stats`)
  {prefix}:{ns}:lock:{key}     the compile lock (SET NX PX), value = owner token
  {prefix}:{ns}:done:{key}     set by the winner after its publish
  {prefix}:namespaces          sorted set: namespace -> last publish time
Publishing refreshes the TTL on every key of a namespace, so an unused one expires.

A Redis error marks the tier degraded, and calls then fail at once for
retry_interval seconds: a dead Redis costs one timeout per interval, not per entry.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
except ImportError:  # the `redis` extra is not installed: the shared tier stays off
    redis = None  # type: ignore[assignment]
    REDIS_ERRORS = (OSError,)

log = logging.getLogger("warmup_agent.kernel_cache")

CHANNEL = "kernel_schema_change"  # seed 000 §4.3, kept verbatim

# Compare-and-delete: the lock may have expired and been taken by another pod.
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


class SharedUnavailable(Exception):
    """The shared tier cannot answer now; the caller continues local-only."""


class SharedTier:
    def __init__(self, url: str, prefix: str, namespace: str, socket_timeout: float,
                 retry_interval: float, on_change: Callable[[bool, str], None]):
        self.url = url
        self.prefix = prefix
        self.namespace = namespace
        self.retry_interval = retry_interval
        self._on_change = on_change   # (degraded, reason)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.degraded = False
        # No client-side retries: our own back-off decides when to try again.
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)

    # --- keys ---------------------------------------------------------------
    def key(self, *parts: str, namespace: str | None = None) -> str:
        return ":".join((self.prefix, namespace or self.namespace) + parts)

    @property
    def namespaces_key(self) -> str:
        return f"{self.prefix}:namespaces"

    # --- guard --------------------------------------------------------------
    def call(self, what: str, fn: Callable[[redis.Redis], object]) -> Any:
        """Run fn(client); on any Redis trouble mark degraded and raise SharedUnavailable."""
        if time.monotonic() < self._down_until:
            raise SharedUnavailable(f"shared tier degraded; next try in {self._down_until - time.monotonic():.0f} s")
        try:
            result = fn(self.client)
        except (redis.RedisError, OSError) as e:
            self._set(True, f"{what}: {type(e).__name__}: {e}")
            self._down_until = time.monotonic() + self.retry_interval
            raise SharedUnavailable(str(e)) from None
        self._set(False, "")
        return result

    def _set(self, degraded: bool, reason: str) -> None:
        with self._lock:
            changed = degraded != self.degraded
            self.degraded = degraded
        if changed:
            self._on_change(degraded, reason)

    def release(self, lock_key: str, token: str) -> None:
        self.call("release lock", lambda c: c.eval(_RELEASE, 1, lock_key, token))
