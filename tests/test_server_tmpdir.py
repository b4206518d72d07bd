"""A supervised server's TMPDIR is short enough for the Unix sockets servers bind there.

transformers serve (Python's multiprocessing: <TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX)
and vLLM (IPC sockets) bind Unix sockets in TMPDIR, whose path may be at most 107 bytes.
The agent used to give the server <data_dir>/tmp/server whatever its length, and a
long data directory made transformers serve fail on its first request with "AF_UNIX
path too long" (seen in CI under pytest's tmp_path).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from warmup_agent.server.command import MAX_SERVER_TMPDIR, server_env, server_tmpdir

# What transformers serve's processes do when they pass a tensor: multiprocessing's
# resource sharer listens on a Unix socket under TMPDIR.
LISTEN = "from multiprocessing.connection import Listener; Listener(family='AF_UNIX').close(); print('ok')"


def _listen_in(tmpdir: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TMP", "TEMP")}
    env["TMPDIR"] = tmpdir
    return subprocess.run([sys.executable, "-c", LISTEN], env=env, capture_output=True, text=True, timeout=60)


def test_a_short_data_dir_keeps_the_servers_scratch_inside_it():
    root = tempfile.mkdtemp(dir="/tmp")      # pytest's tmp_path is itself over 64 bytes
    try:
        data = os.path.join(root, "d")
        assert server_tmpdir(data) == os.path.join(data, "tmp", "server")
        env = server_env({}, data, "127.0.0.1", None)
        assert env["TMPDIR"] == os.path.join(data, "tmp", "server") and os.path.isdir(env["TMPDIR"])
    finally:
        shutil.rmtree(root)


def test_a_long_data_dir_gets_a_short_scratch_where_a_unix_socket_binds(tmp_path):
    data = tmp_path / ("a-data-directory-with-a-long-name-" * 3) / "data"
    assert len(str(data / "tmp" / "server")) > MAX_SERVER_TMPDIR
    env = server_env({}, str(data), "127.0.0.1", None)
    tmpdir = env["TMPDIR"]
    assert len(tmpdir) <= MAX_SERVER_TMPDIR and os.path.isdir(tmpdir)
    # The same data directory gets the same folder (early spawn plans the same environment
    # the engine compares), another one another folder.
    assert server_tmpdir(str(data)) == tmpdir
    assert server_tmpdir(str(data) + "2") != tmpdir
    done = _listen_in(tmpdir)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-500:]
    # The folder the agent used to give is where the listener fails: the check can fail.
    old = str(data / "tmp" / "server")
    os.makedirs(old, exist_ok=True)
    failed = _listen_in(old)
    assert failed.returncode != 0 and "AF_UNIX path too long" in failed.stderr


def test_a_relative_data_dir_is_measured_where_it_lies(tmp_path, monkeypatch):
    deep = tmp_path / ("a-working-directory-with-a-long-name-" * 2)
    deep.mkdir()
    monkeypatch.chdir(deep)
    tmpdir = server_tmpdir("d")          # short as written, long as an absolute path
    assert len(os.path.abspath(tmpdir)) <= MAX_SERVER_TMPDIR


def test_a_tmpdir_the_caller_set_is_kept(tmp_path):
    env = server_env({"TMPDIR": str(tmp_path)}, str(tmp_path / ("x" * 90)), "127.0.0.1", None)
    assert env["TMPDIR"] == str(tmp_path)
