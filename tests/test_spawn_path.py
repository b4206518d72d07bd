"""What `warmup-agent run ... -- SERVER` imports before it spawns the server (issue 30).

A supervised server's start-up overlaps everything the agent does after the spawn, so
what comes before it is on the critical path of every start: on llama.cpp the server is
up 1.2-1.5 s after its spawn, and the agent's pre-spawn work was 0.3 s of its 2.5 s.
The argument parser used to import the kernel cache's facade (the Redis client and its
OpenTelemetry modules, 0.2-0.3 s here), and the engine urllib.request (http.client,
ssl, email: about 30 ms); both now load after the spawn.
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

# The CLI's own steps up to the spawn (cli.cmd_run), in a fresh interpreter.
SCRIPT = """
import json, sys
from warmup_agent import cli
from warmup_agent.engines import create
args = cli.build_parser().parse_args(["run", "--no-progress", "--engine", "openai", "--data-dir", sys.argv[1],
                                      "--", "sleep", "30", "--port", "1"])
cfg, _ = cli._load(args)
engine = create(cfg, None, server_command=["sleep", "30", "--port", "1"])
before = set(sys.modules)
engine.prestart()
print(json.dumps(sorted(before)))
engine.close()
"""
NOT_BEFORE_SPAWN = ("redis", "warmup_agent.kernel_cache.cache", "urllib.request", "http.client",
                    "prometheus_client", "warmup_agent.pipeline", "torch", "transformers")


def test_nothing_heavy_is_imported_before_the_server_is_spawned(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "warmup_agent.engines.openai_engine" in loaded      # the scan sees the engine's modules
    assert not [m for m in NOT_BEFORE_SPAWN if m in loaded], [m for m in NOT_BEFORE_SPAWN if m in loaded]
