"""The import graph of warmup_agent/ and exporter/ (issues 17, 24): no cycle, lazy
imports (inside functions) and type-only imports (under `if TYPE_CHECKING:`)
included; and the
exporter reaches the agent only through exporter.server.ServedAgent, importing
nothing of warmup_agent but parsing helpers and host facts."""
from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("warmup_agent", "exporter")
# What exporter/ may import from warmup_agent/: config and web-config parsing, host
# facts for the NVML collector, the allocator snapshot arithmetic.  Not the pipeline,
# the stages, the state machine or the engines.
EXPORTER_MAY_IMPORT = {"warmup_agent.config", "warmup_agent.webconfig", "warmup_agent.host.hardware", "warmup_agent.gpu.memory"}


def _modules() -> dict[str, str]:
    mods = {}
    for pkg in PACKAGES:
        for path in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True):
            name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: str, name: str, mods: dict[str, str]) -> set[str]:
    """Modules of `mods` that `name` imports anywhere: functions and
    `if TYPE_CHECKING:` blocks included (a type-only import is still a dependency:
    a reader of the module has to understand the other to follow it)."""
    package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
            elif isinstance(child, ast.Import):
                out.update(alias.name for alias in child.names)
            visit(child)

    visit(ast.parse(open(path, encoding="utf-8").read()))
    return {m for m in out if m in mods and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(path, name, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def dfs(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                dfs(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    return found


def test_the_graph_is_read_the_way_the_code_imports():
    g = _graph()
    assert "warmup_agent.errors" in g["warmup_agent.engines.base"]          # top-level
    assert "warmup_agent.readiness.validation" in g["warmup_agent.stages.ready"]  # from a package import a module
    assert "warmup_agent.driver" in g["warmup_agent.stages.context"]          # TYPE_CHECKING only
    assert not any(m.startswith("warmup_agent.stages") and "warmup_agent.pipeline" in deps for m, deps in g.items())
    assert "warmup_agent.webconfig" in g["exporter.server"]                   # lazy, inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_exporter_imports_no_agent_internals():
    g = _graph()
    reached = {m: sorted(v for v in deps if v.startswith("warmup_agent") and v not in EXPORTER_MAY_IMPORT)
               for m, deps in g.items() if m.startswith("exporter")}
    assert {m: v for m, v in reached.items() if v} == {}
