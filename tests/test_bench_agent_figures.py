"""`warmup-agent bench` under the agent as users reach the pod (issues 71, 72): every
request of an agent start goes through the agent's proxy; the figure of record is the
users' first-request tax the agent exported, beside its probes' prediction; the warm-up
behind the users is waited for and the requests sent beside it compared with those after
it; a prompt length inside the traffic's range, new to the start, is measured in every
condition; the warm-up's seconds over its budget.

The summary's arithmetic is checked on hand-made start records, the measuring steps
against a small stdlib server (tests/test_bench_command.py's), and every figure in a
real short bench of the tests' llama-server under the agent."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import ROOT
from tests.test_bench_command import FAKE_SERVER, _left_running
from warmup_agent.bench import client, measure, process, report, start, summary
from warmup_agent.bench.traffic import LONGER_BY, MIN_APART, Traffic, load_requests_file

# --- the names the bench reads -----------------------------------------------------------


def test_every_metric_the_bench_reads_is_in_the_catalogue():
    """All of them, not only EXPORTED_TAXES (tests/test_metrics_doc.py checks those)."""
    from exporter import metric_handles
    assert set(start.AGENT_METRICS) <= set(metric_handles.NAMES), set(start.AGENT_METRICS) - set(metric_handles.NAMES)
    assert {name for _, name in start.EXPORTED_TAXES} == {"warmup_first_user_request_tax_ratio",
                                                          "warmup_first_user_request_total_tax_ratio"}
    # and every new figure is named with a description
    named = dict(summary.FIGURES + summary.AGENT_FIGURES + summary.HEADLINE)
    for key in ("new_length_after_background_ttft_tax", "predicted_over_measured_ttft_tax",
                "background_user_ttft_over_steady", "steady_after_background_ttft_seconds",
                "warmup_budget_overspend_ratio", "agent_over_oneshot_ready_seconds",
                "exported_over_measured_ttft_tax_min", "warmup_budget_overspend_ratio_max"):
        assert named.get(key), key


def test_a_labelled_sample_is_read_by_its_labels():
    text = ('# TYPE model_loading_phase_duration_seconds gauge\n'
            'model_loading_phase_duration_seconds{phase="reserve"} 0.25\n'
            'model_loading_phase_duration_seconds{phase="prewarm"} 3.5\n'
            '# TYPE warmup_budget_seconds gauge\nwarmup_budget_seconds 2.0\n')
    assert client.gauge(text, "model_loading_phase_duration_seconds", {"phase": "prewarm"}) == 3.5
    assert client.gauge(text, "model_loading_phase_duration_seconds") == 0.25
    assert client.gauge(text, "model_loading_phase_duration_seconds", {"phase": "solidify"}) is None
    assert client.gauge(text, "warmup_budget_seconds") == 2.0


# --- the summary's arithmetic --------------------------------------------------------------

def _rec(cond: str, ready: float, **figures) -> dict:
    return {"condition": cond, "ready_seconds": ready, "first": {"ttft_seconds": 0.1},
            "sigterm": {"exit_seconds": 0.5, "orphans": 0}, **figures}


def test_the_headline_figures_over_hand_made_starts():
    starts = [
        _rec("oneshot", 2.0, new_length_after_background_ttft_tax=1.8),
        _rec("oneshot", 4.0, new_length_after_background_ttft_tax=1.2),
        _rec("oneshot", 3.0),                                          # measured no new length
        _rec("agent", 5.0, exported_over_measured_ttft_tax=0.9, predicted_over_measured_ttft_tax=1.9,
             background_user_ttft_over_steady=1.5, new_length_after_background_ttft_tax=1.1,
             warmup_budget_overspend_ratio=0.8),
        _rec("agent", 7.0, exported_over_measured_ttft_tax=1.2, predicted_over_measured_ttft_tax=1.4,
             background_user_ttft_over_steady=None, new_length_after_background_ttft_tax=1.3,
             warmup_budget_overspend_ratio=1.6),
        _rec("agent", 6.0, exported_over_measured_ttft_tax=1.0, predicted_over_measured_ttft_tax=2.5,
             background_user_ttft_over_steady=1.1, new_length_after_background_ttft_tax=1.0,
             warmup_budget_overspend_ratio=None),
    ]
    res = summary.result({"tool": "warmup-agent bench"}, starts, ["oneshot", "agent"])
    h = res["headline"]
    assert list(h) == [name for name, _ in summary.HEADLINE]
    assert h["exported_over_measured_ttft_tax_min"] == 0.9 and h["exported_over_measured_ttft_tax_max"] == 1.2
    assert h["predicted_over_measured_ttft_tax_min"] == 1.4 and h["predicted_over_measured_ttft_tax_max"] == 2.5
    assert h["agent_over_oneshot_ready_seconds"] == pytest.approx(6.0 / 3.0)
    # None where a start did not measure it: the others' median and max
    assert h["background_user_ttft_over_steady_median"] == pytest.approx(1.3)
    assert h["background_user_ttft_over_steady_max"] == 1.5
    assert h["new_length_after_background_ttft_tax_median"] == 1.1
    assert h["new_length_after_background_ttft_tax_max"] == 1.3
    assert h["warmup_budget_overspend_ratio_max"] == 1.6
    # the new length per condition, as every figure: oneshot's two starts that measured it
    assert res["summary"]["oneshot"]["new_length_after_background_ttft_tax"] == {
        "median": 1.5, "min": 1.2, "max": 1.8, "n": 2}
    assert "warmup_budget_overspend_ratio" not in res["summary"]["oneshot"]      # an agent figure
    assert json.loads(summary.dumps(res))["headline"] == h
    # printed at the end of a bench, and in the HTML
    text = report.table(res | {"starts_done": {"oneshot": 3, "agent": 3}})
    for name, value in (("agent_over_oneshot_ready_seconds", "2.00"), ("warmup_budget_overspend_ratio_max", "1.60"),
                        ("predicted_over_measured_ttft_tax_max", "2.50")):
        assert f"{name}: {value}" in text
    assert "new_length_after_background_ttft_tax" in text and "background_user_ttft_over_steady" in text
    assert 'id="headline"' in report.render_html(res | {"starts_done": {}}, None)


def test_the_headline_is_none_where_a_condition_is_missing():
    res = summary.result({}, [_rec("agent", 5.0, exported_over_measured_ttft_tax=1.0)], ["agent"])
    h = res["headline"]
    assert h["agent_over_oneshot_ready_seconds"] is None               # no oneshot start
    assert h["exported_over_measured_ttft_tax_min"] == h["exported_over_measured_ttft_tax_max"] == 1.0
    assert h["background_user_ttft_over_steady_max"] is None and h["warmup_budget_overspend_ratio_max"] is None
    res = summary.result({}, [_rec("alone", 1.0), _rec("oneshot", 0.0)], ["alone", "oneshot"])
    assert all(v is None for v in res["headline"].values())           # no agent; oneshot ready 0 divides nothing


# --- a new length inside the traffic's range ------------------------------------------------

def test_the_new_length_lies_inside_the_range_the_traffic_draws_and_away_from_the_starts_own():
    t = Traffic(11, max_context=508, max_tokens=32)
    lo, hi = t.length_range()
    drawn = [t.shape(i).prompt_words for i in range(300)]
    assert lo <= min(drawn) and max(drawn) <= hi and hi - lo > 40     # the range is the mix's
    for i in range(30):
        shape = t.shape(i)
        used = [shape.prompt_words, t.longer(shape).prompt_words]
        words = t.unused_length(i, used)
        assert words is not None and lo <= words <= hi
        assert all(abs(words - u) >= LONGER_BY for u in used), (words, used)
        assert Traffic(11, max_context=508, max_tokens=32).unused_length(i, used) == words   # every condition's
        body = t.request(t.at_length(shape, words))
        assert len(body["messages"][-1]["content"].split(":", 1)[1].split()) == words
        assert {k: v for k, v in body.items() if k != "messages"} == {k: v for k, v in shape.body.items()
                                                                      if k != "messages"}
    # a narrow range: the farthest length drawn, if MIN_APART away; else none, and the record says why
    narrow = Traffic(11, max_context=252, max_tokens=16)
    assert narrow.length_range() == (4, 37)
    words = narrow.unused_length(0, [15, 27])          # nothing in 4-37 is 12 words from both
    assert words is not None and MIN_APART <= min(abs(words - 15), abs(words - 27)) < LONGER_BY
    assert t.unused_length(0, list(range(lo, hi + 1))) is None


def test_a_requests_file_new_length_is_between_its_shortest_and_longest(tmp_path):
    f = tmp_path / "traffic.jsonl"
    lines = [{"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": " ".join(["word"] * n)}], "max_tokens": 4} for n in (5, 60)]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    t = Traffic(3, file_bodies=load_requests_file(str(f)))
    assert t.length_range() == (7, 62)                                 # the system message's 2 words included
    shape = next(t.shape(i) for i in range(20) if t.shape(i).prompt_words == 7)
    words = t.unused_length(0, [7, 19])
    assert words is not None and 31 <= words <= 62
    longer = t.at_length(shape, words)
    assert longer.prompt_words == words and longer.body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert t.at_length(t.shape(0), 3).body["messages"][-1]["content"] == "word"   # cut to what fits (one word)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(lines[0]) + "\n")
    assert Traffic(3, file_bodies=load_requests_file(str(one))).unused_length(0, [7, 19]) is None


# --- the measuring steps, against a small real server ----------------------------------------

@pytest.fixture
def fake_server(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = process.free_port()
    proc = subprocess.Popen([sys.executable, str(script), "--port", str(port), "--state", str(tmp_path / "count"),
                             "--delay", "0.01"])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while client.get_status(base + "/health") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.02)
        yield base, tmp_path / "count"
    finally:
        proc.kill()
        proc.wait()


def test_the_requests_sent_beside_the_warm_up_are_told_from_those_after(fake_server):
    base, count = fake_server
    traffic = Traffic(5, max_context=508, max_tokens=8)
    r = measure.Requests(base, None, traffic, traffic.shape(0), 0)
    reads = iter([1, 1, None, 0])              # the gauge before each steady request: 1, 1, unreadable, 0
    out: dict = {}
    measure.first_and_steady(r, 4, out, lambda: next(reads))
    assert out["steady_sent_while_behind"] == [True, True, False, False]
    polls = iter([1, 1, 0])
    measure.after_background(r, 3, out, lambda: next(polls), lambda: 4.5)
    assert out["behind_users_finished"] is True and out["behind_users_seconds"] == 4.5
    assert out["behind_users_waited_seconds"] >= 2 * measure.BEHIND_POLL
    beside = statistics.median(out["steady_ttft_all_seconds"][:2])
    after = out["steady_after_background_ttft_seconds"]
    assert out["background_user_ttft_over_steady"] == pytest.approx(beside / after)
    assert int(count.read_text()) == 1 + 4 + 3
    # a warm-up that never finishes: waited for at most the timeout, recorded as not finished
    out2 = {**out, "steady_sent_while_behind": [False] * 4}
    measure.after_background(r, 1, out2, lambda: 1, lambda: 9.0, timeout=0.3)
    assert out2["behind_users_finished"] is False and out2["behind_users_seconds"] is None
    assert 0.3 <= out2["behind_users_waited_seconds"] < 1.0
    assert out2["background_user_ttft_over_steady"] is None          # nothing was sent beside it
    measure.new_length(r, out2)
    assert out2["new_length_after_background"]["words"] == traffic.unused_length(
        0, [r.shape.prompt_words, r.shape.prompt_words + LONGER_BY])
    nl = out2["new_length_after_background"]
    assert out2["new_length_after_background_ttft_tax"] == pytest.approx(
        nl["first_ttft_seconds"] / nl["second_ttft_seconds"])


# --- a real short bench under the agent ------------------------------------------------------

@pytest.mark.slow
def test_real_llama_server_oneshot_and_agent_every_new_figure(tmp_path, llama_server, gguf, embedded_model):
    """One start of oneshot and of the agent, against the tests' CPU llama-server: every
    request of the agent start goes through its proxy (the users' tax it exported exists only
    for requests that passed it), and every new figure is present and sane."""
    model = tmp_path / "model.gguf"          # the marker (tmp_path) in every command line
    os.symlink(gguf, model)
    server = [llama_server, "-m", str(model), "-c", "2048", "--host", "127.0.0.1", "--port", "{port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
    env["WARMUP_AGENT_DATA_DIR"] = str(tmp_path / "agent-data")    # no findings left in ~/.cache
    cmd = [sys.executable, "-m", "warmup_agent", "bench", "--no-progress", "--out", str(tmp_path / "out"),
           "--seed", "11", "--idle", "0.5", "--starts", "1", "--steady", "5", "--conditions", "oneshot,agent",
           "--agent-model", embedded_model, "--", *server]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "out" / "bench.json") as f:
        res = json.load(f)
    assert res["status"] == "complete" and _left_running(tmp_path, res) == []
    oneshot, agent = (next(x for x in res["starts"] if x["condition"] == c) for c in ("oneshot", "agent"))

    # the agent's start reached the server through the proxy; oneshot's straight
    assert oneshot["users_url"].endswith(f":{oneshot['port']}")
    assert not agent["users_url"].endswith(f":{agent['port']}")
    # the figure of record: the users' first request as the agent measured it at its proxy,
    # the same requests the bench timed: its first and the 5 after it (readiness.first_user_steady_requests)
    assert agent["agent_exported_ttft_tax"] > 0 and agent["agent_exported_total_tax"] > 0
    assert agent["first_ttft_tax_users_window"] == pytest.approx(agent["first_ttft_tax"])   # --steady 5
    assert agent["exported_over_measured_ttft_tax"] == pytest.approx(
        agent["agent_exported_ttft_tax"] / agent["first_ttft_tax_users_window"])
    assert 0.5 < agent["exported_over_measured_ttft_tax"] < 2.0, agent
    assert agent["agent_predicted_ttft_tax"] > 0
    assert agent["predicted_over_measured_ttft_tax"] == pytest.approx(
        agent["agent_predicted_ttft_tax"] / agent["first_ttft_tax"])
    assert agent["predicted_over_measured_total_tax"] > 0
    # the warm-up behind the users: waited for, timed by the agent within the bench's wait
    assert len(agent["steady_sent_while_behind"]) == 5
    assert agent["behind_users_finished"] is True and agent["behind_users_seconds"] >= 0
    assert agent["steady_after_background_ttft_seconds"] > 0
    if any(agent["steady_sent_while_behind"]):
        assert agent["background_user_ttft_over_steady"] > 0
    else:
        assert agent["background_user_ttft_over_steady"] is None
    # the same new length in both conditions, inside the traffic's range, new to the start
    t = Traffic(11, max_context=res["traffic"]["max_context"], max_tokens=32)
    lo, hi = t.length_range()
    for rec in (oneshot, agent):
        nl = rec["new_length_after_background"]
        own = rec["shape"]["prompt_words"]
        gap = min(abs(nl["words"] - u) for u in (own, own + LONGER_BY))
        assert lo <= nl["words"] <= hi and nl["words_from_used"] == gap >= MIN_APART, nl
        assert 0 < rec["new_length_after_background_ttft_tax"] < 20
    assert oneshot["new_length_after_background"]["words"] == agent["new_length_after_background"]["words"]
    # the budget: the warm-up's own seconds within the prewarm stage
    assert agent["warmup_budget_seconds"] >= 1.0                       # prewarm.budget_min_seconds
    assert 0 < agent["warmup_budget_spent_seconds"] <= agent["prewarm_phase_seconds"]
    assert agent["warmup_budget_overspend_ratio"] == pytest.approx(
        agent["warmup_budget_spent_seconds"] / agent["warmup_budget_seconds"])
    # the run's figures, computed and printed
    h = res["headline"]
    assert h["agent_over_oneshot_ready_seconds"] == pytest.approx(agent["ready_seconds"] / oneshot["ready_seconds"])
    assert h["exported_over_measured_ttft_tax_min"] == h["exported_over_measured_ttft_tax_max"] \
        == agent["exported_over_measured_ttft_tax"]
    assert h["warmup_budget_overspend_ratio_max"] == agent["warmup_budget_overspend_ratio"]
    assert h["new_length_after_background_ttft_tax_max"] == agent["new_length_after_background_ttft_tax"]
    for name, value in h.items():
        if value is not None:
            assert f"{name}: {value:.2f}" in r.stdout, name
    assert "users' tax as exported" in r.stderr


def test_the_exported_tax_is_compared_over_the_agents_own_window():
    """The agent's users' tax divides the first request by the median of the 5 answers after it
    (readiness.first_user_steady_requests): the client's figure it is compared with does too,
    whatever --steady is."""
    from warmup_agent.bench.start import USERS_WINDOW, users_window_tax
    assert USERS_WINDOW == 5
    rec = {"first": {"ttft_seconds": 0.010}, "steady_ttft_all_seconds": [0.02, 0.02, 0.005, 0.02, 0.02, 0.005, 0.005, 0.005]}
    users_window_tax(rec)
    assert rec["first_ttft_tax_users_window"] == pytest.approx(0.5)      # not 0.010 / 0.0125 over all 8
    short = {"first": {"ttft_seconds": 0.010}, "steady_ttft_all_seconds": [0.01] * 4}
    users_window_tax(short)
    assert "first_ttft_tax_users_window" not in short
