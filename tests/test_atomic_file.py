"""warmup_agent/atomic_file.py: the file is replaced whole or not at all, and a write
that fails leaves the old file as it was and no temporary file beside it."""
from __future__ import annotations

import ast
import json
import os
import stat
import sys

import pytest

from warmup_agent import atomic_file
from warmup_agent.atomic_file import write_bytes_atomic, write_json_atomic


def test_written_and_readable(tmp_path):
    path = tmp_path / "record.json"
    write_json_atomic(str(path), {"b": 1, "a": [1, 2]}, indent=2, sort_keys=True)
    assert json.loads(path.read_text(encoding="utf-8")) == {"a": [1, 2], "b": 1}
    assert path.read_text(encoding="utf-8").startswith('{\n  "a"')       # json_kwargs reach json.dump
    write_json_atomic(str(path), {"c": 3})                                 # replaces an existing file
    assert json.loads(path.read_text(encoding="utf-8")) == {"c": 3}
    assert os.listdir(tmp_path) == ["record.json"]


def test_a_json_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text('{"old": true}', encoding="utf-8")
    # json.dump has written '{"ok": 1, "bad": ' to the temporary file when it meets the object
    with pytest.raises(TypeError):
        write_json_atomic(str(path), {"ok": 1, "bad": object()}, indent=2)
    assert path.read_text(encoding="utf-8") == '{"old": true}'
    assert os.listdir(tmp_path) == ["baseline.json"]


def test_a_rename_that_fails_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "findings.json"

    def refuse(src, dst):
        raise OSError("disk gone")
    monkeypatch.setattr(atomic_file.os, "replace", refuse)
    with pytest.raises(OSError, match="disk gone"):
        write_bytes_atomic(str(path), b"data", mode=0o600, prefix=".wa-")
    assert os.listdir(tmp_path) == []


def test_bytes_with_a_mode_and_a_prefix(tmp_path):
    path = tmp_path / "kernel.so"
    write_bytes_atomic(str(path), b"\x00\x01", mode=0o751, prefix=".wa-")
    assert path.read_bytes() == b"\x00\x01"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o751


def test_without_a_mode_the_permissions_are_those_open_gives(tmp_path):
    path, plain = tmp_path / "a.json", tmp_path / "b.json"
    write_json_atomic(str(path), {})
    plain.write_text("{}")
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)


def test_the_module_imports_only_the_standard_library():
    """It is on the ground floor (tests/test_import_graph.py): nothing of the agent, nothing installed."""
    tree = ast.parse(open(atomic_file.__file__, encoding="utf-8").read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - set(sys.stdlib_module_names) == set()
