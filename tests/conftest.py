"""Shared fixtures: the embedded model (built once per machine into .cache/), a
fresh config per test, a running agent process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

# Built once and reused across test sessions: creating it trains a tokenizer (~5 s).
TEST_DATA = os.environ.get("WARMUP_TEST_DATA", os.path.join(ROOT, ".cache", "test-data"))


@pytest.fixture(scope="session")
def data_dir() -> str:
    os.makedirs(TEST_DATA, exist_ok=True)
    return TEST_DATA


@pytest.fixture(scope="session")
def embedded_model(data_dir) -> str:
    from warmup_agent.model.embedded import ensure_embedded_model
    return ensure_embedded_model(data_dir)


@pytest.fixture(scope="session")
def llama_server() -> str:
    """llama.cpp's llama-server, CPU build (tools/build_llama_server.py; built once, cached)."""
    from tests.helpers import llamacpp_server
    return llamacpp_server.ensure_binary(cuda="off")


@pytest.fixture(scope="session")
def gguf(embedded_model) -> str:
    """The embedded model as a GGUF for llama-server (tools/gguf_convert.py; cached)."""
    from tests.helpers import llamacpp_server
    return llamacpp_server.ensure_gguf(embedded_model)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on 127.0.0.1, its data in the test's folder (the kernel cache's
    shared tier, the shared server findings)."""
    from tests.helpers.servers import Redis
    d = tmp_path / "redis"
    d.mkdir()
    server = Redis(d)
    yield server
    server.stop()


@pytest.fixture
def clean_env(monkeypatch):
    """No WARMUP_AGENT_* variables leak in from the developer's shell."""
    for k in list(os.environ):
        if k.startswith("WARMUP_AGENT_"):
            monkeypatch.delenv(k)
    return monkeypatch


def agent_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "warmup_agent", *args]


def run_agent(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    full_env.update(env or {})
    return subprocess.run(agent_cmd(*args), cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


# `make test-fast` runs `-m "not slow"`.  A test is slow when it starts a real server,
# an agent process, a vLLM server, helm or promtool, or takes over 5 s here.  Tests
# marked by hand carry `@pytest.mark.slow`; these fixtures mark every test that uses
# them, directly or through another fixture, so a new test that loads the model or
# starts Redis or Helm is never in the fast loop by mistake.
SLOW_FIXTURES = {
    "embedded_model",   # builds or loads the model: imports transformers, then usually a whole warmup
    "redis_server",     # a real redis-server (tests/test_kernel_cache.py)
    "helm_env",         # the Helm binary (tests/test_helm_chart.py)
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
