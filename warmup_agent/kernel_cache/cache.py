"""KernelCache: the facade the solidify stage and the CLI use.

    cache = KernelCache.from_config(cfg.kernel_cache, data_dir=..., model=cfg.model, solidify=cfg.solidify,
                                    recorder=recorder)
    os.environ.update(cache.env())       # before the engine compiles anything
    cache.restore()                      # fill the local tier from Redis
    model = cache.compile_once("solidify", compile_and_run_shapes)
    cache.publish()                      # write-through of new artifacts
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar
from urllib.parse import urlsplit

from exporter.recorder import CacheStats, Known
from warmup_agent.kernel_cache import namespace as nsmod
from warmup_agent.kernel_cache import shared as shared_mod
from warmup_agent.kernel_cache.local import ENV_VARS, KINDS, LocalTier, safe_relpath
from warmup_agent.kernel_cache.shared import CHANNEL, REDIS_ERRORS, SharedTier, SharedUnavailable
from warmup_agent.kernel_cache.signing import entry_key, load_secret, sign, verify

if TYPE_CHECKING:
    from exporter.recorder import Recorder
    from warmup_agent.config_sections import KernelCacheSection, ModelSection, SolidifySection

log = logging.getLogger("warmup_agent.kernel_cache")
T = TypeVar("T")

# One pipeline round trip carries at most this many bytes (keeps each request
# well inside the socket timeout on a pod network).
BATCH_BYTES = 8 << 20

@dataclass(frozen=True)
class Settings:
    root: str                       # local tier root; <root>/<namespace>/<kind>
    max_local_bytes: int
    redis_url: str | None = None
    secret: bytes | None = None
    secret_problem: str = ""        # why there is no secret (logged once)
    prefix: str = "warmup:kc"
    ttl_seconds: int = 7 * 24 * 3600
    max_entry_bytes: int = 64 << 20
    socket_timeout: float = 1.0
    retry_interval: float = 30.0
    lock_ttl: float = 600.0
    lock_wait: float = 300.0
    poll_interval: float = 0.2


@dataclass(frozen=True)
class _Entry:
    digest: str
    size: int
    mode: int
    signature: str

    @classmethod
    def parse(cls, raw: bytes) -> "_Entry | None":
        try:
            digest, size, mode, sig = raw.decode().split(" ")
            return cls(digest, int(size), int(mode, 8), sig)
        except (UnicodeDecodeError, ValueError):
            return None

    def encode(self) -> str:
        return f"{self.digest} {self.size} {self.mode:o} {self.signature}"


def _batches(items: Any, size_of: Any) -> Any:
    batch: list = []
    total = 0
    for item in items:
        if batch and total + size_of(item) > BATCH_BYTES:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size_of(item)
    if batch:
        yield batch


class KernelCache:
    def __init__(self, settings: Settings, components: dict, recorder: Recorder | None = None,
                 namespace: str | None = None, announce_off: bool = True):
        self.settings = settings
        self.components = components
        self.namespace = namespace or nsmod.namespace_key(components)
        self.recorder = recorder   # None: no metrics (the kernel-cache CLI)
        self.local = LocalTier(settings.root, self.namespace, settings.max_local_bytes)
        self.counts: collections.Counter = collections.Counter()   # stats(), with or without metrics
        self._logged: set = set()
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self.subscribed = threading.Event()
        if recorder is not None:
            recorder.declare_series(Known(kernel_cache=True))

        self.shared: SharedTier | None = None
        self.off_reason = ""
        if not settings.redis_url:
            self.off_reason = "no kernel_cache.redis_url configured"
        elif settings.secret is None:
            self.off_reason = settings.secret_problem or "no secret configured"
        elif shared_mod.redis is None:
            self.off_reason = "the redis package is not installed (pip install 'warmup-agent[redis]')"
        else:
            self.shared = SharedTier(settings.redis_url, settings.prefix, self.namespace,
                                     settings.socket_timeout, settings.retry_interval, self._on_shared_change)
        if self.shared is None and announce_off:
            self._log_once("off", logging.WARNING, "kernel cache: shared tier off (%s); using the local tier only",
                           self.off_reason)
        if self.shared is None:
            self._record(CacheStats(degraded=True))

    @property
    def _tier(self) -> SharedTier:
        """The shared tier, for the code that runs only while it is on."""
        assert self.shared is not None, "shared-tier code ran with the shared tier off"
        return self.shared

    @property
    def _secret(self) -> bytes:
        """The signing secret: the shared tier is never on without one."""
        assert self.settings.secret is not None, "shared-tier code ran without a secret"
        return self.settings.secret

    # --- construction -----------------------------------------------------------
    @classmethod
    def from_config(cls, kc: KernelCacheSection, *, data_dir: str, model: ModelSection, solidify: SolidifySection,
                    recorder: Recorder | None = None, model_config: Any = None, compile_options: dict | None = None,
                    runtime: dict | None = None, namespace: str | None = None,
                    announce_off: bool = True) -> "KernelCache":
        """Build from the `kernel_cache.*` section (`kc`); `data_dir` holds the local tier
        unless kernel_cache.dir says where.  `model` and `solidify` only name what the
        namespace is about, when not given here:

        model_config: the model's config (dict, config.json path or bytes); default: model.path's
        config.json, else the name of the embedded default.  compile_options: whatever changes the
        compiled code (mode, dynamic shapes, dtype...); default: solidify.mode and model.dtype.
        """
        root = kc.dir or os.path.join(data_dir, "kernel-cache")
        if model_config is None:
            path = model.path
            cfg_json = os.path.join(path, "config.json") if path else None
            model_config = cfg_json if cfg_json and os.path.isfile(cfg_json) else "embedded-default"
        if compile_options is None:
            compile_options = {"solidify.mode": solidify.mode, "model.dtype": model.dtype}
        secret, problem = load_secret(kc.secret, kc.secret_file)
        settings = Settings(
            root=root, max_local_bytes=kc.max_local_bytes,
            redis_url=kc.redis_url, secret=secret, secret_problem=problem,
            prefix=kc.key_prefix, ttl_seconds=kc.ttl_seconds,
            max_entry_bytes=kc.max_entry_bytes,
            socket_timeout=kc.socket_timeout_seconds,
            retry_interval=kc.retry_interval_seconds,
            lock_ttl=kc.lock_ttl_seconds, lock_wait=kc.lock_wait_seconds)
        return cls(settings, nsmod.components(model_config, compile_options, runtime), recorder, namespace, announce_off)

    # --- engines ---------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment variables that point Inductor, Triton and vLLM at the local tier."""
        return {var: self.local.dir(kind) for kind, var in ENV_VARS.items()}

    # --- restore ---------------------------------------------------------------
    def restore(self, kind: str | None = None) -> dict[str, int]:
        """Fill the local tier from the shared tier (before solidify).  Returns counts by "tier/result"."""
        before = collections.Counter(self.counts)
        for k in ([kind] if kind else KINDS):
            if self.shared is not None:
                self._restore_kind(k)
        self._after_change()
        return {key: self.counts[key] - before[key] for key in self.counts if self.counts[key] != before[key]}

    def _restore_kind(self, kind: str) -> None:
        index_key = self._tier.key("index", kind)
        try:
            index = self._tier.call("read index", lambda c: c.hgetall(index_key))
        except SharedUnavailable:
            self._request("shared", "error")
            return
        if not index:
            self._request("shared", "miss")
            return
        present = self.local.files(kind)
        wanted = []
        for field, raw in index.items():
            rel = field.decode("utf-8", "replace")
            entry = _Entry.parse(raw)
            if entry is None or not safe_relpath(rel):
                self._reject(kind, rel, "malformed entry or unsafe path")
                continue
            if rel in present:
                # Keep what the engine already has; mark it recently used.
                self._request("local", "hit")
                self.local.touch(kind, rel)
                continue
            self._request("local", "miss")
            wanted.append((rel, entry))

        fetched = []
        for batch in _batches(wanted, lambda item: item[1].size):
            keys = [self._tier.key("blob", e.digest) for _rel, e in batch]
            try:
                blobs = self._tier.call("fetch entries", lambda c: c.mget(keys))  # noqa: B023 - called at once
            except SharedUnavailable:
                self._request("shared", "error", len(batch))
                continue
            for (rel, entry), data in zip(batch, blobs, strict=True):
                if data is None:  # expired or evicted by Redis
                    self._request("shared", "miss")
                elif (hashlib.sha256(data).hexdigest() != entry.digest or not verify(
                        self._secret, entry_key(self.namespace, kind, rel, entry.mode), data, entry.signature)):
                    self._reject(kind, rel, "signature or digest mismatch")
                else:
                    self.local.write(kind, rel, data, entry.mode)
                    self._request("shared", "hit")
                    fetched.append(entry.digest)
        # Entries in use stay alive: refresh the TTL of what we read.
        self._refresh_ttl([index_key] + [self._tier.key("blob", d) for d in fetched])

    def _reject(self, kind: str, rel: str, why: str) -> None:
        self._request("shared", "rejected")
        self._log_once(("rejected", kind), logging.ERROR,
                       "kernel cache: rejected shared %s entry %r (%s); not used. Is kernel_cache.secret the same "
                       "on every pod? (logged once; warmup_kernel_cache_requests_total{result=\"rejected\"} counts all)",
                       kind, rel, why)

    # --- publish ---------------------------------------------------------------
    def publish(self, kind: str | None = None) -> int:
        """Write new local artifacts through to the shared tier (after solidify).  Returns entries written."""
        n = 0
        for k in ([kind] if kind else KINDS):
            if self.shared is not None:
                n += self._publish_kind(k)
        if n:
            self._register_namespace()
        self._after_change()
        return n

    def _publish_kind(self, kind: str) -> int:
        s = self.settings
        index_key = self._tier.key("index", kind)
        try:
            index = self._tier.call("read index", lambda c: c.hgetall(index_key))
        except SharedUnavailable:
            return 0
        known = {f.decode("utf-8", "replace"): (_Entry.parse(v) or _Entry("", 0, 0, "")).digest for f, v in index.items()}
        todo = []
        for rel, st in self.local.files(kind).items():
            if not safe_relpath(rel):
                continue
            try:
                digest = self.local.digest(kind, rel, st)
            except FileNotFoundError:
                continue
            if known.get(rel) == digest:
                continue
            if st.st_size > s.max_entry_bytes:
                self._record(CacheStats(publish_skipped="too_large"))
                self._log_once(("too_large", kind), logging.WARNING,
                               "kernel cache: not publishing %s entry %r: %d bytes > kernel_cache.max_entry_bytes (%d) (logged once)",
                               kind, rel, st.st_size, s.max_entry_bytes)
                continue
            todo.append((rel, st))

        written = 0
        for batch in _batches(todo, lambda item: item[1].st_size):
            pipe = self._tier.client.pipeline(transaction=False)
            count = 0
            for rel, st in batch:
                try:
                    data = self.local.read(kind, rel)
                except FileNotFoundError:
                    continue
                mode = st.st_mode & 0o777
                digest = hashlib.sha256(data).hexdigest()
                entry = _Entry(digest, len(data), mode, sign(self._secret, entry_key(self.namespace, kind, rel, mode), data))
                pipe.set(self._tier.key("blob", digest), data, ex=s.ttl_seconds)
                pipe.hset(index_key, rel, entry.encode())
                count += 1
            pipe.expire(index_key, s.ttl_seconds)
            try:
                self._tier.call("publish", lambda c: pipe.execute())  # noqa: B023 - called at once
            except SharedUnavailable:
                break
            written += count
        self._record(CacheStats(published=written))
        self.counts["published"] += written
        return written

    def _register_namespace(self) -> None:
        s = self.settings
        info = json.dumps(self.components, sort_keys=True, default=str)

        def register(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            pipe.set(self._tier.key("info"), info, ex=s.ttl_seconds)
            pipe.zadd(self._tier.namespaces_key, {self.namespace: time.time()})
            pipe.execute()
        try:
            self._tier.call("register namespace", register)
        except SharedUnavailable:
            pass

    def _refresh_ttl(self, keys: list[str]) -> None:
        def refresh(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.expire(k, self.settings.ttl_seconds)
            pipe.execute()
        try:
            self._tier.call("refresh ttl", refresh)
        except SharedUnavailable:
            pass

    # --- one compiler per key across the fleet ------------------------------------
    def compile_once(self, key: str, fn: Callable[[], T]) -> T:
        """Run fn (which compiles and fills the local tier) so that only one pod of the
        fleet compiles `key` at a time.  The winner runs fn, publishes, marks the key done.
        Losers wait for that (up to kernel_cache.lock_wait_seconds), restore the winner's
        artifacts and then run fn, which now finds them in the local tier.  Past the
        deadline, or with the shared tier down, a pod compiles by itself."""
        if self.shared is None:
            return fn()
        s = self.settings
        lock_key, done_key = self.shared.key("lock", key), self.shared.key("done", key)
        token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        deadline = time.monotonic() + s.lock_wait
        waited_since = None
        done = False
        try:
            while True:
                if self.shared.call("check done", lambda c: c.exists(done_key)):
                    done = True
                    break
                if self.shared.call("take lock", lambda c: c.set(lock_key, token, nx=True, px=int(s.lock_ttl * 1000))):
                    self._end_wait(waited_since)
                    return self._compile_as_winner(fn, lock_key, done_key, token)
                if waited_since is None:
                    waited_since = time.monotonic()
                    self._record(CacheStats(lock_waited=True))
                    self.counts["lock_waits"] += 1
                    log.info("kernel cache: another pod is compiling %r; waiting up to %.0f s", key, s.lock_wait)
                if time.monotonic() >= deadline:
                    log.warning("kernel cache: waited %.0f s for another pod to compile %r; compiling here",
                                s.lock_wait, key)
                    break
                time.sleep(s.poll_interval)
        except SharedUnavailable:
            pass  # degraded: compile here, local-only
        self._end_wait(waited_since)
        if done:
            self.restore()
        result = fn()
        self.publish()
        return result

    def _compile_as_winner(self, fn: Any, lock_key: Any, done_key: Any, token: Any) -> Any:
        try:
            result = fn()
            self.publish()
            try:
                self._tier.call("mark done", lambda c: c.set(done_key, token, ex=self.settings.ttl_seconds))
            except SharedUnavailable:
                pass  # losers compile themselves at their deadline
            return result
        finally:
            try:
                self._tier.release(lock_key, token)
            except SharedUnavailable:
                pass  # the lock expires by itself

    def _end_wait(self, since: Any) -> None:
        if since is not None:
            self._record(CacheStats(lock_wait_seconds=time.monotonic() - since))

    # --- invalidation --------------------------------------------------------------
    def invalidate(self, all_namespaces: bool = False) -> int:
        """Delete this namespace (or every namespace under the prefix) from Redis and tell
        every pod on the `kernel_schema_change` channel to drop its local copies.
        Returns the number of Redis keys deleted."""
        if self.shared is None:
            self._apply_invalidation(self.namespace)
            return 0
        target = "*" if all_namespaces else self.namespace
        pattern = f"{self.settings.prefix}:{target}:*"

        def purge(c: Any) -> Any:
            deleted = 0
            batch = []
            for k in c.scan_iter(match=pattern, count=500):
                batch.append(k)
                if len(batch) >= 500:
                    deleted += c.unlink(*batch)
                    batch = []
            if batch:
                deleted += c.unlink(*batch)
            if all_namespaces:
                c.unlink(self._tier.namespaces_key)
            else:
                c.zrem(self._tier.namespaces_key, self.namespace)
            c.publish(CHANNEL, json.dumps({"prefix": self.settings.prefix, "namespace": target,
                                           "reason": "purge", "from": socket.gethostname()}))
            return deleted
        deleted = self.shared.call("purge", purge)
        if self._listener is None:   # a listening cache applies its own message
            self._apply_invalidation(target)
        return deleted

    def start_listening(self) -> None:
        """Apply invalidations published on `kernel_schema_change` (background thread)."""
        if self.shared is None or self._listener is not None:
            return
        self._listener = threading.Thread(target=self._listen, name="kernel-cache-invalidations", daemon=True)
        self._listener.start()

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
        if self.shared is not None:
            self.shared.client.close()

    def _listen(self) -> None:
        while not self._stop.is_set():
            pubsub = self._tier.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(CHANNEL)
                self.subscribed.set()
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg.get("type") == "message":
                        self._on_message(msg["data"])
            except REDIS_ERRORS as e:
                self.subscribed.clear()
                self._log_once("listen", logging.WARNING,
                               "kernel cache: invalidation channel lost (%s); retrying every %.0f s",
                               e, self.settings.retry_interval)
                self._stop.wait(self.settings.retry_interval)
            finally:
                pubsub.close()

    def _on_message(self, data: bytes) -> None:
        try:
            msg = json.loads(data)
            prefix, target = msg["prefix"], msg["namespace"]
        except (ValueError, KeyError, TypeError):
            self._log_once("bad-message", logging.WARNING, "kernel cache: ignoring malformed %s message %r",
                           CHANNEL, data[:200])
            return
        if prefix == self.settings.prefix and target in (self.namespace, "*"):
            self._apply_invalidation(target)

    def _apply_invalidation(self, target: str) -> None:
        removed = self.local.clear()
        self._record(CacheStats(invalidated=True))
        self.counts["invalidations"] += 1
        log.warning("kernel cache: namespace %s invalidated; removed %d local files", target, removed)
        self._after_change(evict=False)

    # --- stats -----------------------------------------------------------------------
    def stats(self) -> dict:
        """What the cache holds and has done, for `warmup-agent cache stats` and the report."""
        local_files = {k: len(self.local.files(k)) for k in KINDS}
        out: dict[str, Any] = {
            "namespace": self.namespace,
            "components": self.components,
            "local": {"dir": self.local.base, "bytes": self.local.total_bytes(), "files": local_files,
                      "max_bytes": self.settings.max_local_bytes},
            "shared": {"enabled": self.shared is not None, "off_reason": self.off_reason or None,
                       "server": _redacted(self.settings.redis_url), "degraded": self.degraded},
            "requests": {k: v for k, v in sorted(self.counts.items()) if "/" in k},
            "published": self.counts["published"], "evictions": self.counts["evictions"],
            "lock_waits": self.counts["lock_waits"], "invalidations": self.counts["invalidations"],
        }
        if self.shared is not None:
            try:
                entries, size = self._shared_usage()
                out["shared"].update(entries=entries, bytes=size, degraded=self.degraded)
            except SharedUnavailable:
                out["shared"]["degraded"] = True
        return out

    def namespaces(self) -> list[dict]:
        """Every namespace registered under the prefix, newest first, with its components."""
        if self.shared is None:
            return []

        def read(c: Any) -> Any:
            names = c.zrevrange(self._tier.namespaces_key, 0, -1, withscores=True)
            infos = c.mget([self._tier.key("info", namespace=n.decode()) for n, _ in names]) if names else []
            return [{"namespace": n.decode(), "last_publish": score,
                     "components": json.loads(i) if i else None} for (n, score), i in zip(names, infos, strict=True)]
        return self.shared.call("list namespaces", read)

    @property
    def degraded(self) -> bool:
        return self.shared is None or self.shared.degraded

    def _shared_usage(self) -> tuple[dict, int]:
        """Entries per kind and bytes of distinct blobs of this namespace, from the indexes."""
        def read(c: Any) -> Any:
            pipe = c.pipeline(transaction=False)
            for k in KINDS:
                pipe.hgetall(self._tier.key("index", k))
            return pipe.execute()
        indexes = self._tier.call("read indexes", read)
        sizes = {}
        for index in indexes:
            for raw in index.values():
                e = _Entry.parse(raw)
                if e:
                    sizes[e.digest] = e.size
        return {k: len(ix) for k, ix in zip(KINDS, indexes, strict=True)}, sum(sizes.values())

    # --- bookkeeping ---------------------------------------------------------------------
    def _after_change(self, evict: bool = True) -> None:
        evicted = len(self.local.evict()) if evict else 0
        self.counts["evictions"] += evicted
        sizes = {"local": self.local.total_bytes()}
        if self.shared is not None:
            try:
                sizes["shared"] = self._shared_usage()[1]
            except SharedUnavailable:
                pass
        self._record(CacheStats(evicted_local=evicted, bytes_by_tier=sizes))

    def _on_shared_change(self, degraded: bool, reason: str) -> None:
        self._record(CacheStats(degraded=degraded))
        if degraded:
            log.warning("kernel cache: shared tier unavailable (%s); continuing on the local tier, retrying every %.0f s",
                        reason, self.settings.retry_interval)
        else:
            log.info("kernel cache: shared tier available")

    def _log_once(self, key: Any, level: Any, msg: Any, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args)

    def _request(self, tier: str, result: str, n: int = 1) -> None:
        self.counts[f"{tier}/{result}"] += n
        self._record(CacheStats(lookups={(tier, result): n}))

    def _record(self, s: CacheStats) -> None:
        if self.recorder is not None:
            self.recorder.cache(s)


def _redacted(url: str | None) -> str | None:
    if not url:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"
