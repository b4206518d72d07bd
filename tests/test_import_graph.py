"""The import graph of warmup_agent/ and exporter/ (issues 17, 24): no cycle, lazy
imports (inside functions) and type-only imports (under `if TYPE_CHECKING:`)
included; the same graph read by folder (issue 71: the house follows the flow) has
no two folders that import each other and no cycle; and the
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


# The layers of warmup_agent/, lowest first (issue 42): a module may import its own
# layer and the layers below, never one above ("an import that runs back up").
# A module belongs to the layer of the longest prefix here that names it; every
# module of warmup_agent/ must be named (test_every_module_has_a_layer); the package
# itself ("warmup_agent": its __init__) is named alone, not as a prefix.  exporter/
# is checked on its own (test_the_exporter_imports_no_agent_internals).
LAYERS: list[tuple[str, ...]] = [
    # the ground floor: imports nothing of the agent above it
    ("warmup_agent", "warmup_agent.errors", "warmup_agent.event_stream", "warmup_agent.failures",
     "warmup_agent.periodic", "warmup_agent.config_sections", "warmup_agent.atomic_file"),
    # pure parts, each about one thing, that know nothing of the config or the engines
    ("warmup_agent.warmup", "warmup_agent.model", "warmup_agent.quantization", "warmup_agent.gpu",
     "warmup_agent.host", "warmup_agent.states"),
    # the configuration
    ("warmup_agent.config", "warmup_agent.webconfig"),
    # a model server as a child process, the proxy, the kernel cache
    ("warmup_agent.server", "warmup_agent.proxy", "warmup_agent.kernel_cache"),
    # the engines, behind engines.base
    ("warmup_agent.engines",),
    # readiness: the probes, the window, the gate (validation reads the native model)
    ("warmup_agent.readiness",),
    # agent traffic to the engine
    ("warmup_agent.driver",),
    # what a person sees of a run: the timeline, progress, traces, the report of a record
    ("warmup_agent.run",),
    # the four stages over the StageContext, the profile warmup they drive (the engine, the
    # driver and the gate's probes) and the run record read from the StageContext
    ("warmup_agent.stages",),
    # `warmup-agent bench`: starts a server (and the agent) as processes, measures from outside
    ("warmup_agent.bench",),
    # the composition root and the command line
    ("warmup_agent.pipeline",),
    ("warmup_agent.cli", "warmup_agent.__main__"),
]


def _layer(module: str) -> int | None:
    best, found = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or (module.startswith(p + ".") and p != "warmup_agent")) and len(p) > best:
                best, found = len(p), i
    return found


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


def _folder(module: str) -> str:
    """The folder a module is drawn in: a subpackage of warmup_agent/ (all its modules),
    a single top-level module on its own, exporter/ as one."""
    parts = module.split(".")
    return "exporter" if parts[0] == "exporter" else ".".join(parts[:2])


def _folder_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> the module imports that draw that arrow."""
    edges: dict[tuple[str, str], list[str]] = {}
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if _folder(d) != _folder(m):
                edges.setdefault((_folder(m), _folder(d)), []).append(f"{m} -> {d}")
    return edges


def _mutual_folders(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Each pair of folders that import each other, with the module imports both ways."""
    edges = _folder_edges(graph)
    return {(a, b): lines + edges[(b, a)] for (a, b), lines in edges.items() if a < b and (b, a) in edges}


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {_folder(m): set() for m in graph}
    for a, b in _folder_edges(graph):
        folders[a].add(b)
    return folders


def test_the_graph_is_read_the_way_the_code_imports():
    g = _graph()
    assert "warmup_agent.errors" in g["warmup_agent.engines.base"]          # top-level
    assert "warmup_agent.readiness.validation" in g["warmup_agent.stages.ready"]  # from a package import a module
    assert "warmup_agent.driver" in g["warmup_agent.stages.context"]          # TYPE_CHECKING only
    assert not any(m.startswith("warmup_agent.stages") and "warmup_agent.pipeline" in deps for m, deps in g.items())
    assert "warmup_agent.webconfig" in g["exporter.server"]                   # lazy, inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_folders_are_read_the_way_the_code_imports():
    g = _graph()
    assert _folder("warmup_agent.engines.openai.engine") == _folder("warmup_agent.engines") == "warmup_agent.engines"
    assert _folder("warmup_agent.cli") == "warmup_agent.cli" and _folder("exporter.server") == "exporter"
    assert _folder("warmup_agent") == "warmup_agent"
    edges = _folder_edges(g)
    assert "warmup_agent.stages.context -> warmup_agent.run.progress" in edges[("warmup_agent.stages", "warmup_agent.run")]
    assert ("warmup_agent.engines", "warmup_agent.engines") not in edges    # inside a folder: no arrow
    assert "warmup_agent.pipeline" in _folder_graph(g)["warmup_agent.cli"]
    # two folders that import each other, and three in a ring, are found
    pair = {"warmup_agent.a.x": {"warmup_agent.b.y"}, "warmup_agent.b.y": {"warmup_agent.a.z"}, "warmup_agent.a.z": set()}
    assert _mutual_folders(pair) == {("warmup_agent.a", "warmup_agent.b"): [
        "warmup_agent.a.x -> warmup_agent.b.y", "warmup_agent.b.y -> warmup_agent.a.z"]}
    ring = {"warmup_agent.a.x": {"warmup_agent.b"}, "warmup_agent.b": {"warmup_agent.c.y"},
            "warmup_agent.c.y": {"warmup_agent.a.z"}, "warmup_agent.a.z": set()}
    assert _mutual_folders(ring) == {}
    assert _cycles(_folder_graph(ring)) == [["warmup_agent.a", "warmup_agent.b", "warmup_agent.c", "warmup_agent.a"]]


def test_no_two_folders_import_each_other():
    """Issue 71: a module that drives engines and readiness lives above them (with the
    stages), not in a folder they import."""
    mutual = _mutual_folders(_graph())
    assert mutual == {}, "\n".join(f"{a} <-> {b}:\n    " + "\n    ".join(lines) for (a, b), lines in mutual.items())


def test_no_cycle_between_folders():
    assert _cycles(_folder_graph(_graph())) == []


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_exporter_imports_no_agent_internals():
    g = _graph()
    reached = {m: sorted(v for v in deps if v.startswith("warmup_agent") and v not in EXPORTER_MAY_IMPORT)
               for m, deps in g.items() if m.startswith("exporter")}
    assert {m: v for m, v in reached.items() if v} == {}


def test_every_module_has_a_layer():
    assert [m for m in _graph() if m.startswith("warmup_agent") and _layer(m) is None] == []


def test_the_layers_are_read_by_the_longest_prefix():
    assert _layer("warmup_agent.stages.record") == _layer("warmup_agent.stages.context") > _layer("warmup_agent.run.progress")
    assert _layer("warmup_agent.engines.openai.engine") == _layer("warmup_agent.engines.base")
    assert _layer("warmup_agent.errors") == 0 and _layer("warmup_agent.nothing_here") is None


def test_no_import_runs_back_up_the_layers():
    """Lazy and type-only imports included, as for cycles."""
    g = _graph()
    up = sorted(f"{m} -> {d}" for m, deps in g.items() if m.startswith("warmup_agent")
                for d in deps if d.startswith("warmup_agent") and _layer(d) > _layer(m))
    assert up == []


def test_at_most_twelve_top_level_modules():
    """Issue 59: a newcomer reads the top of the package first; everything else is in a package
    named for what it is about."""
    top = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "warmup_agent", "*.py"))
                 if os.path.basename(p) not in ("__init__.py", "__main__.py"))
    assert len(top) <= 12, top
