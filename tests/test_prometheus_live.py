"""A real Prometheus scrapes a running agent on the embedded default: every
catalogue metric is there with the right type, and promtool lints the exposition."""
import json
import os
import subprocess

import pytest

from exporter.catalogue import CATALOGUE
from tests.conftest import ROOT, agent_cmd
from tests.helpers.servers import Prometheus, free_port, http_get, require_binary, wait_until

EXPECTED_TYPE = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "info": "gauge"}


@pytest.fixture(scope="module")
def agent_process(tmp_path_factory, data_dir, embedded_model):
    port = free_port()
    log = tmp_path_factory.mktemp("agent") / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env.update(WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS="0.5")
    proc = subprocess.Popen(agent_cmd("run", "--no-progress", "--data-dir", data_dir, "--listen", f"127.0.0.1:{port}"),
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_get(url + "/readyz")[0] == 200 or proc.poll() is not None, 180, what="agent SERVING")
        assert proc.poll() is None, log.read_text()
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
    assert proc.returncode == 0, "SIGTERM drains and exits 0:\n" + log.read_text()[-2000:]


def test_every_catalogue_metric_is_scraped_with_its_type(agent_process, tmp_path):
    prom = Prometheus(tmp_path, [agent_process.removeprefix("http://")])
    try:
        prom.wait_for_scrape()
        meta = prom.api("/api/v1/targets/metadata")
        types = {m["metric"]: m["type"] for m in meta}
        # Counters with labels exist as series only once their event happened
        # (failure reasons and illegal transitions are known in advance: they start at 0).
        event_only = {"warmup_state_deadline_exceeded_total", "warmup_kernel_cache_evictions_total",
                      "warmup_kernel_cache_publish_skipped_total"}
        missing, wrong, no_series = [], [], []
        for spec in CATALOGUE:
            if spec.requires in ("gpu", "engine_metrics", "proxy", "decode_probes", "fp8_model"):
                continue  # absent without a GPU / an engine server / an FP8 model, by design (asserted below)
            if spec.name not in types:
                missing.append(spec.name)
            elif types[spec.name] != EXPECTED_TYPE[spec.type]:
                wrong.append((spec.name, types[spec.name], spec.type))
            series = spec.name + ("_count" if spec.type == "histogram" else "")
            if spec.name not in event_only and not prom.query(f'count({{__name__="{series}"}})'):
                no_series.append(series)
        assert not missing, f"not scraped: {missing}"
        assert not wrong, f"wrong types: {wrong}"
        assert not no_series, f"no series in Prometheus: {no_series}"
        for spec in CATALOGUE:
            if spec.requires in ("gpu", "engine_metrics", "proxy", "decode_probes", "fp8_model"):
                assert not prom.query(spec.name), f"{spec.name} must be absent here ({spec.requires})"
        assert not prom.query("warmup_illegal_transitions_total > 0"), "a clean warmup makes no illegal transition"
        state = prom.query('warmup_state == 1')
        assert [r["metric"]["state"] for r in state] == ["SERVING"]
    finally:
        prom.stop()


def test_promtool_check_metrics_is_clean(agent_process):
    code, text = http_get(agent_process + "/metrics")
    assert code == 200
    r = subprocess.run([require_binary("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_endpoints(agent_process):
    assert http_get(agent_process + "/healthz")[0] == 200
    code, body = http_get(agent_process + "/startupz")
    status = json.loads(body)
    assert code == 200 and status["state"] == "SERVING" and set(status["stages"]) == {"reserve", "prewarm", "solidify", "ready"}
    code, body = http_get(agent_process + "/")
    assert code == 200 and "/metrics" in body
    assert http_get(agent_process + "/nope")[0] == 404


def test_exposition_has_no_created_series(agent_process):
    # They would double every counter and histogram and nothing reads them.
    _, text = http_get(agent_process + "/metrics")
    assert "_created" not in text
