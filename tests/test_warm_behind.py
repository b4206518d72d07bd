"""The warm-up behind the users (issue 71, prewarm.behind_users): the gate opens once the
users' own shape answers warm; the other paths are warmed after SERVING, in the
background, and a request of theirs goes out only while no user request is in flight.

Real processes: `warmup-agent run --proxy-listen ... -- llama-server` (CPU), started
twice, with and without the warm-up behind the users."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time

import pytest

from tests.conftest import ROOT, agent_cmd
from tests.helpers import llamacpp_server as ls
from tests.helpers.servers import free_port, http_get, wait_until
from tests.test_proxy import make_agent
from warmup_agent.pipeline import QUIET_SECONDS
from warmup_agent.states import State

pytestmark = pytest.mark.slow


def test_the_quiet_wait_lets_users_go_first(embedded_model):
    """Each request of the warm-up behind the users waits while one is in flight (the
    proxy's count), and stops once the pod is no longer SERVING."""
    agent = make_agent(embedded_model, State.SERVING)
    agent.readiness.user_request()            # a user's request arrives at the proxy
    passed = threading.Event()
    threading.Thread(target=lambda: (agent._users_quiet(), passed.set()), daemon=True).start()
    time.sleep(0.3)
    assert not passed.is_set(), "a warm-up request went out while a user's was in flight"
    agent.readiness.user_done()               # answered
    assert passed.wait(2)
    assert agent.sm.transition(State.DEGRADED)
    from warmup_agent.errors import AgentFailure
    with pytest.raises(AgentFailure):
        agent._users_quiet()


def start(tmp_path, name, embedded_model, data_dir, command, env):
    listen, proxy = free_port(), free_port()
    record, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    agent = subprocess.Popen(agent_cmd("run", "--no-progress", "--engine", "openai", "--model", embedded_model,
                                       "--data-dir", data_dir, "--listen", f"127.0.0.1:{listen}",
                                       "--proxy-listen", f"127.0.0.1:{proxy}", "--record", str(record), "--",
                                       *command), cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"
    t0 = time.monotonic()
    wait_until(lambda: agent.poll() is not None or http_get(url + "/readyz")[0] == 200, 300, interval=0.02,
               what="SERVING")
    ready = time.monotonic() - t0
    assert agent.poll() is None, log.read_text()[-3000:]
    wait_until(record.exists, 30, what="the record")
    return agent, log, json.loads(record.read_text()), ready, url + "/metrics"


def gauge(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = http_get(url)[1]
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_the_other_paths_are_warmed_after_serving(tmp_path, embedded_model, data_dir, llama_server, gguf):
    env = {**ls.server_env(str(tmp_path)), "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1, 2]"}
    command = ls.server_command(llama_server, gguf, free_port())
    runs = {}
    for name, behind in (("behind", "true"), ("before", "false")):
        agent, log, record, ready, metrics = start(tmp_path, name, embedded_model, data_dir, command,
                                          dict(env, WARMUP_AGENT_PREWARM_BEHIND_USERS=behind))
        try:
            prewarm = next(s for s in record["stages"] if s["name"] == "prewarm")
            if behind == "true":
                wait_until(lambda log=log: "warmed behind the users" in log.read_text(), 60, what="the warm-up behind")
                wait_until(lambda metrics=metrics: gauge(metrics, "warmup_behind_users_pending") == 0, 10, what="pending back to 0")
                took = float(re.search(r"warmed behind the users in ([0-9.]+) s", log.read_text()).group(1))
                # the gauge counts from SERVING, its quiet wait and the golden answers included
                assert gauge(metrics, "warmup_behind_users_seconds") >= took + QUIET_SECONDS - 0.01
            runs[name] = {"ready": ready, "requests": record["warmup_requests"], "behind": prewarm["behind_users"]}
        finally:
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(60) == 0
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
    print(f"behind the users: {runs}")
    assert runs["behind"]["behind"] and not runs["before"]["behind"]
    # the larger batch and the other endpoints and families went after SERVING, not before it
    assert any("batch2" in p for p in runs["behind"]["behind"])
    assert runs["behind"]["requests"] < runs["before"]["requests"]
    line = [ln for ln in (tmp_path / "behind.log").read_text().splitlines() if "warmed behind the users" in ln][-1]
    assert f"{len(runs['behind']['behind'])} path(s)" in line, line


def test_users_who_reach_the_server_without_the_proxy_are_waited_for(tmp_path, embedded_model, llama_server, gguf):
    """Without the proxy's count, the server's own running and waiting requests (its kind's
    metric names, llama-server --metrics) hold the warm-up behind the users back."""
    from warmup_agent.server.kinds import BY_NAME
    from warmup_agent.server.signals import ServerSignals
    port = free_port()
    server = subprocess.Popen(ls.server_command(llama_server, gguf, port, metrics=True), env=ls.server_env(str(tmp_path)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_get(url + "/health")[0] == 200, 120, what="llama-server")
        agent = make_agent(embedded_model, State.SERVING)
        agent.engine.server_signals = lambda: ServerSignals(url, BY_NAME["llamacpp"])   # the real server's figures
        assert not agent._server_busy()
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}).encode()
        at: dict[str, float] = {}

        def user() -> None:                    # a user straight at the server, not through the proxy
            import urllib.request
            req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=120).read()
            at["answered"] = time.monotonic()
        threading.Thread(target=user, daemon=True).start()
        wait_until(agent._server_busy, 30, interval=0.02, what="the user's request, running")
        at["busy"] = time.monotonic()
        agent._users_quiet()                   # returns only once the server is idle again
        at["quiet"] = time.monotonic()
        assert "answered" in at and at["quiet"] >= at["answered"] - 0.05, at    # its answer ended first
        assert at["answered"] - at["busy"] > 0.1, f"the user's request ran too briefly to show anything: {at}"
    finally:
        server.terminate()
        server.wait(30)


def test_no_watch_probe_while_a_users_request_is_in_flight(embedded_model):
    """The watch probes after SERVING follow the same rule as the warm-up behind the users."""
    agent = make_agent(embedded_model, State.SERVING)
    assert not agent._server_busy_with_others()
    agent.readiness.user_request()
    assert agent._server_busy_with_others()
    agent.readiness.user_done()
    assert not agent._server_busy_with_others()


def test_a_warm_up_stream_gives_way_to_a_users_request(tmp_path, llama_server, gguf):
    """While a user's request is in flight (give_way true), a warm-up stream stops at its
    next event and the real llama-server cancels it; a request that is not warm-up runs on."""
    from warmup_agent.engines.openai.client import StreamingClient
    from warmup_agent.engines.openai.server_traffic import ServerTraffic
    from warmup_agent.errors import EngineError
    port, log = free_port(), tmp_path / "server.log"
    server = subprocess.Popen(ls.server_command(llama_server, gguf, port, ctx=8192), env=ls.server_env(str(tmp_path)),
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_get(url + "/health")[0] == 200, 120, what="llama-server")
        client = StreamingClient(url, 60, ServerTraffic())
        client.give_way = lambda: True
        body = {"prompt": "Once upon a time", "max_tokens": 1000}
        assert client.request(body, "completions", warmup=False).output_tokens == 1000
        with pytest.raises(EngineError) as e:
            client.request(body, "completions", warmup=True)
        assert e.value.reason == "gave_way"
        wait_until(lambda: log.read_text().count("stop processing") >= 2, 10, what="the warm-up's slot released")
    finally:
        server.terminate()
        server.wait(30)
    text = log.read_text()
    assert "cancel task" in text, text[-2000:]
    kept = [int(n) for n in re.findall(r"stop processing: n_tokens = (\d+)", text)]
    assert kept[0] > 1000 and kept[1] < 200, kept      # the user's whole answer; the warm-up's stopped early


def test_the_driver_gives_way_for_one_batch_only():
    """EngineDriver.send(give_way=...) sets the engine's give-way for its batch and clears
    it after, even when the batch stopped, so the next probe is not stopped."""
    from exporter.metrics import AgentMetrics
    from exporter.recorder import Recorder
    from warmup_agent.driver import EngineDriver
    from warmup_agent.engines.base import RequestResult
    from warmup_agent.errors import EngineError

    class StubEngine:                 # named fake: records what the driver sets, stops while it is set
        lock = None

        def __init__(self) -> None:
            self.set_to: list[object] = []
            self.current = None

        def give_way(self, to_users):
            self.set_to.append(to_users)
            self.current = to_users

        def generate(self, prompts, max_new_tokens=1, warmup=False):
            if self.current is not None and self.current():
                raise EngineError("gave_way", "stopped for a user's request")
            return [RequestResult(first_token_seconds=0.01, total_seconds=0.02, prompt_tokens=4, output_tokens=1)]

    engine = StubEngine()
    driver = EngineDriver(engine, Recorder(AgentMetrics()), 8)   # type: ignore[arg-type]
    with pytest.raises(EngineError):
        driver.send([[1, 2, 3, 4]], "warmup", give_way=lambda: True)
    assert engine.current is None and len(engine.set_to) == 2
    assert driver.send([[1, 2, 3, 4]], "probe")[0].output_tokens == 1
    assert len(engine.set_to) == 2        # a batch without give_way leaves the engine alone
