"""Whether users are waiting, read from the server's own /metrics without the proxy (issue 71
item 2): each server kind's running and waiting names sit in server/kinds.py, and
exporter/engine_metrics.py reads them through that table.

The real CPU llama-server with --metrics and one slot, given three long requests at once,
says one runs and the others wait (llamacpp:requests_processing, llamacpp:requests_deferred),
both through the kind's names (ServerSignals.water_level) and through the collector the agent
registers (cli.connect_engine); idle again, both read 0.  Without --metrics the water level is
unknown (None), never 0.  SGLang's and TGI's names are read here from expositions written as
their docs show them, not from a running server.
"""
from __future__ import annotations

import json
import subprocess
import threading
import urllib.request

from prometheus_client import CollectorRegistry

from exporter.engine_metrics import EngineStats, parse_engine_metrics
from tests.helpers import llamacpp_server as ls
from tests.helpers.engines import openai_engine
from tests.helpers.servers import free_port, http_get, stop_process, wait_until
from warmup_agent import config
from warmup_agent.cli import connect_engine
from warmup_agent.server.kinds import BY_NAME, KINDS, kind_of_command
from warmup_agent.server.signals import ServerSignals, engine_metric_names

# Recorded from the CPU llama-server (tools/build_llama_server.py) with --metrics -np 1,
# three requests sent at once (trimmed).
LLAMACPP = """\
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 884
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""
# As SGLang's docs/references/production_metrics.md and metrics/collector.py show it (trimmed).
SGLANG = """\
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.28
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 162.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 2826.0
"""
# As TGI's metrics reference names them.
TGI = """\
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 3
# TYPE tgi_queue_size gauge
tgi_queue_size 5
"""


def test_each_kind_is_read_through_its_own_names_in_the_table():
    assert parse_engine_metrics(LLAMACPP, engine_metric_names(BY_NAME["llamacpp"])) == EngineStats(
        requests_running=1.0, requests_waiting=2.0)
    assert parse_engine_metrics(SGLANG, engine_metric_names(BY_NAME["sglang"])) == EngineStats(
        requests_running=162.0, requests_waiting=2826.0, kv_cache_usage_ratio=0.28)
    assert parse_engine_metrics(TGI, engine_metric_names(BY_NAME["tgi"])) == EngineStats(
        requests_running=3.0, requests_waiting=5.0)
    # One kind's names never read another's series; every kind's names read each alike.
    assert parse_engine_metrics(LLAMACPP, engine_metric_names(BY_NAME["vllm"])) == EngineStats()
    for text in (LLAMACPP, SGLANG, TGI):
        assert parse_engine_metrics(text, engine_metric_names()).requests_running is not None
    # transformers serve serves no /metrics: nothing to read, and nothing read as 0.
    assert engine_metric_names(BY_NAME["transformers"]).running == ()


def test_every_kind_with_a_metrics_page_names_its_running_and_waiting_in_its_own_namespace():
    named = [k for k in KINDS if k.running_metric]
    assert {k.name for k in named} == {"vllm", "llamacpp", "sglang", "tgi"}
    for k in named:
        assert k.waiting_metric
        prefix = k.running_metric.split(":")[0] if ":" in k.running_metric else k.running_metric.split("_")[0]
        for other in KINDS:
            if other is not k:
                assert not any(n.startswith(prefix) for n in (other.running_metric or "", other.waiting_metric or ""))


class _Agent:
    def on_engine_exit(self, rc) -> None: ...
    def on_engine_ready(self) -> None: ...


def _start(llama_server: str, gguf: str, metrics: bool) -> tuple[subprocess.Popen, list[str], str]:
    port = free_port()
    cmd = ls.server_command(llama_server, gguf, port, metrics=metrics, extra=("-np", "1"))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_get(url + "/health")[0] == 200, timeout=120, what="llama-server healthy")
    return proc, cmd, url


def _long_request(url: str) -> None:
    body = {"prompt": "Is the server busy", "max_tokens": 1200, "ignore_eos": True, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def test_the_real_llama_server_says_one_request_runs_and_the_others_wait(llama_server, gguf, clean_env):
    proc, cmd, url = _start(llama_server, gguf, metrics=True)
    try:
        signals = ServerSignals(url, kind_of_command(cmd))
        assert signals.kind is BY_NAME["llamacpp"]
        # The agent's collector, wired as `warmup-agent run` wires it.
        engine = openai_engine(config.load(env={"WARMUP_AGENT_ENGINE": "openai", "WARMUP_AGENT_OPENAI_URL": url}))
        registry = CollectorRegistry()
        connect_engine(engine, _Agent(), registry)

        idle = signals.water_level()
        assert idle is not None and (idle.requests_running, idle.requests_waiting) == (0.0, 0.0)

        users = [threading.Thread(target=_long_request, args=(url,)) for _ in range(3)]
        for t in users:
            t.start()
        seen = wait_until(lambda: (lambda s: s if s and s.requests_running and s.requests_waiting else None)(
            signals.water_level()), timeout=60, interval=0.02, what="a request running and one waiting")
        assert seen.requests_running == 1.0 and seen.requests_waiting >= 1.0    # one slot
        scraped = wait_until(lambda: (lambda r, w: (r, w) if r and w else None)(
            registry.get_sample_value("warmup_engine_requests_running"),
            registry.get_sample_value("warmup_engine_requests_waiting")),
            timeout=60, interval=0.02, what="the collector's running and waiting")
        assert scraped[0] == 1.0 and scraped[1] >= 1.0
        assert registry.get_sample_value("warmup_engine_up") == 1.0
        for t in users:
            t.join(300)

        after = signals.water_level()
        assert after is not None and (after.requests_running, after.requests_waiting) == (0.0, 0.0)
        assert registry.get_sample_value("warmup_engine_requests_running") == 0.0
        engine.close()
    finally:
        stop_process(proc)


def test_without_its_metrics_page_the_water_level_is_unknown_not_zero(llama_server, gguf):
    proc, cmd, url = _start(llama_server, gguf, metrics=False)
    try:
        assert http_get(url + "/metrics")[0] != 200          # llama-server serves it only with --metrics
        assert ServerSignals(url, kind_of_command(cmd)).water_level() is None
    finally:
        stop_process(proc)
