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
