"""A newcomer's first run through the CLI: the durations it reports are wall-clock
true from process start, and the counters on-call reads first have series (at 0)
before anything happened.

One real agent process on a fresh data directory, so the run includes creating
the embedded model and importing torch, the seconds a clock started inside the
agent used to miss.  The test's own clock runs from just before the spawn to the
first /readyz 200 it sees.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, agent_cmd
from tests.helpers.servers import free_port, http_get, stop_process
from warmup_agent.failures import REASONS
from warmup_agent.states import SEED_ILLEGAL, illegal_pairs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first-run")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    out, err = open(tmp / "stdout", "w"), open(tmp / "stderr", "w")
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(agent_cmd("run", "--no-progress", "--data-dir", str(tmp / "data"),
                                      "--listen", f"127.0.0.1:{port}", "--record", str(tmp / "run.json")),
                            cwd=ROOT, env=env, stdout=out, stderr=err)
    # Before SERVING: the exporter is up while the agent warms; sample /metrics once.
    early = None
    wall = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                code, _ = http_get(url + "/readyz", timeout=2)
            except OSError:
                code = None  # not listening yet
            if code == 200:
                wall = time.perf_counter() - t0
                break
            if code == 503 and early is None:
                early = http_get(url + "/metrics")[1]
            time.sleep(0.01)
        assert wall is not None, "never SERVING:\n" + (tmp / "stderr").read_text()[-3000:]
        metrics = http_get(url + "/metrics")[1]
        status = json.loads(http_get(url + "/startupz")[1])
        yield {"wall": wall, "early": early, "metrics": metrics, "status": status, "tmp": tmp}
    finally:
        stop_process(proc, timeout=30)
        out.close()
        err.close()


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_time_to_ready_is_wall_clock_from_process_start(first_run):
    wall = first_run["wall"]
    ttr = samples(first_run["metrics"])[("warmup_time_to_ready_seconds", ())]
    # The process starts just after the test's t0, and /readyz is seen a poll after
    # SERVING: ttr is a little under the test's wall clock, never over it.
    assert ttr <= wall + 0.02, (ttr, wall)
    assert abs(ttr - wall) <= 0.05 * wall, f"time to ready {ttr:.3f} s vs wall clock from spawn {wall:.3f} s"
    # the run really included the slow first-run work before the first stage
    status = first_run["status"]
    assert status["startup_seconds"] > 1.0, status  # torch import and model creation at least


def test_summary_total_and_record_agree_with_wall_clock(first_run):
    wall = first_run["wall"]
    stdout = (first_run["tmp"] / "stdout").read_text()
    total = float(re.search(r"^total\s+([0-9.]+)\s+SERVING$", stdout, re.M).group(1))
    startup = float(re.search(r"^startup\s+0\s+([0-9.]+)\s+ok$", stdout, re.M).group(1))
    assert abs(total - wall) <= 0.05 * wall, f"summary total {total} s vs wall clock from spawn {wall:.3f} s"
    record = json.loads((first_run["tmp"] / "run.json").read_text())
    stage_sum = record["startup_seconds"] + sum(s["duration_seconds"] for s in record["stages"])
    # startup plus the four contiguous stages are the time to ready, and the table shows them
    assert stage_sum == pytest.approx(record["time_to_ready_seconds"], abs=0.005)
    assert total == pytest.approx(record["time_to_ready_seconds"], abs=0.002)
    assert startup == pytest.approx(record["startup_seconds"], abs=0.001)
    assert record["stages"][0]["start_seconds"] == pytest.approx(record["startup_seconds"], abs=1e-6)


def test_known_failure_reasons_and_illegal_transitions_are_zero_from_the_start(first_run):
    for name, text in (("before SERVING", first_run["early"]), ("at SERVING", first_run["metrics"])):
        assert text is not None, f"no /metrics sample {name}"
        s = samples(text)
        for reason in REASONS:
            assert s.get(("model_loading_failures_total", (("reason", reason),))) == 0.0, (name, reason)
        pairs = {(k[1][0][1], k[1][1][1]) for k in s if k[0] == "warmup_illegal_transitions_total"}
        assert pairs == {(f.name, t.name) for f, t in illegal_pairs()}, name
        assert {(f.name, t.name) for f, t in SEED_ILLEGAL} <= pairs
        assert all(v == 0.0 for k, v in s.items() if k[0] == "warmup_illegal_transitions_total"), name


def test_a_counted_failure_moves_its_zero_series(tmp_path):
    """The zero series are the same series a failure increments (not a second one)."""
    from exporter.metrics import AgentMetrics
    from exporter.recorder import Recorder
    from warmup_agent.states import State, StateMachine
    m = AgentMetrics()
    from warmup_agent import config
    from warmup_agent.pipeline import Agent

    class NoEngine:  # the agent's constructor reads only its config and Engine.lock; nothing is run
        lock = None
    Agent(config.load(env={}), NoEngine(), metrics=m)
    assert m.registry.get_sample_value("model_loading_failures_total", {"reason": "weights_corrupt"}) == 0.0
    sm = StateMachine(Recorder(m))
    sm.transition(State.SERVING)  # INIT -> SERVING: illegal
    sm.fail("weights_corrupt", "x")
    assert m.registry.get_sample_value("warmup_illegal_transitions_total", {"from": "INIT", "to": "SERVING"}) == 1.0
    assert m.registry.get_sample_value("model_loading_failures_total", {"reason": "weights_corrupt"}) == 1.0


# Reasons the code names outside a literal EngineError("...")/fail("...") call.
DYNAMIC = {"weights_shape_mismatch", "weights_invalid", "server_exited", "port_in_use", "cuda_context_timeout",
           "kernel_compile_timeout", "init_deadline_exceeded", "preload_deadline_exceeded",
           "prime_deadline_exceeded", "validation_structure", "validation_numerics", "validation_performance",
           "prewarm_memory_budget_exceeded", "server_crashed"}


def test_every_reason_the_code_can_raise_is_known():
    """A reason added to the code but not to warmup_agent/failures.py would have no
    zero series; scan the source for the literal ones."""
    found = set()
    pattern = re.compile(r'(?:EngineError\(|\.fail\(|reason=)\s*"([a-z0-9_]+)"')
    for base in ("warmup_agent", "exporter"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, base)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                        found |= set(pattern.findall(fh.read()))
    assert found, "the scan found nothing: the pattern is wrong"
    assert not (found | DYNAMIC) - set(REASONS), f"add to warmup_agent/failures.py: {sorted((found | DYNAMIC) - set(REASONS))}"
    # the dynamic ones really are produced where the comment says
    with open(os.path.join(ROOT, "warmup_agent", "states.py"), encoding="utf-8") as fh:
        assert '_deadline_exceeded"' in fh.read()
    from warmup_agent.readiness.validation import Check
    from warmup_agent.warmup.memory_budget import REASON
    assert REASON in REASONS
    assert {Check(n, "failed").reason for n in ("structure", "numerics", "performance")} <= set(REASONS)
