"""Kernel cache against a real redis-server on 127.0.0.1.

Every "pod" is a KernelCache with its own local directory and its own metrics
registry; pods share one Redis.  Exported numbers are checked against what the
test reads itself from disk and from Redis.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import redis

from exporter.metrics import AgentMetrics
from exporter.recorder import Recorder
from tests.helpers import servers
from tests.helpers.paths import ROOT
from tests.helpers.servers import Redis, free_port, wait_until
from warmup_agent import config
from warmup_agent.kernel_cache import CHANNEL, KernelCache, Settings
from warmup_agent.kernel_cache import namespace as nsmod
from warmup_agent.kernel_cache.signing import load_secret

SECRET = b"0123456789abcdef0123456789abcdef"
RUNTIME = {"torch": "2.13.0", "triton": None, "vllm": None, "cuda": None, "compute_capability": None}
COMPONENTS = nsmod.components({"hidden_size": 128, "layers": 2}, {"mode": "default"}, RUNTIME)
# Artifacts shaped like the engines' own caches; the lock file must never be shared.
ARTIFACTS = {
    ("inductor", "ab/cab123.main.so"): os.urandom(3000),
    ("inductor", "ab/cab123.main.cpp"): b"// generated kernel\n" * 50,
    ("inductor", "fxgraph/sz/fszkey/entry"): os.urandom(700),
    ("triton", "HASH1/matmul.cubin"): os.urandom(1500),
    ("triton", "HASH1/__grp__matmul.json"): b'{"child_paths": {}}',
}
SCRATCH = {("inductor", "locks/cab123.lock"): b""}


def client(server) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def make_pod(tmp_path, name, url, secret=SECRET, **overrides) -> KernelCache:
    settings = Settings(root=str(tmp_path / name), max_local_bytes=overrides.pop("max_local_bytes", 1 << 30),
                        redis_url=url, secret=secret, secret_problem=overrides.pop("secret_problem", ""),
                        socket_timeout=overrides.pop("socket_timeout", 0.5),
                        retry_interval=overrides.pop("retry_interval", 0.0),
                        poll_interval=0.05, **overrides)
    return KernelCache(settings, COMPONENTS, Recorder(AgentMetrics()))


def value(pod, name, **labels) -> float:
    v = pod.recorder.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def requests(pod, tier, result) -> float:
    return value(pod, "warmup_kernel_cache_requests_total", tier=tier, result=result)


def write_artifacts(pod, artifacts=ARTIFACTS) -> None:
    for (kind, rel), data in artifacts.items():
        path = os.path.join(pod.local.dir(kind), *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def local_files(pod) -> dict:
    """(kind, relpath) -> bytes, read straight from disk."""
    out = {}
    for kind in ("inductor", "triton", "vllm"):
        top = pod.local.dir(kind)
        for dirpath, _, names in os.walk(top):
            for n in names:
                full = os.path.join(dirpath, n)
                with open(full, "rb") as f:
                    out[(kind, os.path.relpath(full, top))] = f.read()
    return out


def redis_keys(server, pattern="*") -> list[bytes]:
    return list(client(server).scan_iter(match=pattern))


def shared_blob_bytes(server, namespace) -> int:
    c = client(server)
    return sum(c.strlen(k) for k in c.scan_iter(match=f"warmup:kc:{namespace}:blob:*"))


# --- two pods, one Redis --------------------------------------------------------------

def test_second_pod_restores_what_the_first_published(tmp_path, redis_server):
    a = make_pod(tmp_path, "a", redis_server.url)
    assert a.restore() == {"shared/miss": 3}          # nothing published yet: one miss per kind
    write_artifacts(a, {**ARTIFACTS, **SCRATCH})

    assert a.publish() == len(ARTIFACTS)
    c = client(redis_server)
    indexed = sum(c.hlen(f"warmup:kc:{a.namespace}:index:{k}") for k in ("inductor", "triton", "vllm"))
    assert indexed == len(ARTIFACTS)                     # the lock file stayed local
    assert value(a, "warmup_kernel_cache_publishes_total") == indexed
    assert value(a, "warmup_kernel_cache_bytes", tier="shared") == shared_blob_bytes(redis_server, a.namespace)
    assert value(a, "warmup_kernel_cache_bytes", tier="local") == sum(map(len, local_files(a).values()))
    assert a.publish() == 0                              # nothing new: nothing written
    assert value(a, "warmup_kernel_cache_degraded") == 0
    ttl = c.ttl(f"warmup:kc:{a.namespace}:index:inductor")
    assert 0 < ttl <= 7 * 24 * 3600

    b = make_pod(tmp_path, "b", redis_server.url)
    assert local_files(b) == {}
    b.restore()
    assert local_files(b) == ARTIFACTS                   # byte for byte
    assert requests(b, "shared", "hit") == len(ARTIFACTS)
    assert requests(b, "local", "miss") == len(ARTIFACTS)
    assert requests(b, "shared", "miss") == 1            # vllm: nothing published
    assert requests(b, "shared", "rejected") == 0 and requests(b, "shared", "error") == 0
    assert value(b, "warmup_kernel_cache_bytes", tier="local") == sum(map(len, ARTIFACTS.values()))

    b.restore()                                          # a restart of pod b: all local now
    assert requests(b, "local", "hit") == len(ARTIFACTS)
    assert requests(b, "shared", "hit") == len(ARTIFACTS)
    stats = b.stats()
    assert stats["shared"]["entries"] == {"inductor": 3, "triton": 2, "vllm": 0}
    assert stats["shared"]["bytes"] == shared_blob_bytes(redis_server, b.namespace)


def test_other_namespace_sees_nothing(tmp_path, redis_server):
    a = make_pod(tmp_path, "a", redis_server.url)
    write_artifacts(a)
    a.publish()
    other = KernelCache(a.settings.__class__(**{**a.settings.__dict__, "root": str(tmp_path / "c")}),
                        nsmod.components({"hidden_size": 128, "layers": 2}, {"mode": "default"},
                                         {**RUNTIME, "torch": "2.14.0"}), Recorder(AgentMetrics()))
    assert other.namespace != a.namespace
    other.restore()
    assert local_files(other) == {}
    assert requests(other, "shared", "miss") == 3


# --- signatures ---------------------------------------------------------------------------

def _published(tmp_path, server):
    a = make_pod(tmp_path, "a", server.url)
    write_artifacts(a)
    a.publish()
    return a


def _index_entry(server, ns, kind, rel) -> tuple[str, list[str]]:
    raw = client(server).hget(f"warmup:kc:{ns}:index:{kind}", rel).decode()
    return raw, raw.split(" ")


def test_flipped_byte_is_rejected_counted_and_logged_once(tmp_path, redis_server, caplog):
    a = _published(tmp_path, redis_server)
    c = client(redis_server)
    for kind, rel in [("inductor", "ab/cab123.main.so"), ("triton", "HASH1/matmul.cubin")]:
        _, (digest, *_rest) = _index_entry(redis_server, a.namespace, kind, rel)
        blob = f"warmup:kc:{a.namespace}:blob:{digest}"
        byte = c.getrange(blob, 10, 10)
        c.setrange(blob, 10, bytes([byte[0] ^ 0x01]))
    b = make_pod(tmp_path, "b", redis_server.url)
    with caplog.at_level(logging.ERROR, logger="warmup_agent.kernel_cache"):
        b.restore()
        b.restore()
    got = local_files(b)
    assert ("inductor", "ab/cab123.main.so") not in got and ("triton", "HASH1/matmul.cubin") not in got
    assert got == {k: v for k, v in ARTIFACTS.items() if k[1] not in ("ab/cab123.main.so", "HASH1/matmul.cubin")}
    assert requests(b, "shared", "rejected") == 4       # two entries, two restores
    assert requests(b, "shared", "hit") == 3
    assert len([r for r in caplog.records if "rejected" in r.getMessage()]) == 2   # once per kind


def test_entry_moved_under_another_key_is_rejected(tmp_path, redis_server):
    a = _published(tmp_path, redis_server)
    c = client(redis_server)
    index = f"warmup:kc:{a.namespace}:index:inductor"
    raw, _ = _index_entry(redis_server, a.namespace, "inductor", "ab/cab123.main.so")
    # A valid, signed artifact served under another name (e.g. another kernel's hash).
    c.hset(index, "ab/cab999.main.so", raw)
    c.hset(index, "../../escaped.so", raw)             # and outside the cache directory
    b = make_pod(tmp_path, "b", redis_server.url)
    b.restore()
    assert ("inductor", "ab/cab999.main.so") not in local_files(b)
    assert not os.path.exists(tmp_path / "b" / "escaped.so") and not os.path.exists(tmp_path / "escaped.so")
    assert requests(b, "shared", "rejected") == 2
    assert local_files(b) == ARTIFACTS


def test_wrong_secret_rejects_everything(tmp_path, redis_server):
    _published(tmp_path, redis_server)
    b = make_pod(tmp_path, "b", redis_server.url, secret=b"another-secret-of-32-bytes-00000")
    b.restore()
    assert local_files(b) == {}
    assert requests(b, "shared", "rejected") == len(ARTIFACTS)
    assert requests(b, "shared", "hit") == 0


def test_without_a_secret_the_shared_tier_is_off(tmp_path, redis_server, caplog):
    with caplog.at_level(logging.WARNING, logger="warmup_agent.kernel_cache"):
        pod = make_pod(tmp_path, "a", redis_server.url, secret=None,
                       secret_problem="no secret configured (kernel_cache.secret_file or kernel_cache.secret)")
        write_artifacts(pod)
        assert pod.publish() == 0
        pod.restore()
        pod.publish()
    assert client(redis_server).dbsize() == 0           # nothing unsigned ever reaches Redis
    assert value(pod, "warmup_kernel_cache_degraded") == 1
    assert local_files(pod) == ARTIFACTS                # the local tier keeps working
    lines = [r.getMessage() for r in caplog.records if "shared tier off" in r.getMessage()]
    assert lines == ["kernel cache: shared tier off (no secret configured (kernel_cache.secret_file or "
                     "kernel_cache.secret)); using the local tier only"]
    assert pod.compile_once("k", lambda: 42) == 42


def test_secret_sources(tmp_path):
    f = tmp_path / "key"
    f.write_bytes(b"k" * 32 + b"\n")
    assert load_secret(None, str(f)) == (b"k" * 32, "")
    assert load_secret("s" * 20, None) == (b"s" * 20, "")
    assert load_secret(None, None)[0] is None
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    assert load_secret(None, str(short)) == (None, f"kernel_cache.secret_file {short} holds 3 bytes; expected at least 16")
    assert load_secret(None, str(tmp_path / "missing")) == (
        None, f"cannot read kernel_cache.secret_file {tmp_path / 'missing'}: No such file or directory")


def test_from_config(tmp_path, redis_server, clean_env):
    key = tmp_path / "hmac"
    key.write_bytes(SECRET)
    cfg = config.load(env={"WARMUP_AGENT_KERNEL_CACHE_REDIS_URL": redis_server.url,
                           "WARMUP_AGENT_KERNEL_CACHE_SECRET_FILE": str(key),
                           "WARMUP_AGENT_DATA_DIR": str(tmp_path / "data")})
    pod = KernelCache.from_config(cfg.kernel_cache, data_dir=cfg.data_dir, model=cfg.model, solidify=cfg.solidify,
                                  recorder=Recorder(AgentMetrics()), runtime=RUNTIME)
    assert pod.shared is not None and pod.settings.secret == SECRET
    assert pod.env() == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "data" / "kernel-cache" / pod.namespace / "inductor"),
                         "TRITON_CACHE_DIR": str(tmp_path / "data" / "kernel-cache" / pod.namespace / "triton"),
                         "VLLM_CACHE_ROOT": str(tmp_path / "data" / "kernel-cache" / pod.namespace / "vllm")}
    with pytest.raises(config.ConfigError, match=r"key 'kernel_cache.max_local_bytes': got 0; expected an integer > 0"):
        config.load(env={"WARMUP_AGENT_KERNEL_CACHE_MAX_LOCAL_BYTES": "0"})


# --- degraded, never down ---------------------------------------------------------------------

def test_redis_never_started(tmp_path):
    pod = make_pod(tmp_path, "a", f"redis://127.0.0.1:{free_port()}/0")
    write_artifacts(pod)
    assert pod.restore() == {"shared/error": 3}
    assert pod.publish() == 0
    assert value(pod, "warmup_kernel_cache_degraded") == 1
    assert pod.compile_once("solidify", lambda: "compiled") == "compiled"
    assert local_files(pod) == ARTIFACTS
    assert pod.stats()["shared"]["degraded"] is True


def test_redis_killed_mid_run_and_restarted(tmp_path, redis_server, monkeypatch):
    a = make_pod(tmp_path, "a", redis_server.url, retry_interval=0.2)
    write_artifacts(a)
    a.publish()
    port = redis_server.port
    redis_server.stop()

    write_artifacts(a, {("inductor", "cd/new.so"): b"new kernel"})
    assert a.publish() == 0
    assert value(a, "warmup_kernel_cache_degraded") == 1
    b = make_pod(tmp_path, "b", redis_server.url)
    b.restore()                                          # a new pod while Redis is down
    assert requests(b, "shared", "error") >= 1 and local_files(b) == {}
    assert b.compile_once("solidify", lambda: "compiled") == "compiled"

    monkeypatch.setattr(servers, "free_port", lambda: port)
    (tmp_path / "redis2").mkdir()
    again = Redis(tmp_path / "redis2")                   # same port, empty (no persistence)
    try:
        # Back after the retry interval: the next publish writes everything again.
        wait_until(lambda: a.publish() == len(ARTIFACTS) + 1, 10, what="publish after Redis came back")
        assert value(a, "warmup_kernel_cache_degraded") == 0
        assert sum(client(again).hlen(k) for k in client(again).scan_iter(match="*:index:*")) == len(ARTIFACTS) + 1
    finally:
        again.stop()


def test_slow_redis_times_out_to_local(tmp_path, redis_server):
    _published(tmp_path, redis_server)
    b = make_pod(tmp_path, "b", redis_server.url, socket_timeout=0.3, retry_interval=60)
    # Redis stalls every client for 5 s (Redis 7.0 pauses even UNPAUSE: let it expire).
    client(redis_server).execute_command("CLIENT", "PAUSE", "5000", "ALL")
    started = time.monotonic()
    b.restore()
    write_artifacts(b, {("triton", "H2/k.cubin"): b"x" * 10})
    assert b.publish() == 0
    assert b.compile_once("solidify", lambda: "compiled") == "compiled"
    assert time.monotonic() - started < 5                # did not wait for the stalled server
    assert requests(b, "shared", "error") >= 1
    assert value(b, "warmup_kernel_cache_degraded") == 1
    assert local_files(b) == {("triton", "H2/k.cubin"): b"x" * 10}


@pytest.mark.slow  # a real redis-server
def test_full_redis_degrades_publish(tmp_path):
    (tmp_path / "r").mkdir()
    server = Redis(tmp_path / "r", ["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    try:
        a = make_pod(tmp_path, "a", server.url, retry_interval=60)
        big = {("inductor", f"xx/k{i}.so"): os.urandom(512 * 1024) for i in range(8)}
        write_artifacts(a, big)
        published = a.publish()
        assert published < len(big)
        assert value(a, "warmup_kernel_cache_degraded") == 1
        assert local_files(a) == big
    finally:
        server.stop()


# --- one compiler per key ---------------------------------------------------------------

def test_racing_pods_compile_exactly_once(tmp_path, redis_server):
    pods = [make_pod(tmp_path, f"p{i}", redis_server.url) for i in range(4)]
    compiled = []
    barrier = threading.Barrier(len(pods))
    results = [None] * len(pods)

    def compile_fn(pod):
        def fn():
            path = os.path.join(pod.local.dir("inductor"), "ab", "kernel.so")
            if os.path.exists(path):           # found in the local tier: no compile
                return "hit"
            compiled.append(pod)
            # Hold the lock (a long compile) until every other pod is waiting for it.
            wait_until(lambda: sum(value(p, "warmup_kernel_cache_lock_waits_total") for p in pods) == len(pods) - 1,
                       20, what="the other pods waiting on the lock")
            write_artifacts(pod, {("inductor", "ab/kernel.so"): b"compiled kernel"})
            return "compiled"
        return fn

    def race(i):
        barrier.wait()
        results[i] = pods[i].compile_once("solidify:shapes", compile_fn(pods[i]))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(pods))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(compiled) == 1
    assert sorted(results) == ["compiled", "hit", "hit", "hit"]
    for p in pods:
        assert local_files(p)[("inductor", "ab/kernel.so")] == b"compiled kernel"
    waits = sum(value(p, "warmup_kernel_cache_lock_waits_total") for p in pods)
    assert waits == 3
    assert sum(value(p, "warmup_kernel_cache_lock_wait_seconds_count") for p in pods) == waits
    c = client(redis_server)
    ns = pods[0].namespace
    assert c.exists(f"warmup:kc:{ns}:done:solidify:shapes") and not c.exists(f"warmup:kc:{ns}:lock:solidify:shapes")


def test_loser_compiles_itself_after_the_deadline(tmp_path, redis_server, caplog):
    pod = make_pod(tmp_path, "a", redis_server.url, lock_wait=0.5)
    c = client(redis_server)
    c.set(f"warmup:kc:{pod.namespace}:lock:solidify", "a-pod-that-hung", px=60_000)
    calls = []
    with caplog.at_level(logging.WARNING, logger="warmup_agent.kernel_cache"):
        assert pod.compile_once("solidify", lambda: calls.append(1) or "compiled") == "compiled"
    assert calls == [1]
    assert value(pod, "warmup_kernel_cache_lock_waits_total") == 1
    assert value(pod, "warmup_kernel_cache_lock_wait_seconds_sum") >= 0.5
    assert any("compiling here" in r.getMessage() for r in caplog.records)
    assert c.get(f"warmup:kc:{pod.namespace}:lock:solidify") == b"a-pod-that-hung"   # not ours to release


# --- local tier bound -----------------------------------------------------------------------

def test_lru_bound_keeps_the_most_recently_used(tmp_path):
    pod = make_pod(tmp_path, "a", None, max_local_bytes=10_000)
    now = time.time()
    # A stale namespace left by an older version: the oldest files of all.
    stale = tmp_path / "a" / "0ldnamespace" / "triton" / "H"
    stale.mkdir(parents=True)
    for i in range(5):
        (stale / f"old{i}").write_bytes(b"o" * 1000)
        os.utime(stale / f"old{i}", (now - 10_000, now - 10_000))
    for i in range(30):
        rel = f"d{i % 7}/k{i:02d}.so"
        write_artifacts(pod, {("inductor", rel): b"k" * 1000})
        os.utime(os.path.join(pod.local.dir("inductor"), rel), (now - 1000 + i, now - 1000 + i))
    pod.publish()                                         # shared tier off: evicts only
    kept = sorted(rel for (_kind, rel) in local_files(pod))
    assert kept == sorted(f"d{i % 7}/k{i:02d}.so" for i in range(20, 30))
    assert not list(stale.iterdir()) if stale.exists() else True
    assert value(pod, "warmup_kernel_cache_evictions_total", tier="local") == 25
    assert value(pod, "warmup_kernel_cache_bytes", tier="local") == 10_000


def test_restore_marks_entries_used(tmp_path, redis_server):
    a = _published(tmp_path, redis_server)
    past = time.time() - 5000
    for kind, rel in ARTIFACTS:
        os.utime(os.path.join(a.local.dir(kind), *rel.split("/")), (past, past))
    a.restore()                                           # all local hits: touched
    for kind, rel in ARTIFACTS:
        st = os.stat(os.path.join(a.local.dir(kind), *rel.split("/")))
        assert max(st.st_atime, st.st_mtime) > past + 4000


# --- invalidation -------------------------------------------------------------------------

def test_schema_change_message_invalidates_listening_pods(tmp_path, redis_server):
    a = _published(tmp_path, redis_server)
    a.start_listening()
    c = client(redis_server)
    wait_until(lambda: c.pubsub_numsub(CHANNEL)[0][1] >= 1, 10, what="pod subscribed")
    try:
        # A message for another namespace is ignored...
        c.publish(CHANNEL, json.dumps({"prefix": "warmup:kc", "namespace": "someothernamespace", "reason": "purge"}))
        c.publish(CHANNEL, b"not json")
        # ...a purge of ours (from another pod or `warmup-agent cache purge`) drops our copies.
        b = make_pod(tmp_path, "b", redis_server.url)
        deleted = b.invalidate()
        assert deleted >= len(ARTIFACTS)
        wait_until(lambda: value(a, "warmup_kernel_cache_invalidations_total") == 1, 10, what="invalidation applied")
        assert local_files(a) == {}
        assert redis_keys(redis_server, f"warmup:kc:{a.namespace}:*") == []
        assert value(a, "warmup_kernel_cache_bytes", tier="local") == 0
    finally:
        a.close()


# --- CLI ---------------------------------------------------------------------------------------

def _cli(monkeypatch, capsys, *args, env):
    """Run `warmup-agent cache ...` in-process (the same parser the lead's CLI registers)."""
    from warmup_agent.kernel_cache.cli import _standalone
    with monkeypatch.context() as m:
        for k in list(os.environ):
            if k.startswith("WARMUP_AGENT_"):
                m.delenv(k)
        for k, v in env.items():
            m.setenv(k, v)
        rc = _standalone(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_push_pull_stats_purge(tmp_path, redis_server, monkeypatch, capsys):
    key = tmp_path / "hmac"
    key.write_bytes(SECRET)
    env = {"WARMUP_AGENT_KERNEL_CACHE_REDIS_URL": redis_server.url,
           "WARMUP_AGENT_KERNEL_CACHE_SECRET_FILE": str(key)}
    rc, out, err = _cli(monkeypatch, capsys, "cache", "--data-dir", str(tmp_path / "one"), "stats", "--json", env=env)
    assert rc == 0, err
    st = json.loads(out)
    local = type("Local", (), {"dir": staticmethod(lambda kind: os.path.join(st["local"]["dir"], kind))})
    write_artifacts(type("Pod", (), {"local": local})())

    rc, out, err = _cli(monkeypatch, capsys, "cache", "--data-dir", str(tmp_path / "one"), "push", env=env)
    assert rc == 0, err
    assert out.strip() == f"published {len(ARTIFACTS)} entries to namespace {st['namespace']}"

    rc, out, err = _cli(monkeypatch, capsys, "cache", "--data-dir", str(tmp_path / "two"), "pull", env=env)
    assert rc == 0, err
    two = os.path.join(str(tmp_path / "two"), "kernel-cache", st["namespace"], "inductor", "ab", "cab123.main.so")
    with open(two, "rb") as f:
        assert f.read() == ARTIFACTS[("inductor", "ab/cab123.main.so")]

    rc, out, err = _cli(monkeypatch, capsys, "cache", "--data-dir", str(tmp_path / "two"), "stats", "--all", env=env)
    assert rc == 0, err
    assert "entries: inductor=3, triton=2, vllm=0" in out and st["namespace"] in out

    rc, out, err = _cli(monkeypatch, capsys, "cache", "purge", env={**env, "WARMUP_AGENT_DATA_DIR": str(tmp_path / "two")})
    assert rc == 0, err
    assert redis_keys(redis_server, f"warmup:kc:{st['namespace']}:*") == []

    rc, out, err = _cli(monkeypatch, capsys, "cache", "pull", env={"WARMUP_AGENT_DATA_DIR": str(tmp_path / "three")})
    assert (rc, err) == (1, "warmup-agent cache pull: shared tier off: no kernel_cache.redis_url configured\n")
    rc, out, err = _cli(monkeypatch, capsys, "cache", "stats", env={"WARMUP_AGENT_KERNEL_CACHE_TTL_SECONDS": "-1"})
    assert (rc, err) == (2, "warmup-agent cache: environment WARMUP_AGENT_KERNEL_CACHE_TTL_SECONDS: "
                            "key 'kernel_cache.ttl_seconds': got -1; expected an integer > 0 (seconds)\n")


# --- real torch.compile (Inductor on the CPU) --------------------------------------------------

@pytest.mark.slow
def test_new_pod_restores_inductor_artifacts_and_skips_compiling(tmp_path):
    """Two processes, one Redis: the second restores the first's Inductor artifacts and its
    torch.compile is served from them (Inductor's own counters say hit, not miss)."""
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_kernel_cache.py"), "--model", "mlp",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    cold, warm = result["runs"]["cold"], result["runs"]["warm"]
    assert cold["inductor_counters"]["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert cold["published_entries"] >= 1
    assert warm["cache_requests"]["shared/hit"] == cold["published_entries"]
    assert warm["cache_requests"].get("shared/rejected", 0) == 0
    assert warm["inductor_counters"]["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert warm["inductor_counters"]["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert result["same_output"] is True
