"""Alert rules: promtool check + unit tests per group, structure, names, runbook,
and the committed file equals a fresh generation."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from alerts import generate
from alerts.promql import base_name, label_problems, metric_names
from exporter.catalogue import BY_NAME
from tests.helpers.paths import ROOT

ALERTS = os.path.join(ROOT, "alerts")
RULES = os.path.join(ALERTS, generate.RULES_FILE)
TESTS_DIR = os.path.join(ALERTS, "tests")


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.fail("promtool not found: apt-get install prometheus (see .ci/run)")
    return path


def load_rules(path=RULES) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def all_alerts(rules=None):
    rules = rules or load_rules()
    return [(g["name"], a) for g in rules["groups"] for a in g["rules"]]


def test_file(group: str) -> str:
    return os.path.join(TESTS_DIR, group.split(".", 1)[1] + ".test.yaml")


test_file.__test__ = False  # a helper, not a test


def run_promtool(*args, cwd=None):
    return subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd)


def test_committed_rules_equal_fresh_generation():
    with open(RULES, encoding="utf-8") as f:
        committed = f.read()
    assert committed == generate.render(), \
        "alerts/warmup-agent.rules.yaml is stale: run `.venv/bin/python -m alerts.generate` and commit"


@pytest.mark.slow  # promtool
def test_promtool_check_rules():
    r = run_promtool("check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(all_alerts())
    assert f"SUCCESS: {n} rules found" in r.stdout


@pytest.mark.slow  # promtool
@pytest.mark.parametrize("group", [g["name"] for g in load_rules()["groups"]])
def test_promtool_unit_tests_per_group(group):
    path = test_file(group)
    assert os.path.exists(path), f"no promtool test file for group {group}: {path}"
    r = run_promtool("test", "rules", path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("group", [g["name"] for g in load_rules()["groups"]])
def test_every_alert_has_not_yet_firing_and_negative_cases(group):
    """Each alert: a case expecting nothing before `for` elapses, a firing case with
    full annotations; the firing case must list fewer alerts than there are input
    series of the alert's metrics (a series that must not fire: the negative case)."""
    with open(test_file(group), encoding="utf-8") as f:
        spec = yaml.safe_load(f)
    alerts = [a for g, a in all_alerts() if g == group]
    for alert in alerts:
        name = alert["alert"]
        tests = [t for t in spec["tests"] if any(c["alertname"] == name for c in t["alert_rule_test"])]
        assert tests, f"{group}: no promtool test for {name}"
        cases = [c for t in tests for c in t["alert_rule_test"] if c["alertname"] == name]
        firing = [c for c in cases if c["exp_alerts"]]
        quiet = [c for c in cases if not c["exp_alerts"]]
        assert quiet and firing, f"{name}: needs a not-yet-firing case and a firing case"
        first_fire = min(_minutes(c["eval_time"]) for c in firing)
        assert any(_minutes(c["eval_time"]) < first_fire for c in quiet), \
            f"{name}: the quiet case must come before the first firing case"
        for c in firing:
            for exp in c["exp_alerts"]:
                assert set(exp["exp_annotations"]) == {"summary", "description", "runbook_url"}, name
                assert exp["exp_labels"]["severity"] == alert["labels"]["severity"]
        # negative: some input series (of a metric the alert reads) is never expected to fire
        names = {base_name(n) for n in metric_names(alert["expr"])}
        series = [s["series"] for t in tests for s in t["input_series"]
                  if base_name(s["series"].split("{")[0]) in names]
        fired_pods = {(e["exp_labels"].get("instance")) for c in firing for e in c["exp_alerts"]}
        silent = [s for s in series if not any(f'"{i}"' in s for i in fired_pods)]
        assert silent, f"{name}: no negative series (every input series fires)"


def _minutes(d: str) -> float:
    n, unit = float(d[:-1]), d[-1]
    return n * {"s": 1 / 60, "m": 1, "h": 60}[unit]


