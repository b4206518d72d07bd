"""After SERVING, the watch loop does not probe a supervised server while it serves
other clients (engines/openai/server_traffic.py).

On the H200, `transformers serve` answers one request at a time: a probe sent during an
outside client's 48-token answer waited for all of it (1.48 s to first token against
45 ms idle), and the healthy pod fired WarmupAgentFirstTokenSLOBreach in 5 of 5 starts.
"""
from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request

import pytest

from warmup_agent.engines.openai.server_traffic import ServerTraffic

UVICORN = 'INFO:     127.0.0.1:50806 - "POST /v1/chat/completions HTTP/1.1" 200 OK'
LLAMA = "srv  log_server_r: request: POST /v1/completions 127.0.0.1 200"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_request_line_is_another_clients_when_no_request_of_ours_is_owed_a_line():
    clock = Clock()
    traffic = ServerTraffic(clock, slack=0.5)
    a = traffic.own_started()
    traffic.log_line(UVICORN)                        # ours: logged while it is in flight
    b = traffic.own_started()
    clock.t += 0.3
    traffic.own_ended(a)
    traffic.own_ended(b)
    clock.t += 0.2
    traffic.log_line(LLAMA)                          # ours: llama.cpp logs a request when it ends
    assert traffic.others_within(10) is None and traffic.others_seen == 0
    c = traffic.own_started()
    traffic.own_ended(c)
    clock.t += 1.0                                   # its credit lapsed: the server logged no line for it
    traffic.log_line('INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK')   # not a request
    traffic.log_line("[transformers] [Request received] Model: m, CB: False")     # a request's other line
    assert traffic.others_within(10) is None
    traffic.log_line(UVICORN)                        # someone else's
    assert traffic.others_seen == 1
    clock.t += 4.0
    assert traffic.others_within(10) == pytest.approx(4.0)
    clock.t += 6.5
    assert traffic.others_within(10) is None         # older than asked: probes may resume


def test_credits_of_a_server_that_logs_nothing_do_not_pile_up():
    clock = Clock()
    traffic = ServerTraffic(clock, slack=0.5)
    for _ in range(1000):
        traffic.own_ended(traffic.own_started())
        clock.t += 1.0
    assert len(traffic._credits) <= 1


def test_a_users_line_taking_a_probes_credit_still_counts_one_line_as_another_clients():
    clock = Clock()
    traffic = ServerTraffic(clock)
    probe = traffic.own_started()                    # queued behind a user's answer
    traffic.log_line(UVICORN)                        # the user's line takes the probe's credit
    clock.t += 1.5
    traffic.own_ended(probe)
    traffic.log_line(UVICORN)                        # the probe's own line finds none
    assert traffic.others_seen == 1 and traffic.others_within(10) == 0


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_no_probe_waits_behind_an_outside_clients_answers_on_transformers_serve(tmp_path, embedded_model, data_dir):
    from tests.helpers import transformers_server as ts
    from tests.helpers.servers import free_port, http_get, wait_until
    if not ts.available():
        pytest.skip("needs transformers[serving] (make test-setup)")
    port, listen = free_port(), free_port()
    rec = tmp_path / "run.json"
    agent = ts.start_agent(str(tmp_path), embedded_model, data_dir, port, listen, str(rec),
                           WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS="1.0")
    url = f"http://127.0.0.1:{listen}"
    probes = 'warmup_requests_total{kind="probe"}'
    try:
        wait_until(lambda: http_get(url + "/readyz")[0] == 200 or agent.poll() is not None, 300, what="SERVING")
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
        time.sleep(1.0)
        idle_before = _metric(http_get(url + "/metrics")[1], probes)
        time.sleep(2.5)
        assert _metric(http_get(url + "/metrics")[1], probes) > idle_before, "no watch probes while idle"

        # An outside client: one streamed answer after another, for 6 s. Short answers
        # (8 tokens), so that each ends well inside the two intervals a request line pauses
        # the probes for, even on a loaded machine.
        answers: list[float] = []
        stop = threading.Event()

        def client() -> None:
            body = {"model": embedded_model, "messages": [{"role": "user", "content": "Where is my order?"}],
                    "max_tokens": 8, "stream": True}
            while not stop.is_set():
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                             data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"}, method="POST")
                t0 = time.perf_counter()
                with urllib.request.urlopen(req, timeout=60) as r:
                    for _ in r:
                        pass
                answers.append(time.perf_counter() - t0)
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        time.sleep(1.0)                      # the first answer's line is in the server's log
        during_start = _metric(http_get(url + "/metrics")[1], probes)
        time.sleep(6.0)
        during_end = _metric(http_get(url + "/metrics")[1], probes)
        stop.set()
        thread.join(60)
        assert len(answers) >= 3, answers
        # At one probe a second the watch loop would have sent about 6 here.
        assert during_end - during_start <= 1, (during_start, during_end)
        time.sleep(3.5)                      # two intervals after the last answer, probes resume
        assert _metric(http_get(url + "/metrics")[1], probes) > during_end, "probes did not resume"
    finally:
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(60)
    assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]
    record = json.loads(rec.read_text())
    assert record["watch_probes_skipped"] >= 4, record["watch_probes_skipped"]
    text = (tmp_path / "agent.log").read_text()
    assert "probes after SERVING pause while the server serves other clients" in text
    assert "probes after SERVING resume" in text
