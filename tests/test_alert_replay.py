"""Healthy pods replayed through the shipped alert rules with real promtool (issue 13).

Every exposition in alerts/tests/recorded/ is the real /metrics of a healthy pod
(recorded with `python -m alerts.record`); alerts/replay.py turns each into a
40-minute promtool test with its series evolving as on a serving pod, and no
alert may fire.  The converter is checked on its own (the series really evolve)
and in the other direction: the pre-issue-13 rules fire on an exposition with
the H200 pod's old figures, so the replay can see an alert when there is one, and a
real sick pod (alerts/tests/recorded_sick/) fires the alert that names its sickness."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import yaml

from alerts import generate, replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDED = sorted(glob.glob(os.path.join(ROOT, "alerts", "tests", "recorded", "*.prom")))
CONSTRUCTED = os.path.join(ROOT, "alerts", "tests", "constructed", "h200_torch_before_issue13.prom")
H200 = os.path.join(ROOT, "alerts", "tests", "recorded", "h200_torch_healthy.prom")


@pytest.fixture(autouse=True)
def _promtool():
    if not replay.find_promtool():
        pytest.fail("promtool not found: apt-get install prometheus (see .ci/run)")


def test_recordings_are_there():
    names = {os.path.basename(p) for p in RECORDED}
    assert {"cpu_torch_healthy.prom", "cpu_vllm_openai_healthy.prom", "h200_torch_healthy.prom",
            "h200_torch_fp8_healthy.prom", "h200_llamacpp_healthy.prom", "h200_transformers_serve_cudnn_healthy.prom",
            "h200_transformers_serve_per_length_healthy.prom",
            # H200 tfserve + switch run 5 (01aec2d): a model that streams token by token, and
            # watch probes paused while the bench's client was served (run 4 fired here)
            "h200_transformers_serve_streaming_healthy.prom",
            # issue 58: llama-server --sleep-idle-seconds 3 beside the agent, scraped while
            # SLEEPING (tests/test_server_sleep.py replays its own scrape the same way)
            "cpu_llamacpp_sleeping_healthy.prom"} <= names, names


def test_the_fp8_recording_is_a_pod_serving_fp8():
    """h200_torch_fp8_healthy.prom stands for a healthy FP8 pod: its agent said so and its ranges passed."""
    text = open(os.path.join(ROOT, "alerts", "tests", "recorded", "h200_torch_fp8_healthy.prom")).read()
    assert 'warmup_model_quantization_info{kv_cache_dtype="auto",method="fp8",weight_dtype="float8_e4m3fn"} 1.0' in text
    assert 'warmup_state{state="SERVING"} 1.0' in text
    for rng in ("activations", "weights", "attention_scores"):
        assert f'warmup_fp8_range_saturated_values{{range="{rng}"}} 0.0' in text


@pytest.mark.parametrize("path", RECORDED, ids=[os.path.basename(p) for p in RECORDED])
def test_no_alert_fires_on_a_recorded_healthy_pod(path):
    assert replay.replay(path, minutes=40) == []


def test_a_recorded_pod_whose_first_request_was_slow_fires_only_that_alert():
    """H200 tfserve defaults run 5 (91573ef), start 1: the server pays per sequence length
    and its remedy was not applied; the outside client's first request after /readyz met
    2.40x the steady time to first token, and the agent exported 2.49x.  The shipped rules
    must say so, and nothing else."""
    path = os.path.join(ROOT, "alerts", "tests", "recorded_sick", "h200_transformers_serve_defaults_first_request_slow.prom")
    samples = replay.parse(path)
    assert replay._value(samples, "warmup_first_request_tax_ratio") == pytest.approx(2.488, abs=1e-3)
    assert {a for a, _, _ in replay.replay(path, minutes=40)} == {"WarmupAgentFirstRequestTaxHigh"}


@pytest.mark.parametrize("real, fires", [(None, True), (0.0, True), (1.05, False), (3.1, True)])
def test_the_first_request_alert_reads_the_users_real_figure_when_there_is_one(tmp_path, real, fires):
    """Issue 41: the same sick pod (its first probe predicted 2.49x) with the users' real
    first request exported beside it.  Not measured (absent, or 0): the prediction fires.
    The users' first request met 1.05x: quiet, that is what users met.  It met 3.1x: fires."""
    src = os.path.join(ROOT, "alerts", "tests", "recorded_sick", "h200_transformers_serve_defaults_first_request_slow.prom")
    path = tmp_path / "pod.prom"
    text = open(src).read()
    if real is not None:
        text += ("# HELP warmup_first_user_request_tax_ratio users' real first request\n"
                 "# TYPE warmup_first_user_request_tax_ratio gauge\n"
                 f"warmup_first_user_request_tax_ratio {real}\n")
    path.write_text(text)
    got = {a for a, _, _ in replay.replay(str(path), minutes=40)}
    assert got == ({"WarmupAgentFirstRequestTaxHigh"} if fires else set()), got


