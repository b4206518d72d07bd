"""Dashboards: built with Grafana's SDK (grafana_foundation_sdk, the pinned release),
committed JSON equals a fresh generation and reads back through the SDK's schema
unchanged, structure follows the dashboard-linter rules, every metric is in the
catalogue, and every panel expression parses in promtool."""
from __future__ import annotations

import ast
import glob
import importlib.metadata
import json
import os
import re
import shutil
import subprocess

import pytest
import tomllib
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard as SdkDashboard

from alerts.promql import base_name, label_problems, metric_names
from dashboards import generate
from dashboards.exprs import panel_expressions, substitute
from exporter import catalogue_cache
from exporter.catalogue import BY_NAME
from tests.helpers.paths import ROOT

DASH_DIR = os.path.join(ROOT, "dashboards")
UIDS = {"cold-start-overview.json": "warmup-cold-start", "warmup-economics.json": "warmup-economics",
        "kernel-cache.json": "warmup-kernel-cache"}
PANEL_TYPES = {"timeseries", "heatmap", "stat", "state-timeline"}


def committed() -> dict[str, dict]:
    return {os.path.basename(p): json.load(open(p, encoding="utf-8"))
            for p in sorted(glob.glob(os.path.join(DASH_DIR, "*.json")))}


def test_committed_dashboards_equal_fresh_generation(tmp_path):
    assert generate.main(["--out", str(tmp_path)]) == 0
    fresh = {os.path.basename(p) for p in glob.glob(str(tmp_path / "*.json"))}
    assert fresh == set(committed()), "dashboards/ differs from a fresh generation: run `.venv/bin/python -m dashboards.generate`"
    for name in fresh | {"README.md"}:
        with open(tmp_path / name, encoding="utf-8") as a, open(os.path.join(DASH_DIR, name), encoding="utf-8") as b:
            assert a.read() == b.read(), f"dashboards/{name} is stale: run `.venv/bin/python -m dashboards.generate`"


def test_generator_builds_with_the_sdk_and_no_dict_literals():
    """Issue 42: generate.py imports grafana_foundation_sdk and assembles no dashboard
    JSON by hand: not one dict display ({...}) nor dict(...) call in the file."""
    with open(generate.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert any(mod.startswith("grafana_foundation_sdk") for mod in modules)
    literals = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Dict)
                or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "dict")]
    assert not literals, f"dashboards/generate.py builds dicts by hand on lines {literals}"


def test_the_installed_sdk_is_the_pinned_release():
    """The committed JSON is what the pinned SDK writes; another release would regenerate differently."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        test_extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    pins = [r.split(";")[0].split("==")[1].strip() for r in test_extra if r.startswith("grafana-foundation-sdk==")]
    assert len(pins) == 1, "pin grafana-foundation-sdk exactly, once, in the test extra"
    assert importlib.metadata.version("grafana-foundation-sdk") == pins[0]


def sdk_round_trip(d: dict) -> dict:
    """The dashboard read into the SDK's model of the Grafana schema and written back."""
    return json.loads(json.dumps(SdkDashboard.from_json(d), cls=JSONEncoder))


@pytest.mark.parametrize("name", sorted(committed()))
def test_committed_json_reads_back_through_the_sdk_schema(name):
    """Every field of the file is one the Grafana schema (as the pinned SDK models it)
    knows, with the value it expects: reading it into the SDK's Dashboard and writing
    it again changes nothing."""
    d = committed()[name]
    assert sdk_round_trip(d) == d
    # the check can fail: a field the schema does not have is dropped on the way
    hand_written = json.loads(json.dumps(d))
    hand_written["templating"]["list"][1]["definition"] = hand_written["templating"]["list"][1]["query"]
    assert sdk_round_trip(hand_written) != hand_written


def test_readme_describes_every_panel():
    with open(os.path.join(DASH_DIR, "README.md"), encoding="utf-8") as f:
        text = f.read()
    for d in committed().values():
        assert f"## {d['title']}" in text
        for p in d["panels"]:
            assert f"- **{p['title']}** ({p['type']}" in text and p["description"] in text


def test_required_dashboards_exist():
    names = set(committed())
    assert {"cold-start-overview.json", "warmup-economics.json"} <= names
    if all(n in BY_NAME for n in generate.KERNEL_CACHE_METRICS):
        assert "kernel-cache.json" in names