@pytest.mark.slow  # promtool
def test_unit_tests_bite_when_for_is_dropped(tmp_path):
    """With every `for` set to 0s, every group's not-yet-firing case must fail:
    the promtool tests really pin the `for` durations."""
    th = generate.load_thresholds()
    mutated = _set_all(th.tree, "for", "0s")
    mutated["phase_budget_for"] = "0s"
    (tmp_path / "tests").mkdir()
    bad = generate.render(generate.Thresholds(mutated, "mutated"))
    (tmp_path / generate.RULES_FILE).write_text(bad)
    for g in load_rules()["groups"]:
        dst = tmp_path / "tests" / os.path.basename(test_file(g["name"]))
        shutil.copy(test_file(g["name"]), dst)
        r = run_promtool("test", "rules", str(dst))
        assert r.returncode != 0, f"{g['name']}: tests still pass with for: 0s"


@pytest.mark.slow  # promtool
def test_unit_tests_bite_when_thresholds_move(tmp_path):
    """Thresholds raised 100x: every firing case must fail."""
    th = generate.load_thresholds()
    mutated = _scale_numbers(th.tree, 100)
    mutated["target_job_regex"] = "nothing-matches"
    (tmp_path / "tests").mkdir()
    (tmp_path / generate.RULES_FILE).write_text(generate.render(generate.Thresholds(mutated, "mutated")))
    for g in load_rules()["groups"]:
        if g["name"] == "warmup-agent.kernel-cache":
            continue  # its threshold is "any rejection" (> 0): nothing to scale
        dst = tmp_path / "tests" / os.path.basename(test_file(g["name"]))
        shutil.copy(test_file(g["name"]), dst)
        r = run_promtool("test", "rules", str(dst))
        assert r.returncode != 0, f"{g['name']}: tests still pass with thresholds x100"


def _set_all(tree, key, value):
    if isinstance(tree, dict):
        return {k: (value if k == key else _set_all(v, key, value)) for k, v in tree.items()}
    return tree


def _scale_numbers(tree, factor):
    if isinstance(tree, dict):
        return {k: _scale_numbers(v, factor) for k, v in tree.items()}
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return tree * factor
    return tree


def test_seed_cold_start_degradation_kept_verbatim():
    alerts = {a["alert"]: a for _, a in all_alerts()}
    a = alerts["WarmupAgentColdStartDegradation"]
    assert a["expr"] == "increase(model_loading_failures_total[1h]) > 5"
    assert a["for"] == "10m"


def test_expected_alerts_present():
    names = {a["alert"] for _, a in all_alerts()}
    expected = {"WarmupAgentColdStartDegradation", "WarmupAgentPhaseOverBudget", "WarmupAgentWarmupStuck",
                "WarmupAgentFailed", "WarmupAgentIllegalTransitions", "WarmupAgentFirstTokenSLOBreach",
                "WarmupAgentReadinessTailOverThreshold", "WarmupAgentFirstRequestTaxHigh",
                "WarmupAgentCostRatioHigh", "WarmupAgentGpuFragmentationHigh", "WarmupAgentTargetDown"}
    assert expected <= names
    if "warmup_breaker_state" in BY_NAME:
        assert "WarmupAgentBreakerOpen" in names
    if "warmup_kernel_cache_requests_total" in BY_NAME:
        assert "WarmupAgentKernelCacheRejections" in names


def test_alert_structure_and_runbook():
    with open(os.path.join(ALERTS, "runbook.md"), encoding="utf-8") as f:
        runbook = f.read()
    anchors = {h.strip().lower() for h in re.findall(r"^## (\S+)\s*$", runbook, re.M)}
    names = [a["alert"] for _, a in all_alerts()]
    assert len(names) == len(set(names)), "duplicate alert names"
    for _, a in all_alerts():
        name = a["alert"]
        assert re.fullmatch(r"WarmupAgent[A-Z][A-Za-z0-9]+", name), name
        assert a["labels"]["severity"] in ("critical", "warning", "info"), name
        ann = a["annotations"]
        assert ann["summary"] and "{{" not in ann["summary"], name
        assert "$labels" in ann["description"], f"{name}: description must be templated"
        assert ann["runbook_url"].endswith("/alerts/runbook.md#" + name.lower()), name
        assert name.lower() in anchors, f"runbook.md has no section '## {name}'"
        assert re.fullmatch(r"\d+[smh]", a["for"]) and a["for"] not in ("0s", "0m"), name


