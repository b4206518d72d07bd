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


def test_the_charts_default_preset_is_one_of_the_table():
    """_helpers.tpl's `default "X"` for server.preset is values.yaml's server.preset."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    defaults = set(re.findall(r'default "([^"]+)" [^}]*\.preset\b', helpers))
    default = yaml.safe_load((CHART / "values.yaml").read_text())["server"]["preset"]
    assert defaults == {default} and default in PRESETS


# -- what the agent reads from a kind when it starts or asks the server --------------------------

@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_command_without_port_listens_on_its_kinds_default(kind):
    from warmup_agent.server.command import listen_address
    cmd = [*kind.preset.executable, "m"] if kind.preset else [kind.command_words[0].split()[0], "m"]
    assert listen_address(cmd) == ("127.0.0.1", kind.default_port)
    assert listen_address([*cmd, "--port", "9"]) == ("127.0.0.1", 9)


def test_the_default_ports():
    from warmup_agent.server.command import listen_address
    assert {k.name: k.default_port for k in KINDS if k.default_port != 8000} == {
        "llamacpp": 8080, "sglang": 30000, "tgi": 3000}
    assert listen_address(["my-server"]) == ("127.0.0.1", 8000)


def test_a_run_as_module_kind_is_started_as_its_module():
    from warmup_agent.server.command import fix_command, option
    modules = {k.name: k.run_as_module for k in KINDS if k.run_as_module}
    assert modules == {"vllm": "vllm.entrypoints.launchers.api_server.entry"}
    cmd = fix_command(["/usr/bin/vllm", "serve", "/models/x", "--port", "8001"])
    assert cmd[1:5] == ["-m", modules["vllm"], "--model", "/models/x"] and option(cmd, "--port") == "8001"
    assert fix_command(["vllm", "serve", "--model", "/m"])[3:] == ["--model", "/m"]
    for unchanged in (["vllm", "bench"], ["python", "-m", "vllm.entrypoints.openai.api_server"],
                      ["llama-server", "-m", "m.gguf"], ["my-server"]):
        assert fix_command(unchanged) == unchanged


def test_a_kv_budget_is_added_only_where_the_kind_takes_one_and_none_is_set():
    from warmup_agent.server.command import with_kv_budget

    def budget() -> int:
        calls.append(1)
        return 5
    calls: list[int] = []
    assert with_kv_budget(["vllm", "serve", "m"], budget) == ["vllm", "serve", "m", "--kv-cache-memory-bytes", "5"]
    for has_one in (["vllm", "serve", "m", "--gpu-memory-utilization", "0.5"],
                    ["python", "-m", "vllm.x", "--kv-cache-memory-bytes=9"],
                    ["llama-server", "-m", "m.gguf"], ["python3", "-m", "sglang.launch_server"]):
        assert with_kv_budget(has_one, budget) == has_one
    assert len(calls) == 1


def test_a_kind_whose_command_the_engine_works_out_is_not_spawned_early():
    from warmup_agent.server import early_spawn
    for k in KINDS:
        if k.kv_budget_flag or k.run_as_module:
            cmd = [*k.preset.executable, "m"] if k.preset else [k.command_words[0], "m"]
            assert early_spawn.plan(["run", "--engine", "openai", "--", *cmd], {"PATH": "/usr/bin"}) is None


def test_every_server_gets_the_kinds_environment_defaults(tmp_path):
    from warmup_agent.server.command import server_env
    local = server_env({}, str(tmp_path), "127.0.0.1", "a=/p")
    assert local["VLLM_HOST_IP"] == "127.0.0.1" and local["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        assert local[var] == str(tmp_path / "cache" / sub)
    wide = server_env({"VLLM_CACHE_ROOT": "/mine"}, str(tmp_path), "0.0.0.0", None)
    assert "VLLM_HOST_IP" not in wide and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in wide
    assert wide["VLLM_CACHE_ROOT"] == "/mine"


class _Client:
    """get_json answers from `answers` (path -> JSON), else raises as a 404 would."""

    def __init__(self, answers: dict[str, dict]) -> None:
        self.answers, self.asked = answers, []

    def get_json(self, path: str) -> dict:
        self.asked.append(path)
        if path not in self.answers:
            from warmup_agent.engines.base import EngineError
            raise EngineError("http_404", path)
        return self.answers[path]


@pytest.mark.parametrize("answers, owner, expected", [
    ({"/props": {"total_slots": 3}}, "", 3),      # llama-server's slots
    ({"/props": {"total_slots": 3}}, "vllm", 3),
    ({}, "vllm", 4),                               # no slots: the owner kind's default
    ({"/props": {}}, "llamacpp", 1),               # neither: 1
])
def test_concurrency_is_read_where_a_kind_says_its_slots_are(answers, owner, expected):
    from types import SimpleNamespace

    from warmup_agent.engines.openai.discovery import Discovery
    client = _Client(answers)
    d = Discovery(client, SimpleNamespace(api="auto", concurrency=0))
    d.models_info = {"owned_by": owner}
    assert d._concurrency() == expected
    assert client.asked == [k.slots_path for k in KINDS if k.slots_path] == ["/props"]
