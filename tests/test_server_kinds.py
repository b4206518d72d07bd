"""The table of server kinds (warmup_agent/server/kinds.py) and the Helm chart agree.

The chart's presets are generated from the table (tools/sync_chart_files.py, `make
regenerate`): files/presets.yaml, the schema's enum and the README's "Servers" table.
These tests fail when a generated file is stale, when a template decides by a preset's
name instead of looking it up, and when a file names a preset the table does not have.
"""
from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.helpers.paths import ROOT_PATH as ROOT
from tools import sync_chart_files
from warmup_agent.server.kinds import BY_NAME, BY_OWNER, KINDS, PRESETS, kind_of_command

CHART = ROOT / "helm" / "warmup-agent"
CHART_PRESETS = {*PRESETS, "custom"}


def test_generated_chart_files_match_the_table():
    assert sync_chart_files.preset_differences() == [], "run `make regenerate` (tools/sync_chart_files.py)"


def test_chart_presets_and_schema_enum_are_the_tables_presets():
    presets = yaml.safe_load((CHART / "files" / "presets.yaml").read_text())
    assert list(presets) == list(PRESETS)
    for name, entry in presets.items():
        assert entry["executable"] == list(PRESETS[name].executable)
        assert entry["label"] == BY_NAME[name].label
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["server"]["properties"]["preset"]["enum"] == [*PRESETS, "custom"]
    assert yaml.safe_load((CHART / "values.yaml").read_text())["server"]["preset"] in PRESETS


def test_readme_servers_table_has_one_row_per_preset():
    readme = (CHART / "README.md").read_text()
    table = readme[readme.index(sync_chart_files.README_BEGIN):readme.index(sync_chart_files.README_END)]
    rows = re.findall(r"^\| `([a-z0-9-]+)`(?: \(default\))? \| `", table, re.M)
    assert rows == [*PRESETS, "custom"]


@pytest.mark.parametrize("template", sorted((CHART / "templates").glob("*")), ids=lambda p: p.name)
def test_templates_look_presets_up_rather_than_compare_their_names(template):
    """One lookup of files/presets.yaml: a template names custom, and vllm as the
    default of server.preset, and no other preset."""
    text = template.read_text()
    named = set(re.findall(r'(?:eq|ne) \$preset "([^"]+)"', text)) | set(re.findall(r'has \$preset \(list ([^)]*)\)', text))
    assert named <= {"custom"}, f"{template.name} decides by preset name: {sorted(named)}"
    for name in PRESETS:
        if name != "vllm":
            assert f'"{name}"' not in text, f"{template.name} names preset {name}: use its entry in files/presets.yaml"


def _preset_mentions():
    """(file, preset) for every `server.preset=X`, `preset: X` (YAML) and "the `X` preset"."""
    files = [ROOT / "README.md", CHART / "README.md", CHART / "values.yaml", ROOT / "tools" / "e2e_pod.py",
             *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.yaml")),
             *sorted(f for f in (ROOT / "tests").glob("test_*.py") if f.name != "test_server_kinds.py")]
    patterns = [re.compile(r"server\.preset=([A-Za-z0-9_.-]+)"), re.compile(r"^\s*preset: ([A-Za-z0-9_.-]+)", re.M),
                re.compile(r"\bthe `?([a-z0-9_.-]+)`? preset\b")]
    for f in files:
        text = f.read_text(encoding="utf-8")
        for pattern in patterns:
            for m in pattern.finditer(text):
                yield f.relative_to(ROOT), m.group(1)


def test_every_preset_named_anywhere_is_in_the_table():
    # test_helm_chart.py asks for an unknown preset on purpose, to see it refused
    unknown = {(str(f), name) for f, name in _preset_mentions() if name not in CHART_PRESETS
               and not (str(f) == "tests/test_helm_chart.py" and name == "nosuchserver")}
    assert not unknown, f"presets that warmup_agent/server/kinds.py does not have: {sorted(unknown)}"


def test_each_kind_has_one_name_usable_everywhere():
    for k in KINDS:
        assert re.fullmatch(r"[a-z0-9]+", k.name), f"{k.name!r}: a chart preset, a label value and a word in logs"
        assert k.label
    assert len(BY_NAME) == len(KINDS)
    assert all(BY_OWNER[k.owned_by] is k for k in KINDS if k.owned_by)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_presets_command_line_is_recognised_as_its_kind(name):
    assert kind_of_command(PRESETS[name].command("/models/m", 8000, "served")) is BY_NAME[name]


def test_the_model_is_read_from_the_server_command_by_its_kind(tmp_path):
    """`transformers serve DIR` names its model positionally; without it the agent found
    no model name where /v1/models lists only the hub cache."""
    from warmup_agent.server.command import model_in_command
    m = str(tmp_path)
    assert model_in_command(["transformers", "serve", m, "--port", "1"]) == m
    assert model_in_command(["/usr/bin/vllm", "serve", m]) == m
    assert model_in_command(["python3", "-m", "vllm.entrypoints.openai.api_server", "--model=/m"]) == "/m"
    assert model_in_command(["vllm", "serve", "Qwen/Qwen2-1.5B"]) is None     # a hub name: no local tokenizer
    assert model_in_command(["llama-server", "-m", "/m.gguf"]) is None       # a file, not a model directory
    assert model_in_command(["transformers", "serve", "--port", "1"]) is None
    assert model_in_command(None) is None
