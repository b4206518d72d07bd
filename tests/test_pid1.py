"""The agent as PID 1 of a container (the chart's entrypoint mode), on the CPU:
it runs as PID 1 of a new PID namespace (`unshare --pid --fork --mount-proc`,
util-linux, needs root), so processes orphaned below it are re-parented to it.

- A grandchild orphaned by the server command is adopted, and once it exits no
  zombie is left (warmup_agent/server/reaper.py); with the init turned off
  (WARMUP_NO_INIT=1) the same zombie stays: the check can fail.
- The real CPU vLLM server with its engine-core process: after the API server is
  killed, the engine core (re-parented to PID 1 and killed with the server's
  process group) leaves no zombie, and SIGTERM to PID 1 still drains: exit 0,
  state DRAINING, nothing left running in the namespace.
"""
import json
import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers.servers import free_port, http_get, wait_until
from tests.helpers.vllm_server import server_command, server_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root and unshare (util-linux) for a PID namespace")


def start_as_pid1(args, env, log):
    """The agent as PID 1 of a new PID namespace; (unshare process, PID 1's host pid)."""
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *agent_cmd(*args)],
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wait_until(lambda: psutil.Process(outer.pid).children(), 30, what="PID 1 of the namespace")
    return outer, psutil.Process(outer.pid).children()[0].pid


def zombies_below(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True) if p.status() == psutil.STATUS_ZOMBIE]


def agent_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env.update(extra)
    return env


@pytest.mark.parametrize("init", [True, False], ids=["agent-init", "init-off"])
def test_orphaned_grandchild_leaves_no_zombie(tmp_path, data_dir, init):
    marker = f"orphan-{os.getpid()}-{init}"
    # The subshell starts the grandchild and exits at once: the grandchild is orphaned
    # and adopted by PID 1; it exits 2 s later.  The "server" itself never answers.
    server = ["bash", "-c", f"(exec -a {marker} sleep 2 &); exec sleep 600"]
    env = agent_env({"WARMUP_AGENT_OPENAI_READY_TIMEOUT_SECONDS": "120"})
    if not init:
        env["WARMUP_NO_INIT"] = "1"
    with open(tmp_path / "agent.log", "w") as log:
        outer, pid1 = start_as_pid1(["run", "--no-progress", "--engine", "openai", "--data-dir", data_dir,
                                     "--listen", "127.0.0.1:0", "--", *server], env, log)
    try:
        def orphan():
            return [p for p in psutil.process_iter(["pid", "cmdline"]) if (p.info["cmdline"] or [""])[0] == marker]
        wait_until(orphan, 30, interval=0.05, what="the grandchild")
        child = orphan()[0]
        assert child.ppid() == pid1, "the orphan is adopted by PID 1 of the namespace"
        if init:
            wait_until(lambda: not psutil.pid_exists(child.pid), 10, what="the orphan reaped")
            assert not zombies_below(pid1)
        else:
            time.sleep(4)  # well past its exit: nothing waits for it
            assert child.status() == psutil.STATUS_ZOMBIE, "without an init the orphan stays a zombie"
    finally:
        os.kill(pid1, signal.SIGKILL)  # PID 1 gone: the kernel kills the whole namespace
        outer.wait(30)


@pytest.mark.slow
def test_vllm_under_pid1_engine_core_reaped_and_sigterm_drains(tmp_path, embedded_model, data_dir):
    port, listen = free_port(), free_port()
    env = server_env(str(tmp_path))
    env = agent_env({k: v for k, v in env.items() if not k.startswith("WARMUP_AGENT_")})
    # Engine core in its own process, as in vLLM's image; no restart within the test.
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", WARMUP_AGENT_PREWARM_PROMPT_LENGTHS="[16]",
               WARMUP_AGENT_PREWARM_BATCH_SIZES="[1]", WARMUP_AGENT_OPENAI_RESTART_BACKOFF_INITIAL_SECONDS="600")
    rec = tmp_path / "run.json"
    log = open(tmp_path / "agent.log", "w")
    outer, pid1 = start_as_pid1(["run", "--no-progress", "--engine", "openai", "--data-dir", data_dir,
                                 "--listen", f"127.0.0.1:{listen}", "--record", str(rec),
                                 "--", *server_command(embedded_model, port)], env, log)
    url = f"http://127.0.0.1:{listen}"
    try:
        wait_until(lambda: http_get(url + "/readyz")[0] == 200, 300, what="SERVING under PID 1")
        server = [p for p in psutil.Process(pid1).children(recursive=True)  # not the agent: its argv has the command too
                  if f"--port {port}" in " ".join(p.cmdline()) and "warmup_agent" not in " ".join(p.cmdline())]
        api = [p for p in server if p.ppid() not in {q.pid for q in server}]  # the engine core is forked from it
        assert len(api) == 1, server
        cores = api[0].children(recursive=True)
        assert cores, "vLLM's engine core runs as a child process of the API server"
        api[0].send_signal(signal.SIGKILL)
        wait_until(lambda: not any(psutil.pid_exists(c.pid) for c in cores), 30,
                   what="engine core gone (killed with the group, reaped by PID 1)")
        wait_until(lambda: http_get(url + "/readyz")[0] == 503, 10, what="readiness drops")
        assert not zombies_below(pid1)

        started = time.monotonic()
        os.kill(pid1, signal.SIGTERM)
        assert outer.wait(120) == 0, (tmp_path / "agent.log").read_text()[-3000:]
        assert time.monotonic() - started < 60
        assert json.loads(rec.read_text())["final_state"] == "DRAINING"
    finally:
        if outer.poll() is None:
            os.kill(pid1, signal.SIGKILL)
            outer.wait(30)
        log.close()
    assert not psutil.pid_exists(pid1)