def test_the_replay_evolves_like_a_serving_pod():
    samples = replay.parse(H200)
    series = replay.evolve(samples, minutes=40)
    assert all(len(v) == 41 for v in series.values())          # 0..40 minutes, one value a minute

    def one(name, **labels):
        hits = [v for s, v in series.items() if s.startswith(name + "{") and all(f'{k}="{x}"' in s for k, x in labels.items())]
        assert len(hits) == 1, (name, labels, len(hits))
        return hits[0]

    cost = one("warmup_cost_ratio")
    recorded_cost = replay._value(samples, "warmup_cost_ratio")
    assert cost[0] == pytest.approx(recorded_cost)
    assert all(a > b for a, b in zip(cost, cost[1:], strict=False)), "the cost ratio decays as the pod serves"
    # the agent's own formula: busy seconds / uptime, uptime growing by 60 s a minute
    busy0 = replay._value(samples, "warmup_engine_seconds_total")
    busy40 = sum(v[-1] for s, v in series.items() if s.startswith("warmup_engine_seconds_total{"))
    assert cost[-1] == pytest.approx(busy40 / (busy0 / recorded_cost + 2400), rel=1e-9)
    probes = one("warmup_requests_total", kind="probe")
    assert probes[-1] - probes[0] == pytest.approx(40 * 60 / 5)      # one probe every 5 s
    assert one("warmup_requests_total", kind="warmup")[-1] == one("warmup_requests_total", kind="warmup")[0]
    assert one("warmup_first_token_latency_seconds_count", kind="probe")[-1] > one("warmup_first_token_latency_seconds_count", kind="probe")[0]
    assert set(one("up")) == {1.0}
    assert set(one("warmup_state", state="SERVING")) == {1.0}


SLEEPING = os.path.join(ROOT, "alerts", "tests", "recorded", "cpu_llamacpp_sleeping_healthy.prom")


def test_a_sleeping_pod_replays_asleep():
    """A pod recorded SLEEPING stays asleep in the replay: no probe (the agent only reads
    a sleeping server), and its asleep seconds grow with the clock."""
    samples = replay.parse(SLEEPING)
    assert replay._value(samples, "warmup_server_sleeping") == 1
    assert replay._value(samples, "warmup_state", state="SLEEPING") == 1
    series = replay.evolve(samples, minutes=40)
    probes = [v for s, v in series.items() if s.startswith("warmup_requests_total{") and 'kind="probe"' in s]
    assert probes and all(v[-1] == v[0] for v in probes)
    asleep = [v for s, v in series.items() if s.startswith("warmup_server_asleep_seconds_total{")]
    assert len(asleep) == 1 and asleep[0][-1] - asleep[0][0] == pytest.approx(2400)


def test_a_sleeping_pod_whose_server_is_down_still_alerts(tmp_path):
    """The other side: the same sleeping pod with its breaker open (the server stopped
    answering its health reads) fires the breaker alert, and only that one."""
    text = open(SLEEPING).read()
    text = text.replace('warmup_breaker_state{state="closed"} 1.0', 'warmup_breaker_state{state="closed"} 0.0')
    text = text.replace('warmup_breaker_state{state="open"} 0.0', 'warmup_breaker_state{state="open"} 1.0')
    path = tmp_path / "sleeping_down.prom"
    path.write_text(text)
    assert {a for a, _, _ in replay.replay(str(path), minutes=40)} == {"WarmupAgentBreakerOpen"}


def test_engine_counters_grow_in_the_vllm_recording():
    path = os.path.join(ROOT, "alerts", "tests", "recorded", "cpu_vllm_openai_healthy.prom")
    series = replay.evolve(replay.parse(path), minutes=40)
    finished = [v for s, v in series.items() if s.startswith("warmup_engine_requests_finished_total{")]
    assert len(finished) == 1 and finished[0][-1] - finished[0][0] == pytest.approx(40 * 60 / 5)   # one per probe
    assert {v[0] for s, v in series.items() if s.startswith("warmup_engine_up{")} == {1.0}