def test_every_alert_metric_is_in_the_catalogue():
    for _, a in all_alerts():
        for n in metric_names(a["expr"]):
            if n == "up":
                continue  # Prometheus' own per-target series
            spec = BY_NAME.get(n) or BY_NAME.get(base_name(n))
            assert spec is not None, f"{a['alert']}: metric {n} is not in exporter/catalogue.py"
        assert not label_problems(a["expr"], BY_NAME), (a["alert"], label_problems(a["expr"], BY_NAME))


def test_promtool_input_series_use_catalogue_labels():
    """The unit tests' made-up series carry only labels the real metrics have, so
    a renamed label cannot leave rules that pass their tests but never fire."""
    for path in sorted(p for p in os.listdir(TESTS_DIR) if p.endswith(".test.yaml")):
        with open(os.path.join(TESTS_DIR, path), encoding="utf-8") as f:
            spec = yaml.safe_load(f)
        for t in spec["tests"]:
            for s in t["input_series"]:
                name = s["series"].split("{")[0]
                if name == "up":
                    continue
                assert name in BY_NAME or base_name(name) in BY_NAME, f"{path}: {name} not in the catalogue"
                assert not label_problems(s["series"], BY_NAME), (path, label_problems(s["series"], BY_NAME))


def test_bad_threshold_is_one_clear_line(tmp_path):
    with open(generate.THRESHOLDS_PATH, encoding="utf-8") as f:
        text = f.read()
    bad = tmp_path / "thresholds.yaml"
    bad.write_text(text.replace("  max: 0.15", "  max: high"))
    r = subprocess.run([sys.executable, "-m", "alerts.generate", "--thresholds", str(bad), "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "warmup_cost_ratio.max" in r.stderr and "'high'" in r.stderr and "a number" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / generate.RULES_FILE).exists()


def test_phase_budgets_per_device_kind_are_checked(tmp_path):
    """phase_budget_seconds needs cpu: and cuda: with the same phases; a mistake is one line."""
    with open(generate.THRESHOLDS_PATH, encoding="utf-8") as f:
        tree = yaml.safe_load(f)
    for broken, words in (({"reserve": 0.5, "prewarm": 120}, "expected cpu: and cuda:"),
                          ({"cpu": {"reserve": 0.5}, "cuda": {"reserve": 10, "ready": 1}}, "the same phases"),
                          ({"cpu": {"reserve": 0.5}, "cuda": {"reserve": "slow"}}, "phase_budget_seconds.cuda.reserve")):
        bad = tmp_path / "thresholds.yaml"
        bad.write_text(yaml.safe_dump({**tree, "phase_budget_seconds": broken}))
        r = subprocess.run([sys.executable, "-m", "alerts.generate", "--thresholds", str(bad), "--out", str(tmp_path)],
                           capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 2 and words in r.stderr, r.stderr
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


def test_cuda_budget_applies_only_to_pods_with_a_cuda_context():
    expr = next(a for _, a in all_alerts() if a["alert"] == "WarmupAgentPhaseOverBudget")["expr"]
    th = generate.load_thresholds()
    cpu, cuda = th.get("phase_budget_seconds.cpu.reserve", "number"), th.get("phase_budget_seconds.cuda.reserve", "number")
    assert f'model_loading_phase_duration_seconds{{phase="reserve"}} > {cpu:g} unless on (job, instance) ' \
           f'warmup_reserve_step_duration_seconds{{step="cuda_context"}}' in expr
    assert f'model_loading_phase_duration_seconds{{phase="reserve"}} > {cuda:g} and on (job, instance) ' \
           f'warmup_reserve_step_duration_seconds{{step="cuda_context"}}' in expr
