"""prewarm.requests_file is checked like the config (issue 29): every line, when
the config is loaded and by `check-config`, before any server starts, for every
engine.  A bad line is one line naming the file, the line and the field, exit 2;
with prewarm.requests_file_bad_lines: skip it is left out, counted and warned
about once.

The checker itself (warmup_agent/warmup/requests_file.py) is tested in-process; the
issue's cases also through the real CLI, where a supervised "server" that
would write a marker file proves that none was started.  The 1-million-line
check is a benchmark (bench/bench_requests_file.py), not a timed test."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import run_agent
from warmup_agent import config
from warmup_agent.config import ConfigError
from warmup_agent.warmup import requests_file, traffic

KEY = "key 'prewarm.requests_file': "
CHAT = {"model": "m", "messages": [{"role": "user", "content": "bazo kite"}], "max_tokens": 8}
TEXT = {"model": "m", "prompt": "lumo rasivu", "max_tokens": 16, "temperature": 0, "logprobs": 2}


def write(tmp_path, content: bytes | str | list, name: str = "requests.jsonl") -> str:
    p = tmp_path / name
    if isinstance(content, list):
        content = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in content)
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(p)


def chat(**fields) -> dict:
    return {**CHAT, **fields}


# --- one body ----------------------------------------------------------------------
GOOD_BODIES = [
    CHAT, TEXT,
    # README's examples
    {"model": "m", "messages": [{"role": "user", "content": "..."}], "max_tokens": 64, "temperature": 0.7, "top_p": 0.9},
    {"model": "m", "prompt": "...", "max_tokens": 16, "temperature": 0, "logprobs": 2},
    chat(temperature=2, top_p=1, top_k=40, n=2, presence_penalty=-2, frequency_penalty=2.0, stop="\n",
         logprobs=True, top_logprobs=3, max_completion_tokens=5, seed=1, stream=True),
    chat(top_k=-1, stop=["a", "b"], temperature=None, response_format={"type": "json_object"}),
    chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "x"}]},
                   {"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool", "content": "42"}]),
    {"prompt": [1, 2, 3]}, {"prompt": ["a", "b"]}, {"prompt": [[1, 2], [3]]},
    chat(some_server_field={"anything": 1}),     # a field another server understands: left to the server
]


@pytest.mark.parametrize("body", GOOD_BODIES)
def test_good_bodies_have_no_problem(body):
    assert requests_file.check_body(body) == []


BAD_BODIES = [
    (chat(temperature="hot"), "field 'temperature': got 'hot'; expected a number from 0 to 2"),
    (chat(temperature=2.5), "field 'temperature': got 2.5; expected a number from 0 to 2"),
    (chat(top_p=1.5), "field 'top_p': got 1.5; expected a number from 0 to 1"),
    (chat(top_k=0.5), "field 'top_k': got 0.5; expected an integer > 0 (-1 or 0: no top-k)"),
    (chat(n=0), "field 'n': got 0; expected an integer > 0"),
    (chat(max_tokens=-3), "field 'max_tokens': got -3; expected an integer > 0"),
    (chat(max_tokens=True), "field 'max_tokens': got true; expected an integer > 0"),
    (chat(max_completion_tokens="8"), "field 'max_completion_tokens': got '8'; expected an integer > 0"),
    (chat(presence_penalty=3), "field 'presence_penalty': got 3; expected a number from -2 to 2"),
    (chat(frequency_penalty=-2.1), "field 'frequency_penalty': got -2.1; expected a number from -2 to 2"),
    (chat(stop=["\n", 7]), "field 'stop': got [\"\\n\", 7]; expected a string or a list of strings"),
    (chat(logprobs=2), "field 'logprobs': got 2; expected true or false"),
    ({**TEXT, "logprobs": -1}, "field 'logprobs': got -1; expected an integer >= 0"),
    (chat(top_logprobs="2"), "field 'top_logprobs': got '2'; expected an integer >= 0"),
    (chat(messages="hi"), "field 'messages': got 'hi'; expected a non-empty list of {\"role\": ..., \"content\": ...} objects"),
    (chat(messages=[]), "field 'messages': got []; expected a non-empty list of {\"role\": ..., \"content\": ...} objects"),
    (chat(messages=[{"content": "x"}]),
     "field 'messages[0].role': missing; expected one of system, user, assistant, tool, developer, function"),
    (chat(messages=[{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}]),
     "field 'messages[1].role': got 'robot'; expected one of system, user, assistant, tool, developer, function"),
    (chat(messages=[{"role": "user", "content": 5}]),
     "field 'messages[0].content': got 5; expected a string or a list of content parts ({\"type\": \"text\", \"text\": ...})"),
    (chat(messages=[{"role": "user"}]), "field 'messages[0].content': missing; expected a string or a list of content parts"),
    (chat(messages=["hi"]), "field 'messages[0]': got 'hi'; expected an object with role and content"),
    ({"prompt": {"text": "x"}}, "field 'prompt': got {\"text\": \"x\"}; expected a string, a list of strings, or a non-empty list of token ids"),
    ({"prompt": "x", "max_completion_tokens": 4},
     "field 'max_completion_tokens': a /v1/chat/completions field; expected max_tokens in a /v1/completions body (prompt)"),
    ({"model": "m"}, "no field 'messages' or 'prompt'; expected a /v1/chat/completions body (messages) or a /v1/completions body (prompt)"),
    ({**CHAT, "prompt": "x"}, "fields 'messages' and 'prompt' both set; expected one: messages (/v1/chat/completions) or prompt (/v1/completions)"),
    ([CHAT], "got a JSON list; expected a JSON object (one OpenAI request body)"),
]


@pytest.mark.parametrize("body,problem", BAD_BODIES, ids=[p[:40] for _, p in BAD_BODIES])
def test_each_bad_field_is_named_with_what_was_expected(body, problem):
    assert requests_file.check_body(body) == [problem]


def test_every_problem_of_a_body_is_listed_the_first_reported():
    assert requests_file.check_body(chat(temperature="hot", n=0)) == [
        "field 'temperature': got 'hot'; expected a number from 0 to 2", "field 'n': got 0; expected an integer > 0"]


# --- a file --------------------------------------------------------------------------
def test_good_and_bad_lines_with_their_numbers(tmp_path):
    path = write(tmp_path, [CHAT, "", chat(temperature="hot", n=0), "{not json", TEXT, "  ", "[]", CHAT])
    c = requests_file.check_file(path)
    assert [n for n, _ in c.good] == [1, 5, 8] and c.good[1][1] == TEXT and c.good_count == 3
    assert c.bad == [(3, "field 'temperature': got 'hot'; expected a number from 0 to 2 (and 1 more problem)"),
                     (4, "not JSON (Expecting property name enclosed in double quotes at column 2); "
                         "expected one OpenAI request body per line"),
                     (7, "got a JSON list; expected a JSON object (one OpenAI request body)")]
    assert c.bad_lines() == {"count": 3, "first_lines": [3, 4, 7]}
    assert c.error() == (f"{path}:3: field 'temperature': got 'hot'; expected a number from 0 to 2 (and 1 more problem) "
                         "(3 bad lines in all, at lines 3, 4, 7)")
    assert c.skip_error() is None
    assert c.skip_warning() == (f"key 'prewarm.requests_file': {path}: skipped 3 bad lines of 6 (lines 3, 4, 7); "
                                f"first: {path}:3: field 'temperature': got 'hot'; expected a number from 0 to 2 (and 1 more problem)")
    assert requests_file.check_file(path, keep_good=False).good == []
    # the APIs the good lines use (discovery asks only these); a bad line counts for none
    assert c.endpoints == {"chat", "completions"}
    assert requests_file.check_file(write(tmp_path, [CHAT, "{not json"])).endpoints == {"chat"}


def test_the_warning_lists_the_first_five_line_numbers_only(tmp_path):
    path = write(tmp_path, [CHAT] + ["x"] * 200)
    c = requests_file.check_file(path, keep_good=False)
    assert c.bad_count == 200 and len(c.bad) == requests_file.KEEP_BAD
    assert "skipped 200 bad lines of 201 (lines 2, 3, 4, 5, 6, ...)" in c.skip_warning()


def test_truncated_last_line_and_non_utf8_byte(tmp_path):
    path = write(tmp_path, json.dumps(CHAT) + "\n" + json.dumps(TEXT)[:20])
    assert requests_file.check_file(path).error() == (
        f"{path}:2: truncated last line (no newline at the end; Unterminated string starting at column 16); "
        "expected one complete JSON request body per line")
    path = write(tmp_path, json.dumps(CHAT).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    assert requests_file.check_file(path).error() == (
        f"{path}:2: not UTF-8 (byte 0xe9 at column 16); expected one UTF-8 JSON request body per line")
    path = write(tmp_path, "\ufeff" + json.dumps(CHAT) + "\n")       # a byte-order mark is no bad line
    assert requests_file.check_file(path).bad_count == 0


def test_empty_and_unreadable_files(tmp_path):
    path = write(tmp_path, "\n\n  \n")
    assert requests_file.check_file(path).error() == f"{path}: no requests; expected one OpenAI request body per line"
    with pytest.raises(OSError):
        requests_file.check_file(str(tmp_path / "missing.jsonl"))


def test_a_line_of_10_mb(tmp_path):
    big = "bazo kite " * 1_000_000
    path = write(tmp_path, [chat(messages=[{"role": "user", "content": big}]), chat(temperature=big)])
    c = requests_file.check_file(path)
    assert c.good_count == 1 and len(c.good[0][1]["messages"][0]["content"]) == 10_000_000
    # The bad value is quoted, cut: the error stays one short line.
    assert c.bad == [(2, "field 'temperature': got 'bazo kite bazo kite bazo kite bazo kite...; expected a number from 0 to 2")]


def test_profile_skips_bad_lines_and_counts_them(tmp_path):
    path = write(tmp_path, [CHAT, chat(temperature="hot"), TEXT, "{", chat(n=2)])
    count_chat = lambda messages: sum(len(m["content"].split()) for m in messages)  # noqa: E731
    p = traffic.load_requests_file(path, count_chat, lambda text: len(text.split()))
    assert p.requests_seen == 3 and p.bad_lines == {"count": 2, "first_lines": [2, 4]}
    assert p.family_lines == {"sampled": 1, "logprobs": 3, "n": 5}
    assert traffic.default_profile(["chat"], 8, []).bad_lines == {"count": 0, "first_lines": []}
    with pytest.raises(ValueError) as e:
        traffic.load_requests_file(path, count_chat, len, bad_lines="fail")
    assert str(e.value) == f"{path}:2: field 'temperature': got 'hot'; expected a number from 0 to 2"
    only_bad = write(tmp_path, ["{", "[]"], "bad.jsonl")
    with pytest.raises(ValueError) as e:
        traffic.load_requests_file(only_bad, count_chat, len)
    assert str(e.value).startswith(f"{only_bad}: no good requests: all 2 lines are bad (lines 1, 2); first: {only_bad}:1: not JSON")


# --- with the config -------------------------------------------------------------------
def load(path: str, policy: str | None = None, engine: str = "openai"):
    env = {"WARMUP_AGENT_PREWARM_REQUESTS_FILE": path, "WARMUP_AGENT_ENGINE": engine}
    if policy:
        env["WARMUP_AGENT_PREWARM_REQUESTS_FILE_BAD_LINES"] = policy
    return config.load(env=env)


def test_config_load_checks_the_file(tmp_path):
    good = write(tmp_path, [CHAT, TEXT])
    cfg = load(good)
    assert cfg.requests_check.good_count == 2 and cfg.warnings == []
    bad = write(tmp_path, [CHAT, chat(temperature="hot")], "bad.jsonl")
    with pytest.raises(ConfigError) as e:
        load(bad)
    assert str(e.value) == KEY + f"{bad}:2: field 'temperature': got 'hot'; expected a number from 0 to 2"
    assert e.value.key == "prewarm.requests_file" and e.value.reason == "invalid_config"
    cfg = load(bad, "skip")
    assert cfg.requests_check.bad_lines() == {"count": 1, "first_lines": [2]}
    assert cfg.warnings == [KEY + f"{bad}: skipped 1 bad line of 2 (lines 2); first: {bad}:2: field 'temperature': "
                            "got 'hot'; expected a number from 0 to 2"]
    with pytest.raises(ConfigError) as e:
        load(bad, "sometimes")
    assert "key 'prewarm.requests_file_bad_lines': got 'sometimes'; expected one of fail, skip" in str(e.value)


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_an_engine_that_does_not_use_the_file_says_so_but_checks_it(tmp_path, engine):
    good = write(tmp_path, [CHAT])
    assert load(good, engine=engine).warnings == [
        KEY + f"engine {engine} does not use it (only engine openai warms the traffic a requests file describes); "
        f"{good} was checked (1 request) and is ignored"]
    with pytest.raises(ConfigError) as e:
        load(str(tmp_path / "missing.jsonl"), engine=engine)
    assert str(e.value) == KEY + f"{tmp_path / 'missing.jsonl'}: cannot read the requests file: No such file or directory"
    with pytest.raises(ConfigError):
        load(write(tmp_path, ["{"], "bad.jsonl"), engine=engine)


def test_no_file_no_check():
    cfg = config.load(env={})
    assert cfg.requests_check is None and cfg.warnings == []


# --- through the real CLI: exit 2, one line, no server ------------------------------------
# The issue's cases: (file content, the line after "config error: key '...': PATH").
CLI_CASES = {
    "missing": (None, ": cannot read the requests file: No such file or directory"),
    "garbage_line_1": ("garbage\n" + json.dumps(CHAT) + "\n",
                       ":1: not JSON (Expecting value at column 1); expected one OpenAI request body per line"),
    "empty": ("", ": no requests; expected one OpenAI request body per line"),
    "temperature_hot": (json.dumps(chat(temperature="hot")) + "\n",
                        ":1: field 'temperature': got 'hot'; expected a number from 0 to 2"),
    "truncated_last_line": (json.dumps(CHAT) + "\n" + json.dumps(CHAT)[:30],
                            ":2: truncated last line (no newline at the end; Unterminated string starting at column 30); "
                            "expected one complete JSON request body per line"),
    "non_utf8_byte": (json.dumps(CHAT).encode() + b"\n" + b'{"prompt": "\xff"}\n',
                      ":2: not UTF-8 (byte 0xff at column 13); expected one UTF-8 JSON request body per line"),
    "bad_messages": (json.dumps(CHAT) + "\n" + json.dumps(chat(messages=[{"role": "user", "content": 5}])) + "\n",
                     ":2: field 'messages[0].content': got 5; expected a string or a list of content parts "
                     "({\"type\": \"text\", \"text\": ...})"),
}


def case_file(tmp_path, case: str) -> str:
    content = CLI_CASES[case][0]
    return str(tmp_path / "missing.jsonl") if content is None else write(tmp_path, content)


def config_file(tmp_path, requests: str, engine: str | None = None, **prewarm) -> str:
    p = tmp_path / "agent.yaml"
    tree: dict = {"prewarm": {"requests_file": requests, **prewarm}}
    if engine:
        tree["engine"] = engine
    p.write_text(json.dumps(tree))   # JSON is YAML
    return str(p)


def assert_one_config_error(r, expected: str):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert [line for line in r.stderr.splitlines() if line.strip()] == ["warmup-agent: config error: " + expected]


@pytest.mark.slow   # an agent process
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_check_config_reports_the_bad_line(tmp_path, case):
    path = case_file(tmp_path, case)
    r = run_agent("check-config", config_file(tmp_path, path), timeout=60)
    assert_one_config_error(r, KEY + path + CLI_CASES[case][1])


def marker_server(tmp_path) -> tuple[str, list[str]]:
    marker = str(tmp_path / "SERVER_STARTED")
    return marker, ["--", sys.executable, "-c", f"open({marker!r}, 'w')"]


@pytest.mark.slow   # an agent process
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_run_never_starts_a_server_on_a_bad_file(tmp_path, case):
    """The same line as check-config, exit 2, and the supervised server (which
    would write a marker file) never started."""
    path = case_file(tmp_path, case)
    marker, server = marker_server(tmp_path)
    r = run_agent("run", "--once", "--no-progress", "--engine", "openai", "--listen", "127.0.0.1:0",
                  "--data-dir", str(tmp_path / "data"), "--config", config_file(tmp_path, path), *server, timeout=60)
    assert_one_config_error(r, KEY + path + CLI_CASES[case][1])
    assert not os.path.exists(marker)


@pytest.mark.slow   # an agent process
def test_the_marker_server_does_start_on_a_good_file(tmp_path):
    """The control of the test above: with a good file the same command starts the
    server (which exits at once: server_exited, exit 3)."""
    marker, server = marker_server(tmp_path)
    r = run_agent("run", "--once", "--no-progress", "--engine", "openai", "--listen", "127.0.0.1:0",
                  "--data-dir", str(tmp_path / "data"), "--config", config_file(tmp_path, write(tmp_path, [CHAT])),
                  *server, timeout=60)
    assert r.returncode == 3 and "server_exited" in r.stderr, r.stderr
    assert os.path.exists(marker)


@pytest.mark.slow   # an agent process
def test_skip_policy_counts_bad_lines_in_the_record_and_warns_once(tmp_path):
    path = write(tmp_path, [CHAT, chat(temperature="hot"), TEXT, "{", chat(n=0), chat(top_p=2), chat(stop=1), chat(n=2), "["])
    rec = tmp_path / "run.json"
    marker, server = marker_server(tmp_path)
    r = run_agent("run", "--once", "--no-progress", "--engine", "openai", "--listen", "127.0.0.1:0",
                  "--data-dir", str(tmp_path / "data"), "--record", str(rec),
                  "--config", config_file(tmp_path, path, requests_file_bad_lines="skip"), *server, timeout=60)
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr     # the marker "server" exits at once
    warnings = [line for line in r.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, r.stderr
    assert warnings[0].endswith(KEY + f"{path}: skipped 6 bad lines of 9 (lines 2, 4, 5, 6, 7, ...); first: "
                                f"{path}:2: field 'temperature': got 'hot'; expected a number from 0 to 2")
    record = json.loads(rec.read_text())
    assert record["requests_file"] == {"path": path, "policy": "skip", "requests": 3,
                                       "bad_lines": {"count": 6, "first_lines": [2, 4, 5, 6, 7]}}
    r = run_agent("check-config", config_file(tmp_path, path, "openai", requests_file_bad_lines="skip"), timeout=60)
    assert r.returncode == 0 and r.stderr == "warmup-agent: warning: " + warnings[0].split("warmup_agent: ", 1)[1] + "\n"


@pytest.mark.slow   # an agent process
def test_default_engine_says_the_file_does_not_apply_and_a_missing_file_is_an_error(tmp_path):
    """torch (the default) does not use the file: check-config warns and names the key;
    a file that cannot be read is exit 2 for it as well, before the model is made."""
    good = write(tmp_path, [CHAT])
    r = run_agent("check-config", config_file(tmp_path, good), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ("warmup-agent: warning: " + KEY + "engine torch does not use it (only engine openai warms the "
                        f"traffic a requests file describes); {good} was checked (1 request) and is ignored\n")
    missing = str(tmp_path / "missing.jsonl")
    r = run_agent("run", "--once", "--no-progress", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                  "--config", config_file(tmp_path, missing), timeout=60)
    assert_one_config_error(r, KEY + missing + CLI_CASES["missing"][1])
    assert not os.path.exists(tmp_path / "data")      # nothing made: not even the embedded model


@pytest.mark.slow   # an agent process
def test_run_logs_the_warning_before_the_engine_starts(tmp_path):
    """`run` logs the same warning (here the in-process vllm engine, which this venv
    lacks: it stops at once with exit 2, after the warning)."""
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the engine would start")
    good = write(tmp_path, [CHAT])
    r = run_agent("run", "--once", "--no-progress", "--engine", "vllm", "--listen", "127.0.0.1:0",
                  "--data-dir", str(tmp_path / "data"), "--config", config_file(tmp_path, good), timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    warnings = [line for line in r.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        KEY + f"engine vllm does not use it (only engine openai warms the traffic a requests file describes); "
        f"{good} was checked (1 request) and is ignored"), r.stderr
