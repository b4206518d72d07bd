"""Faults around a running agent (real CLI, real redis-server): the shared
kernel-cache tier down, slow, or killed mid-run, and the local cache's disk
full.  Each time the warmup goes on and reaches SERVING; the cache degrades.
(The engine's server killed: tests/test_cli_openai.py.  Latency spike and the
breaker: tests/test_breaker.py.  Memory pressure in prewarm: test_memory_budget.py.)
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess

import pytest
import redis
import requests

from bench import loadgen
from tests.conftest import ROOT, agent_cmd
from tests.helpers.servers import Redis, free_port, wait_until
from warmup_agent import config

SECRET = "faults-secret-0123456789abcdef"
KERNEL = ("inductor", "ab/kernel.main.cpp", b"// kernel\n" * 400)   # 4 kB


def agent_env(tmp_path, embedded_model, data_dir, redis_url, kc_dir):
    secret = tmp_path / "kc.key"
    secret.write_text(SECRET)
    return {"WARMUP_AGENT_KERNEL_CACHE_REDIS_URL": redis_url, "WARMUP_AGENT_KERNEL_CACHE_SECRET_FILE": str(secret),
            "WARMUP_AGENT_KERNEL_CACHE_DIR": str(kc_dir), "WARMUP_AGENT_KERNEL_CACHE_SOCKET_TIMEOUT_SECONDS": "0.3",
            "WARMUP_AGENT_MODEL_PATH": embedded_model, "WARMUP_AGENT_DATA_DIR": data_dir,
            "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]"}


def publish_kernel(env, tmp_path):
    """A first pod with the same configuration publishes one kernel."""
    from warmup_agent.kernel_cache import KernelCache
    cfg = config.load(env={**env, "WARMUP_AGENT_KERNEL_CACHE_DIR": str(tmp_path / "first")})
    first = KernelCache.from_config(cfg.kernel_cache, data_dir=cfg.data_dir, model=cfg.model, solidify=cfg.solidify)
    path = os.path.join(first.local.dir(KERNEL[0]), KERNEL[1])
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(KERNEL[2])
    assert first.publish() == 1
    return first.namespace


def run_once(tmp_path, env):
    rec = tmp_path / "run.json"
    full = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")} | env
    r = subprocess.run(agent_cmd("run", "--once", "--no-progress", "--listen", "127.0.0.1:0", "--record", str(rec)),
                       cwd=ROOT, env=full, capture_output=True, text=True, timeout=180)
    record = json.loads(rec.read_text())
    solidify = next(s for s in record["stages"] if s["name"] == "solidify")
    return r, record, solidify


def test_redis_never_started(tmp_path, embedded_model, data_dir):
    env = agent_env(tmp_path, embedded_model, data_dir, f"redis://127.0.0.1:{free_port()}/0", tmp_path / "kc")
    r, record, solidify = run_once(tmp_path, env)
    assert r.returncode == 0 and record["final_state"] == "SERVING", r.stderr[-2000:]
    assert solidify["kernel_cache"] == "degraded"
    assert "shared tier unavailable" in r.stderr and "Traceback" not in r.stderr


def test_slow_redis_does_not_hold_the_warmup(tmp_path, embedded_model, data_dir):
    (tmp_path / "r").mkdir()
    server = Redis(tmp_path / "r")
    try:
        env = agent_env(tmp_path, embedded_model, data_dir, server.url, tmp_path / "kc")
        publish_kernel(env, tmp_path)
        redis.Redis(port=server.port).execute_command("CLIENT", "PAUSE", "60000", "ALL")   # stalls every client
        r, record, solidify = run_once(tmp_path, env)
        assert r.returncode == 0 and record["final_state"] == "SERVING", r.stderr[-2000:]
        assert solidify["kernel_cache"] == "degraded"
        # SERVING was reached while Redis was still stalled: the agent never waited for it.
        with pytest.raises(redis.exceptions.TimeoutError):
            redis.Redis(port=server.port, socket_timeout=0.3).get("x")
    finally:
        server.proc.kill()   # a paused Redis takes its time over SIGTERM
        server.stop()


def test_redis_killed_mid_run(tmp_path, embedded_model, data_dir):
    (tmp_path / "r").mkdir()
    server = Redis(tmp_path / "r")
    port = free_port()
    env = agent_env(tmp_path, embedded_model, data_dir, server.url, tmp_path / "kc")
    namespace = publish_kernel(env, tmp_path)
    agent = loadgen.start_agent(port, str(tmp_path), env)
    base = f"http://127.0.0.1:{port}"
    try:
        loadgen.wait_for(port, "SERVING", 180, agent)
        text = requests.get(base + "/metrics", timeout=5).text
        assert "warmup_kernel_cache_degraded 0.0" in text
        assert 'warmup_kernel_cache_requests_total{result="hit",tier="shared"} 1.0' in text
        local = tmp_path / "kc" / namespace / KERNEL[0] / KERNEL[1]
        assert local.read_bytes() == KERNEL[2]

        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        r = requests.post(base + "/admin/rewarm", headers={"Authorization": f"Bearer {loadgen.admin_token()}"}, timeout=5)
        assert r.status_code == 202
        wait_until(lambda: requests.get(base + "/readyz", timeout=5).status_code == 200, 120, what="SERVING after re-warm")
        text = requests.get(base + "/metrics", timeout=5).text
        assert "warmup_kernel_cache_degraded 1.0" in text
        assert 'warmup_state_transitions_total{from="PRIME",to="SERVING"} 2.0' in text
        assert local.read_bytes() == KERNEL[2]          # the local tier carries on
    finally:
        rc = loadgen.stop_agent(agent)
        server.stop()
    assert rc == 0


@pytest.fixture
def full_tmpfs(tmp_path):
    """A real 256 kB tmpfs, filled to the last byte."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); needs root or CAP_SYS_ADMIN")
    try:
        os.makedirs(mnt / "kc")
        with open(mnt / "filler", "wb", buffering=0) as f:
            with pytest.raises(OSError) as e:
                while True:
                    f.write(b"\0" * 4096)
            assert e.value.errno == errno.ENOSPC
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_local_cache_disk_full(tmp_path, embedded_model, data_dir, full_tmpfs):
    (tmp_path / "r").mkdir()
    server = Redis(tmp_path / "r")
    try:
        env = agent_env(tmp_path, embedded_model, data_dir, server.url, full_tmpfs / "kc")
        publish_kernel(env, tmp_path)   # restoring it needs disk the local tier does not have
        r, record, _ = run_once(tmp_path, env)
        assert r.returncode == 0 and record["final_state"] == "SERVING", r.stderr[-2000:]
        assert "kernel cache unavailable" in r.stderr and "No space left on device" in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr
    finally:
        server.stop()
