"""The stages see the StageContext only (issue 24): no stage module imports the
pipeline or assigns an attribute of the Agent; what a stage hands on goes into a
field of the context, declared in stages/context.py."""
from __future__ import annotations

import ast
import glob
import os

from warmup_agent.stages.context import StageContext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = sorted(glob.glob(os.path.join(ROOT, "warmup_agent", "stages", "*.py")))


def _assigned_attributes(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(object name, attribute, line) of every `name.attr = ...`, `+=` and
    tuple-target assignment in `tree`."""
    out = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        flat: list[ast.expr] = []
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            else:
                flat.append(t)
        out += [(t.value.id, t.attr, t.lineno) for t in flat
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)]
    return out


def test_the_scan_sees_assignments():
    tree = ast.parse("agent.x = 1\nagent.y += 2\na, agent.z = 1, 2\nctx.gpu = None\n")
    assert {(o, a) for o, a, _ in _assigned_attributes(tree)} == {("agent", "x"), ("agent", "y"), ("agent", "z"),
                                                                   ("ctx", "gpu")}


def test_no_stage_assigns_an_agent_attribute():
    found = []
    for path in STAGES:
        tree = ast.parse(open(path, encoding="utf-8").read())
        found += [f"{os.path.basename(path)}:{line}: {obj}.{attr}" for obj, attr, line in _assigned_attributes(tree)
                  if obj == "agent"]
    assert found == []


def test_stages_write_only_declared_context_fields():
    declared = set(StageContext.__dataclass_fields__)
    found = []
    for path in STAGES:
        if path.endswith("context.py"):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        found += [f"{os.path.basename(path)}:{line}: ctx.{attr}" for obj, attr, line in _assigned_attributes(tree)
                  if obj == "ctx" and attr not in declared]
    assert found == []


def test_no_stage_reaches_the_agent():
    for path in STAGES:
        tree = ast.parse(open(path, encoding="utf-8").read())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "agent" not in names and "Agent" not in names, path
        assert "warmup_agent.pipeline" not in imported, path
