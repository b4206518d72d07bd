"""docs/metrics.md is generated from the catalogue and up to date."""
from __future__ import annotations

import os
import re

from exporter import docs
from exporter.catalogue import CATALOGUE
from tests.helpers.paths import ROOT

PATH = os.path.join(ROOT, "docs", "metrics.md")


def test_committed_doc_equals_fresh_generation(tmp_path):
    assert docs.main(["--out", str(tmp_path)]) == 0
    with open(PATH, encoding="utf-8") as a:
        assert a.read() == (tmp_path / "metrics.md").read_text(encoding="utf-8"), \
            "docs/metrics.md is stale: run `.venv/bin/python -m exporter.docs` and commit"


def test_every_metric_documented_once_with_its_type_and_labels():
    with open(PATH, encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| `")]
    documented = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        documented[cells[0].strip("`")] = cells
    assert len(rows) == len(documented) == len(CATALOGUE)
    for spec in CATALOGUE:
        cells = documented[spec.name]
        assert cells[1] == spec.type
        assert re.findall(r"`([^`]+)`", cells[2]) == list(spec.labels)
        assert spec.help in cells[6].replace("\\|", "|")


def test_seed_names_are_marked():
    with open(PATH, encoding="utf-8") as f:
        text = f.read()
    for name in ("model_loading_phase_duration_seconds", "warmup_cost_ratio", "gpu_fragmentation_rate",
                 "model_loading_failures_total"):
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        assert "verbatim from the seed" in row


def test_every_metric_the_readme_names_is_in_the_catalogue():
    from exporter.catalogue import BY_NAME
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    # a metric is written `name` or `name{labels}`; `warmup_engine_*` (a prefix) and
    # paths such as `warmup_agent/...` are not metric names
    named = set(re.findall(r"`((?:warmup_|model_loading_|gpu_fragmentation)[a-z0-9_]*[a-z0-9])[`{]", text))
    missing = sorted(n for n in named if n not in BY_NAME and n.rsplit("_", 1)[0] not in BY_NAME)
    assert named and not missing, f"README names metrics the catalogue lacks: {missing}"


def test_catalogue_modules_register_by_explicit_import_without_a_cycle():
    """Feature modules import MetricSpec from exporter/metric_spec.py, never from the
    catalogue that imports them; every exporter/catalogue_*.py is registered."""
    import ast
    import glob
    import subprocess
    import sys

    from exporter import catalogue
    files = sorted(glob.glob(os.path.join(ROOT, "exporter", "catalogue_*.py")))
    registered = {m.__name__ for m in catalogue.FEATURE_MODULES}
    assert registered == {"exporter." + os.path.basename(f)[:-3] for f in files}
    for f in files:
        tree = ast.parse(open(f, encoding="utf-8").read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "exporter.catalogue" not in imported, f
    # A feature module alone does not pull in the catalogue (no hidden way back up).
    code = ("import sys, exporter.catalogue_readiness, exporter.catalogue_cache; "
            "assert 'exporter.catalogue' not in sys.modules, 'cycle'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert catalogue.CATALOGUE == catalogue.CORE + tuple(s for m in catalogue.FEATURE_MODULES for s in m.SPECS)


def test_committed_metric_handles_equal_fresh_generation(tmp_path):
    assert docs.main(["--out", str(tmp_path)]) == 0
    with open(os.path.join(ROOT, "exporter", "metric_handles.py"), encoding="utf-8") as a:
        assert a.read() == (tmp_path / "metric_handles.py").read_text(encoding="utf-8"), \
            "exporter/metric_handles.py is stale: run `.venv/bin/python -m exporter.docs` and commit"


def test_every_agent_metric_is_a_typed_attribute_and_the_same_object_as_its_item():
    from prometheus_client import Counter, Gauge, Histogram, Info

    from exporter.metrics import AgentMetrics
    m = AgentMetrics()
    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram, "info": Info}
    agent_specs = [s for s in CATALOGUE if s.source != "scrape"]
    assert agent_specs
    for s in agent_specs:
        assert getattr(m, s.name) is m[s.name] and isinstance(m[s.name], kinds[s.type]), s.name
    for s in CATALOGUE:
        if s.source == "scrape":
            assert not hasattr(m, s.name), s.name


def metric_lookups_by_name(source: str, names: frozenset[str]) -> list[str]:
    """Where `source` addresses one of the agent's metrics by its name as a string:
    a subscript of something called *metrics* by a string (`metrics["warmup_state"]`),
    or any string that is exactly a metric's name (`metrics.get("warmup_state")`,
    `getattr(metrics, "warmup_state")`, a helper given the name)."""
    import ast
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str) and "metrics" in ast.unparse(node.value).split(".")[-1]:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append(f"{node.lineno}: {node.value!r}")
    return sorted(found)


def test_agent_code_uses_the_typed_metric_handles_not_names():
    """Issue 17: warmup_agent/ reaches each of its metrics as a typed attribute
    (`metrics.warmup_state`), which mypy checks, never by its name as a string, where a
    typo fails only when that line runs.  (AgentMetrics still answers m["name"].)"""
    from exporter import metric_handles
    names = frozenset(metric_handles.NAMES)
    # The scan finds what it is meant to find.
    sample = 'a.metrics["warmup_state"].set(1)\nself._metrics.get("warmup_requests_total")\nm["x"]\n'
    assert metric_lookups_by_name(sample, names) == [
        "1: 'warmup_state'", "1: a.metrics['warmup_state']", "2: 'warmup_requests_total'"]
    # `warmup-agent bench` reads another agent's /metrics from outside, where no handle
    # exists: its names are checked here instead.
    from warmup_agent.bench.start import EXPORTED_TAXES
    assert {name for _, name in EXPORTED_TAXES} <= names
    outside_readers = {os.path.join("warmup_agent", "bench", "start.py")}
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "warmup_agent")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                if os.path.relpath(path, ROOT) in outside_readers:
                    continue
                with open(path, encoding="utf-8") as fh:
                    found += [f"{os.path.relpath(path, ROOT)}:{hit}" for hit in metric_lookups_by_name(fh.read(), names)]
    assert not found, "use the typed handle (metrics.<name>) instead:\n" + "\n".join(found)
