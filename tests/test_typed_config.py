"""Typed config everywhere (issue 24): outside warmup_agent/config.py a key of the
configuration is read as a typed attribute of its section, `cfg.prewarm.max_batch`
(warmup_agent/config_sections.py, which mypy checks), never by string,
`cfg["prewarm.max_batch"]`."""
from __future__ import annotations

import ast
import glob
import os

from warmup_agent.config import KEYS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = {k.path for k in KEYS} | {"engine", "data_dir"}
# Files left out of the scan, and why; the list only shrinks (it is empty now).
EXCEPTIONS: dict[str, str] = {
}


def lookups(source: str) -> list[tuple[int, str]]:
    """(line, key) of every subscript by a configuration key: `x["readiness.min_probes"]`,
    whatever `x` is called (a dict of the tokenizer's settings keyed "chat_template" is
    not one), except config.BY_PATH, the keys' declarations (their defaults)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in NAMES
                and not ast.unparse(node.value).endswith("BY_PATH")):
            out.append((node.lineno, node.slice.value))
    return out


def test_the_scan_finds_a_lookup():
    assert lookups('x = cfg["prewarm.max_batch"]\ny = f"{cfg[\'engine\']}"\nt["chat_template"] = 1\n'
                   'd = BY_PATH["engine"].default\n') == [
        (1, "prewarm.max_batch"), (2, "engine")]


def test_no_string_lookup_outside_config():
    found = []
    for pkg in ("warmup_agent", "exporter"):
        for path in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True):
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if rel == "warmup_agent/config.py" or rel in EXCEPTIONS:
                continue
            found += [f"{rel}:{line}: [{key!r}]" for line, key in lookups(open(path, encoding="utf-8").read())]
    assert found == []



# Who may see the whole Config (issue 42): the command line and the composition root,
# which hand every other component the sections it reads (`cfg.readiness`,
# `cfg.openai`...).  server/early_spawn.py is the command line's first step (it loads
# the configuration before the agent's imports, to spawn the server).
SEES_ALL = {"warmup_agent/config.py", "warmup_agent/cli.py", "warmup_agent/pipeline.py",
            "warmup_agent/server/early_spawn.py"}
# Still taking the whole Config, and why; the list only shrinks.
STILL_WHOLE: dict[str, str] = {}


def imports_config(source: str) -> bool:
    """Whether a module imports the Config class (type-only imports included)."""
    return any(isinstance(node, ast.ImportFrom) and node.module == "warmup_agent.config"
               and any(a.name == "Config" for a in node.names) for node in ast.walk(ast.parse(source)))


def test_only_the_composition_root_sees_the_whole_config():
    assert imports_config("if TYPE_CHECKING:\n    from warmup_agent.config import Config\n")
    assert not imports_config("from warmup_agent.config import ConfigError\n")
    found = set()
    for pkg in ("warmup_agent", "exporter"):
        for path in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True):
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if imports_config(open(path, encoding="utf-8").read()):
                found.add(rel)
    assert found - SEES_ALL - set(STILL_WHOLE) == set(), "take the sections you read, not the whole Config"
    # the list only shrinks: a module that stopped taking the whole Config leaves it
    assert set(STILL_WHOLE) <= found, "drop it from STILL_WHOLE"
