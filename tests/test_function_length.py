"""No function in warmup_agent/ or exporter/ is longer than 80 lines (issue 24),
generated files aside: a unit a newcomer can read in one screen or two."""
from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 80
GENERATED = {"warmup_agent/config_sections.py", "exporter/metric_handles.py"}


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function or method over `limit` lines,
    decorators excluded, nested functions and classes included in their parent."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                out.append((node.name, node.lineno, lines))
    return out


def test_the_scan_counts_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert long_functions(f"def f():\n{body}\n") == [("f", 1, 81)]
    assert long_functions(f"def f():\n{body}\n", limit=81) == []


def test_no_function_over_the_limit():
    found = []
    for pkg in ("warmup_agent", "exporter"):
        for path in sorted(glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True)):
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if rel in GENERATED:
                continue
            found += [f"{rel}:{line}: {name} is {n} lines" for name, line, n in
                      long_functions(open(path, encoding="utf-8").read())]
    assert found == []