def check_structure(name: str, d: dict) -> None:
    assert d["uid"] == UIDS[name], f"{name}: uid must stay {UIDS[name]}"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for var in ("namespace", "pod", "model"):
        assert variables[var]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    # chained: pod depends on namespace, model on both
    assert "$namespace" in variables["pod"]["query"]
    assert "$namespace" in variables["model"]["query"] and "$pod" in variables["model"]["query"]
    for var in ("namespace", "pod", "model"):
        assert variables[var]["includeAll"] and variables[var]["allValue"] == ".*", f"{name}: {var} has no All"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
    for p in d["panels"]:
        where = f"{name} panel {p['id']} {p['title']!r}"
        assert p["type"] in PANEL_TYPES, f"{where}: type {p['type']}"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["description"].strip(), f"{where}: no description"
        assert p["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
        assert p["targets"], f"{where}: no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", where
            expr = t["expr"]
            for var in ("$namespace", "$pod", "$model"):
                assert var in expr, f"{where}: query ignores {var}: {expr}"
            for fn, rng in re.findall(r"\b(rate|increase|irate)\((?:[^()\[]|\([^()]*\))*\[([^\]]+)\]", expr):
                assert rng in ("$__rate_interval", "1h"), f"{where}: {fn} over a hard-coded [{rng}]"
            assert not re.search(r"_sum\b|_count\b", expr) or "rate(" in expr, f"{where}: lifetime average"
        gp = p["gridPos"]
        assert 0 <= gp["x"] and gp["x"] + gp["w"] <= 24, where


@pytest.mark.parametrize("name", sorted(committed()))
def test_structure(name):
    check_structure(name, committed()[name])


@pytest.mark.parametrize("name", sorted(committed()))
def test_every_metric_is_in_the_catalogue(name):
    d = committed()[name]
    queries = [e for *_, e in panel_expressions(d)] + [v["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    assert len(queries) > 3
    for expr in queries:
        expr = re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", expr)
        for n in metric_names(expr):
            assert n in BY_NAME or base_name(n) in BY_NAME, f"{name}: {n} is not in exporter/catalogue.py"
        assert not label_problems(expr, BY_NAME), (name, expr, label_problems(expr, BY_NAME))


def promtool_parse(tmp_path, dashboards: dict[str, dict]):
    """All panel expressions as recording rules: promtool check rules parses each one."""
    rules = []
    for name, d in dashboards.items():
        for pid, _title, ref, expr in panel_expressions(d):
            rules.append({"record": f"dash:{re.sub(r'[^a-z]', '_', name.lower())}:p{pid}{ref}", "expr": substitute(expr)})
    path = tmp_path / "panels.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    promtool = shutil.which("promtool") or pytest.fail("promtool not found: apt-get install prometheus")
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


@pytest.mark.slow  # promtool
def test_every_panel_expression_parses(tmp_path):
    promtool_parse(tmp_path, committed())


@pytest.mark.slow  # promtool
def test_promtool_parse_catches_a_broken_expression(tmp_path):
    """The parse check can fail: one unbalanced parenthesis is reported."""
    d = json.loads(json.dumps(committed()["cold-start-overview.json"]))
    d["panels"][0]["targets"][0]["expr"] += ")"
    with pytest.raises(AssertionError):
        promtool_parse(tmp_path, {"broken.json": d})


def test_generator_fails_loudly_on_a_missing_metric(monkeypatch, capsys, tmp_path):
    monkeypatch.delitem(BY_NAME, "warmup_cost_ratio")
    assert generate.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dashboards.generate: dashboard names metric 'warmup_cost_ratio', which is not in exporter/catalogue.py"
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # promtool
def test_kernel_cache_dashboard_once_its_metrics_exist(monkeypatch, tmp_path):
    """Before the kernel-cache feature registers its specs, check that the dashboard
    it will get is well formed and parses."""
    for s in catalogue_cache.SPECS:
        monkeypatch.setitem(BY_NAME, s.name, s)
    files = generate.build_all()
    assert "kernel-cache.json" in files
    check_structure("kernel-cache.json", files["kernel-cache.json"])
    promtool_parse(tmp_path, {"kernel-cache.json": files["kernel-cache.json"]})
    exprs = " ".join(e for *_, e in panel_expressions(files["kernel-cache.json"]))
    for n in generate.KERNEL_CACHE_METRICS:
        assert n in exprs, f"kernel-cache dashboard does not show {n}"


# --- per-GPU series (docs/metrics.md "Per-GPU series") -----------------------------------------
PER_GPU_NVML = sorted(n for n, s in BY_NAME.items() if {"gpu", "uuid"} <= set(s.labels) and s.source == "scrape")
AGGREGATION = re.compile(r"\b(sum|avg|min|max|count|group|stddev|stdvar|topk|bottomk|quantile)\s*"
                         r"(?:(by|without)\s*\(([^)]*)\))?\s*\(")


def per_gpu_problems(expr: str, legend: str) -> list[str]:
    """A query over NVML per-GPU series keeps one series per physical GPU: every
    aggregation is by (at least) gpu and uuid, and the legend names both."""
    if not set(metric_names(expr)) & set(PER_GPU_NVML):
        return []
    problems = []
    for m in AGGREGATION.finditer(expr):
        kept = {x.strip() for x in (m.group(3) or "").split(",")} if m.group(2) == "by" else set()
        if not {"gpu", "uuid"} <= kept:
            problems.append(f"{m.group(0).strip()} drops gpu/uuid")
    problems += [f"legend lacks {{{{{lab}}}}}" for lab in ("gpu", "uuid") if "{{" + lab + "}}" not in legend]
    return problems


def test_per_gpu_panels_follow_the_convention():
    checked = 0
    for name, d in committed().items():
        for p in d["panels"]:
            for t in p.get("targets", []):
                if set(metric_names(t["expr"])) & set(PER_GPU_NVML):
                    checked += 1
                    assert not per_gpu_problems(t["expr"], t["legendFormat"]), (name, p["title"], t["expr"])
    assert checked >= 2      # GPU utilisation, GPU memory used


def test_per_gpu_check_catches_node_sums_and_pod_legends():
    assert per_gpu_problems("sum(warmup_gpu_memory_used_bytes)", "{{gpu}} {{uuid}}")
    assert per_gpu_problems("sum by (pod) (warmup_gpu_utilization_ratio)", "{{gpu}} {{uuid}}")
    assert per_gpu_problems("max by (node, gpu, uuid) (warmup_gpu_utilization_ratio)", "{{pod}} GPU {{gpu}}")
    assert not per_gpu_problems("max by (node, gpu, uuid) (warmup_gpu_utilization_ratio)", "GPU {{gpu}} {{uuid}}")
    assert not per_gpu_problems("sum(warmup_cost_ratio)", "")


def test_gpu_memory_panel_counts_each_gpu_once_on_a_node(tmp_path):
    """promtool evaluates the panel over one node: agents on GPUs 0 and 1 each
    export their own GPU, and a third agent shares GPU 1 (both export it)."""
    d = committed()["warmup-economics.json"]
    expr = next(substitute(t["expr"]) for p in d["panels"] if p["title"] == "GPU memory used" for t in p["targets"])
    a, b = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
    series = []
    for pod, gpu, uuid, used in (("p0", "0", a, 40), ("p1", "1", b, 60), ("p2", "1", b, 60)):
        for metric, v in (("warmup_gpu_memory_used_bytes", used), ("warmup_gpu_memory_total_bytes", 100)):
            series.append({"series": f'{metric}{{gpu="{gpu}", uuid="{uuid}", node="n1", pod="{pod}", namespace="llm"}}',
                           "values": f"{v}x5"})
    test = {"rule_files": [], "evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series,
            "promql_expr_test": [{"expr": expr, "eval_time": "2m", "exp_samples": [
                {"labels": f'{{gpu="0", node="n1", uuid="{a}"}}', "value": 0.4},
                {"labels": f'{{gpu="1", node="n1", uuid="{b}"}}', "value": 0.6}]}]}]}
    path = tmp_path / "per_gpu.test.yaml"
    path.write_text(yaml.safe_dump(test))
    promtool = shutil.which("promtool") or pytest.fail("promtool not found: apt-get install prometheus")
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