def test_the_agents_cpu_seconds_grow_in_the_replay(tmp_path):
    """warmup_process_cpu_seconds_total (ProcessCollector, issue 73) is a counter of the
    catalogue that keeps growing on a serving pod, at its recorded average rate; the
    recordings predate it, so it is added to one here."""
    path = tmp_path / "pod.prom"
    path.write_text(open(H200).read() + "# HELP warmup_process_cpu_seconds_total Total user and system CPU time spent in seconds.\n"
                    "# TYPE warmup_process_cpu_seconds_total counter\nwarmup_process_cpu_seconds_total 120.0\n")
    samples = replay.parse(str(path))
    uptime = replay._value(samples, "warmup_engine_seconds_total") / replay._value(samples, "warmup_cost_ratio")
    cpu = [v for s, v in replay.evolve(samples, minutes=40).items() if s.startswith("warmup_process_cpu_seconds_total{")]
    assert len(cpu) == 1 and cpu[0][0] == 120.0
    assert cpu[0][-1] - cpu[0][0] == pytest.approx(120.0 / uptime * 2400)


def test_recordings_name_only_catalogue_metrics():
    """A renamed or removed metric reaches the recordings: every warmup_* family they hold is
    in the catalogue (an engine's own names, outside warmup_*, are replayed as they are)."""
    for path in RECORDED + [CONSTRUCTED]:
        unknown = {n for _, n, _, _ in replay.parse(path) if n.startswith("warmup_") and not replay._ours(n)}
        assert not unknown, (os.path.basename(path), sorted(unknown))


def _old_rules(tmp_path) -> str:
    """The rules as they were before issue 13: one budget for every device kind
    (reserve 0.5 s), which generates exactly the old expression."""
    th = generate.load_thresholds()
    tree = dict(th.tree)
    tree["phase_budget_seconds"] = {"cpu": th.tree["phase_budget_seconds"]["cpu"],
                                    "cuda": th.tree["phase_budget_seconds"]["cpu"]}
    path = tmp_path / generate.RULES_FILE
    path.write_text(generate.render(generate.Thresholds(tree, "old")))
    return str(path)


def test_old_rules_fire_on_the_h200_pod_as_issue_13_saw_it(tmp_path):
    """The H200 pod as the agent reported it before issue 13 (reserve 3.7 s with no
    steps, fragmentation 0.586 by the old definition): the old rules page twice.
    The same pod as the agent reports it now (the recording) is quiet."""
    got = {a for a, _, _ in replay.replay(CONSTRUCTED, minutes=40, rules_path=_old_rules(tmp_path))}
    assert got == {"WarmupAgentPhaseOverBudget", "WarmupAgentGpuFragmentationHigh"}
    assert replay.replay(H200, minutes=40) == []


def test_the_command_lists_firing_alerts_and_exits_nonzero(tmp_path):
    r = subprocess.run([sys.executable, "-m", "alerts.replay", CONSTRUCTED, "--rules", _old_rules(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and "WarmupAgentPhaseOverBudget" in lines[0] + lines[1] and "WarmupAgentGpuFragmentationHigh" in r.stdout
    assert 'phase="reserve"' in r.stdout
    r = subprocess.run([sys.executable, "-m", "alerts.replay", H200], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "no alert fired in 40 minutes" in r.stdout, r.stdout + r.stderr


def test_a_replay_of_35_minutes_at_least(tmp_path):
    out = tmp_path / "t.yaml"
    assert replay.replay(H200, minutes=35, out=str(out)) == []
    spec = yaml.safe_load(out.read_text())
    assert max(int(c["eval_time"][:-1]) for c in spec["tests"][0]["alert_rule_test"]) == 35
    alerts = {c["alertname"] for c in spec["tests"][0]["alert_rule_test"]}
    assert alerts == set(replay.alert_names(replay.os.path.join(ROOT, "alerts", generate.RULES_FILE)))
    r = subprocess.run([sys.executable, "-m", "alerts.replay", H200, "--minutes", "20"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "expected >= 35" in r.stderr


def test_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.prom"
    bad.write_text("this is { not an exposition\n")
    r = subprocess.run([sys.executable, "-m", "alerts.replay", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and str(bad) in r.stderr and "Traceback" not in r.stderr
