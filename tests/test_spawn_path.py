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

import pytest

from tests.conftest import ROOT

# The CLI's own steps up to the spawn (cli.cmd_run), in a fresh interpreter.
SCRIPT = """
import json, sys
from warmup_agent import cli
args = cli.build_parser().parse_args(["run", "--no-progress", "--engine", "openai", "--data-dir", sys.argv[1],
                                      "--", "sleep", "30", "--port", "1"])
cfg, _ = cli._load(args)
engine = cli.make_engine(cfg, None, ["sleep", "30", "--port", "1"])
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
    assert "warmup_agent.engines.openai.engine" in loaded      # the scan sees the engine's modules
    assert not [m for m in NOT_BEFORE_SPAWN if m in loaded], [m for m in NOT_BEFORE_SPAWN if m in loaded]


# --- the early spawn (warmup_agent/server/early_spawn.py) ------------------------------------
EARLY = """
import json, sys
from warmup_agent.server import early_spawn
early_spawn.start(sys.argv[2:])
print(json.dumps({"spawned": early_spawn._early is not None, "modules": sorted(sys.modules)}))
early_spawn.discard()
"""
NOT_BEFORE_EARLY_SPAWN = NOT_BEFORE_SPAWN + ("warmup_agent.engines", "warmup_agent.server.supervisor", "warmup_agent.run.progress",
                                             "warmup_agent.run.tracing", "exporter.server",
                                             # only for a server kind with a remedy (transformers serve)
                                             "warmup_agent.warmup.remedy")


def test_the_early_spawn_happens_before_any_of_the_agents_imports(tmp_path):
    """cli.main calls early_spawn.start first: it spawns the server having loaded the
    configuration and nothing else of the agent (no engine, supervisor, exporter)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["run", "--no-progress", "--engine", "openai", "--data-dir", str(tmp_path), "--", sys.executable, "-c",
            "import time; time.sleep(30)", "--port", str(port)]
    out = subprocess.run([sys.executable, "-c", EARLY, "x", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["spawned"], "a server command after -- is spawned early"
    loaded = set(found["modules"])
    assert not [m for m in NOT_BEFORE_EARLY_SPAWN if m in loaded], [m for m in NOT_BEFORE_EARLY_SPAWN if m in loaded]


def _engine_would_start(argv: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """What the openai engine starts for this command line: the CLI's own parse and
    config load, then the engine's server_command and server_env."""
    from tests.helpers.engines import openai_engine
    from warmup_agent import cli, config
    from warmup_agent.server import process as server_process
    args = cli.build_parser().parse_args(argv)
    cfg = config.load(args.config, env={k: v for k, v in environ.items() if k.startswith("WARMUP_AGENT_")},
                      flags={"data_dir": args.data_dir, "engine": "openai"})
    command = [a for a in args.server_command if a != "--"]
    engine = openai_engine(cfg, server_command=command, base_env=dict(environ))
    return engine.server.server_command(), server_process.final_env(engine.server.server_env())


@pytest.mark.parametrize("case", ["flags", "env", "file", "file_and_flag", "lora"])
def test_the_early_plan_is_what_the_engine_would_start(tmp_path, case):
    """The early spawn's command and environment equal the engine's, worked out the
    long way (config.load, OpenAIEngine), wherever data_dir and lora.adapters come from."""
    from warmup_agent.server import early_spawn
    from warmup_agent.server import process as server_process
    environ = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    opts = ["--engine", "openai"]
    if case == "flags":
        opts += ["--data-dir", str(tmp_path / "flag")]
    elif case == "env":
        environ["WARMUP_AGENT_DATA_DIR"] = str(tmp_path / "env")
    elif case in ("file", "file_and_flag", "lora"):
        (tmp_path / "agent.yaml").write_text(f"data_dir: {tmp_path / 'file'}\n"
                                             + ("lora:\n  adapters: a=/p\n" if case == "lora" else ""))
        opts += ["--config", str(tmp_path / "agent.yaml")]
        if case == "file_and_flag":
            opts += [f"--data-dir={tmp_path / 'flag'}"]
    argv = ["run", *opts, "--", "llama-server", "-m", "x.gguf", "--host", "0.0.0.0", "--port", "8012"]
    planned = early_spawn.plan(argv, environ)
    assert planned is not None
    command, env, _ = planned
    assert (command, server_process.final_env(env)) == _engine_would_start(argv, environ)


@pytest.mark.parametrize("argv", [
    ["run", "--engine", "openai", "--", "vllm", "serve", "m", "--port", "8000"],    # vLLM: budget from the config
    ["run", "--help", "--", "llama-server"],                                          # not an option the plan knows
    ["run", "--once"],                                                                # no server command
    ["check-config", "a.yaml", "--", "llama-server"],
    ["run", "--engine", "torch", "--", "llama-server", "--port", "8012"],            # a config error: not openai
    ["run", "--config", "/nonexistent/agent.yaml", "--", "llama-server"],            # a config error: no file
])
def test_nothing_is_spawned_early_where_the_plan_cannot_be_sure(argv):
    from warmup_agent.server import early_spawn
    assert early_spawn.plan(argv, {"PATH": "/usr/bin"}) is None


def test_a_bad_configuration_spawns_nothing(tmp_path):
    """The configuration is loaded and checked before the spawn, requests file
    included: a bad one starts no server (tests/test_requests_file.py checks the CLI)."""
    from warmup_agent.server import early_spawn
    (tmp_path / "requests.jsonl").write_text("{not json\n")
    environ = {"PATH": "/usr/bin:/bin", "WARMUP_AGENT_PREWARM_REQUESTS_FILE": str(tmp_path / "requests.jsonl")}
    argv = ["run", "--engine", "openai", "--data-dir", str(tmp_path), "--", "llama-server", "--port", "8012"]
    assert early_spawn.plan(argv, environ) is None
    environ.pop("WARMUP_AGENT_PREWARM_REQUESTS_FILE")
    assert early_spawn.plan(argv, environ) is not None      # the control: the same line, a good configuration


def test_an_early_server_that_differs_is_killed_and_the_reason_given(tmp_path):
    from warmup_agent.server import early_spawn
    argv = ["run", "--engine", "openai", "--data-dir", str(tmp_path), "--", sys.executable, "-c",
            "import time; time.sleep(30)", "--port", "1"]
    early_spawn.start(argv)
    early = early_spawn._early
    assert early is not None
    command, env, _ = early_spawn.plan(argv, dict(__import__("os").environ))
    taken, why = early_spawn.take(command, {**env, "EXTRA": "1"})
    assert taken is None and why == "the environment differs (EXTRA)"
    assert early.proc.poll() is not None, "the early server is killed"
    early_spawn.start(argv)
    taken, why = early_spawn.take(command, env)
    assert taken is not None and why is None and taken.proc.poll() is None
    taken.proc.kill()
    taken.proc.wait()


@pytest.mark.slow   # an agent process
def test_an_early_server_does_not_outlive_a_run_that_fails_after_the_spawn(tmp_path, data_dir):
    """The exporter's address is taken (exit 2, after the early spawn): the server
    spawned early is killed with the run."""
    import socket

    import psutil

    from tests.conftest import run_agent
    marker = f"early-spawn-orphan-{tmp_path.name}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = run_agent("run", "--no-progress", "--engine", "openai", "--data-dir", data_dir,
                      "--listen", f"127.0.0.1:{taken.getsockname()[1]}", "--",
                      sys.executable, "-c", f"import time; time.sleep(60)  # {marker}", "--port", "1", timeout=120)
    assert r.returncode == 2 and "cannot listen" in r.stderr, r.stderr[-2000:]
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def test_the_early_spawn_knows_every_option_of_run():
    """early_spawn reads `run`'s options by hand (argparse and the parser's imports
    would come before the spawn): its lists must be the parser's, or a new option would
    turn the early spawn off without anyone noticing."""
    import argparse

    from warmup_agent import cli
    from warmup_agent.server import early_spawn
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    run = sub.choices["run"]
    valued = {s for a in run._actions if a.option_strings and a.nargs is None and a.const is None
              for s in a.option_strings}
    flags = {s for a in run._actions if a.option_strings and a.nargs == 0 for s in a.option_strings} - {"-h", "--help"}
    assert early_spawn._VALUED == valued and early_spawn._FLAGS == flags


LISTEN_EARLY = """
import json, socket, sys
from warmup_agent.server import early_spawn
early_spawn.start(sys.argv[3:])
host, port = sys.argv[2].rsplit(":", 1)
client = socket.create_connection((host, int(port)), timeout=5)    # refused unless bound
sock = early_spawn.take_listener(sys.argv[2])
accepted = sock is not None and sock.accept()[0] is not None
print(json.dumps({"accepted": accepted, "modules": sorted(sys.modules)}))
early_spawn.discard()
"""


def test_the_proxy_address_listens_from_the_early_spawn(tmp_path):
    """With --proxy-listen, the early spawn binds the proxy's address too: a user who
    connects before the agent has imported its proxy is queued by the kernel, not
    refused (issue 71), and the proxy adopts that socket (take_listener)."""
    import socket
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    listen = f"127.0.0.1:{ports[1]}"
    argv = ["run", "--no-progress", "--engine", "openai", "--data-dir", str(tmp_path), "--proxy-listen", listen,
            "--", sys.executable, "-c", "import time; time.sleep(30)", "--port", str(ports[0])]
    out = subprocess.run([sys.executable, "-c", LISTEN_EARLY, "x", listen, *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["accepted"]
    loaded = set(found["modules"])
    assert not [m for m in (*NOT_BEFORE_EARLY_SPAWN, "warmup_agent.proxy", "asyncio") if m in loaded]
