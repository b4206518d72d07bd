"""The agent needs only its core dependencies: without the optional `redis`
package (the `redis` extra) it still warms the embedded model to SERVING, with
the kernel cache's shared tier off and saying why.  (Found on the H200 host,
which has no redis-py: the CLI died importing it.)  Without torch and transformers
(the `torch` extra) the openai engine, the exporter, the readiness gate and the proxy
still import and run; an engine whose extra is missing is one line and exit 2."""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BLOCK_REDIS = '''
import sys
class NoRedis:
    def find_spec(self, name, path=None, target=None):
        if name == "redis" or name.startswith("redis."):
            raise ImportError("redis is not installed (blocked by the test)")
sys.meta_path.insert(0, NoRedis())
from warmup_agent.cli import main
sys.exit(main(sys.argv[1:]))
'''


def test_run_once_without_redis_py(tmp_path, data_dir, embedded_model):
    rec = tmp_path / "run.json"
    r = subprocess.run([sys.executable, "-c", BLOCK_REDIS, "run", "--once", "--no-progress", "--data-dir", data_dir,
                        "--listen", "127.0.0.1:0", "--record", str(rec)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "WARMUP_AGENT_KERNEL_CACHE_REDIS_URL": "redis://127.0.0.1:1/0",
                            "WARMUP_AGENT_KERNEL_CACHE_SECRET": "s" * 32})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(rec.read_text())["final_state"] == "SERVING"
    assert "the redis package is not installed" in r.stderr


# torch and transformers are the `torch` extra: the openai engine, the exporter, the
# readiness gate and the proxy must not need them (the sidecar image has neither;
# tests/test_images.py warms the real vLLM server from such an environment).
BLOCK_TORCH = '''
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(name + " is not installed (blocked by the test)")
sys.meta_path.insert(0, NoTorch())
'''

NO_TORCH_IMPORTS = BLOCK_TORCH + '''
import exporter.collectors, exporter.engine_metrics, exporter.metrics, exporter.server
import warmup_agent.engines.openai.engine, warmup_agent.pipeline, warmup_agent.proxy, warmup_agent.server.reaper
import warmup_agent.readiness.breaker, warmup_agent.readiness.runtime, warmup_agent.readiness.window
import warmup_agent.stages.prewarm, warmup_agent.stages.ready, warmup_agent.stages.reserve, warmup_agent.stages.solidify
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
'''


def test_openai_engine_exporter_gate_and_proxy_import_without_torch():
    r = subprocess.run([sys.executable, "-c", NO_TORCH_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


def _run_without_torch(tmp_path, *args, env=None):
    code = BLOCK_TORCH + "from warmup_agent.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, "run", "--once", "--no-progress", "--data-dir", str(tmp_path),
                           "--listen", "127.0.0.1:0", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


@pytest.mark.parametrize("engine,extra", [("torch", "torch"), ("vllm", "vllm")])
def test_engine_without_its_extra_is_one_line_exit_2(tmp_path, engine, extra):
    r = _run_without_torch(tmp_path, "--engine", engine, "--model", str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], "one line, no traceback"
    assert f"pip install 'warmup-agent[{extra}]'" in r.stderr and "key 'engine'" in r.stderr


def test_openai_engine_runs_to_a_named_failure_without_torch(tmp_path):
    """The whole run path (config, exporter, pipeline, engine) without torch: a server that
    never answers is FAILED with its reason, exit 3 -- not an ImportError."""
    from tests.helpers.servers import free_port
    rec = tmp_path / "run.json"
    r = _run_without_torch(tmp_path, "--engine", "openai", "--record", str(rec),
                           "--proxy-listen", f"127.0.0.1:{free_port()}",
                           env={"WARMUP_AGENT_OPENAI_URL": f"http://127.0.0.1:{free_port()}",
                                "WARMUP_AGENT_OPENAI_READY_TIMEOUT_SECONDS": "1"})
    assert r.returncode == 3, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "blocked by the test" not in r.stderr
    assert "No module named" not in r.stderr
    record = json.loads(rec.read_text())
    assert record["final_state"] == "FAILED" and record["failure_reason"] == "server_never_healthy"
