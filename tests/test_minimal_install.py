"""The agent needs only its core dependencies: without the optional `redis`
package (the `redis` extra) it still warms the embedded model to SERVING, with
the kernel cache's shared tier off and saying why.  (Found on the H200 host,
which has no redis-py: the CLI died importing it.)"""
import json
import subprocess
import sys

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
