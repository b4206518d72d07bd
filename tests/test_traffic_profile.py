"""Traffic profile (prewarm.requests_file), text prompts of exact lengths, and
the decode gate: no server needed."""
from __future__ import annotations

import json

import pytest

from warmup_agent.engines.text_prompts import TextPrompts
from warmup_agent.readiness.verdict import decode_converged
from warmup_agent.readiness.window import SlidingWindow
from warmup_agent.warmup import traffic


@pytest.fixture(scope="module")
def prompts(embedded_model):
    return TextPrompts.from_model_dir(embedded_model, traffic._SEED_TEXT)


def test_embedded_model_ships_a_chat_template(prompts, embedded_model):
    from transformers import AutoTokenizer
    assert prompts.has_chat_template
    msgs = [{"role": "user", "content": "bazo kite"}]
    assert prompts.render(msgs) == AutoTokenizer.from_pretrained(embedded_model).apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("length", [17, 23, 40, 83, 257])
def test_text_and_chat_prompts_have_the_exact_length(prompts, embedded_model, length):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(embedded_model)
    for variant in range(3):
        text, n = prompts.text(length, variant)
        assert n == length == len(tok(text, add_special_tokens=False)["input_ids"])
        msgs, n = prompts.messages(length, variant)
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        assert n == length == len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_families_of_request_bodies():
    f = traffic.family_of
    assert f({"temperature": 0}) == "greedy"
    assert f({}) == "sampled"                                   # OpenAI's default temperature is 1
    assert f({"temperature": 0.7, "top_p": 0.9}) == "sampled"
    assert f({"temperature": 0.7, "top_k": 40}) == "top_k"
    assert f({"temperature": 0.7, "frequency_penalty": 0.3}) == "penalties"
    assert f({"temperature": 0, "logprobs": True, "top_logprobs": 3}) == "logprobs"
    assert f({"prompt": "x", "logprobs": 2}) == "logprobs"
    assert f({"stop": ["\n"]}) == "stop"
    assert f({"n": 3}) == "n"
    assert f({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}) == "json_schema"


def _write(tmp_path, lines):
    p = tmp_path / "requests.jsonl"
    p.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return str(p)


def test_profile_learned_from_a_requests_file(tmp_path, prompts):
    chat = lambda c, **kw: {"model": "m", "messages": [{"role": "user", "content": c}], **kw}  # noqa: E731
    path = _write(tmp_path, [
        chat("bazo kite lumo", max_tokens=64, temperature=0.7, top_p=0.9),
        chat("rasivu tenapo bazo kite lumo rasivu", max_tokens=32, temperature=0.7, top_p=0.9),
        chat("kite", max_tokens=8, temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}),
        {"model": "m", "prompt": "lumo rasivu", "max_tokens": 16, "temperature": 0, "logprobs": 2},
        ""])
    p = traffic.load_requests_file(path, prompts.count_chat, prompts.count_text)
    assert p.endpoints == ["chat", "completions"] and p.requests_seen == 4
    assert p.max_tokens == 64
    assert set(p.families) == {"sampled", "json_schema", "logprobs"}
    assert p.families["sampled"] == {"temperature": 0.7, "top_p": 0.9}
    assert p.families["json_schema"]["response_format"]["json_schema"]["name"] == "a"
    expected = sorted({prompts.count_chat([{"role": "user", "content": c}]) for c in
                       ("bazo kite lumo", "rasivu tenapo bazo kite lumo rasivu", "kite")} | {prompts.count_text("lumo rasivu")})
    assert p.prompt_lengths == expected


@pytest.mark.parametrize("lengths,answer", [([16, 32, 64, 128], 64), ([16, 32, 40, 57, 64, 128, 150, 230], 64),
                                            ([7], 16), ([10, 11], 1), ([5, 1000], 3)])
def test_decode_tiles_reach_every_sequence_length_of_the_traffic(lengths, answer):
    """Every length a decode step of real traffic reaches (shortest prompt .. longest
    prompt + longest answer) is decoded by some warmup answer."""
    tiles = traffic.decode_tiles(lengths, answer)
    reached = {n for p in tiles for n in range(p, p + answer + 1)}
    assert set(range(min(lengths), max(lengths) + answer + 1)) <= reached
    assert len(tiles) <= (max(lengths) - min(lengths)) // answer + 2       # one answer apart, no more
    assert traffic.decode_tiles([16, 32, 64, 128], 64) == [16, 80, 128]


def test_default_profile_is_greedy_and_sampled_up_to_the_max_answer():
    p = traffic.default_profile(["chat", "completions"], 64, [])
    assert set(p.families) == {"greedy", "sampled"}
    probe = traffic.probe_request(p, 16, 8)
    assert probe.endpoint == "chat" and probe.family == "sampled" and probe.sampling == {"temperature": 0.7, "top_p": 0.9}


@pytest.mark.parametrize("line,expected", [
    ("{not json", ":1: not JSON"),
    (json.dumps({"model": "m"}), ":1: no field 'messages' or 'prompt'; expected a /v1/chat/completions body (messages) or a /v1/completions body (prompt)"),
    (json.dumps({"messages": []}), ":1: field 'messages': got []; expected a non-empty list"),
    (json.dumps({"prompt": "x", "max_tokens": -3}), ":1: field 'max_tokens': got -3; expected an integer > 0"),
])
def test_bad_requests_file_is_one_line_naming_file_and_line(tmp_path, prompts, line, expected):
    """(Every case of the line check: tests/test_requests_file.py.)"""
    path = _write(tmp_path, [line])
    with pytest.raises(ValueError) as e:
        traffic.load_requests_file(path, prompts.count_chat, prompts.count_text, bad_lines="fail")
    assert str(e.value) == path + expected or str(e.value).startswith(path + expected)
    assert "\n" not in str(e.value)


def test_spread_keeps_min_max_and_at_most_k():
    assert traffic.spread([5, 1, 3], 8) == [1, 3, 5]
    s = traffic.spread(list(range(1, 1001)), 8)
    assert len(s) <= 8 and s[0] == 1 and s[-1] == 1000


def test_decode_gate_waits_until_decode_stops_getting_faster():
    w = SlidingWindow(100)
    for v in [0.05, 0.04, 0.04, 0.03, 0.03, 0.01, 0.01, 0.01, 0.01, 0.01]:   # a cold decode phase
        w.add(v)
    assert not decode_converged(w, 10, 0.6, 1.5)   # older half median 0.04 > 1.5 x 0.01
    for _ in range(5):
        w.add(0.01)
    assert decode_converged(w, 10, 0.6, 1.5)       # last 10 all steady
    assert not decode_converged(w, 10, 0.005, 1.5)  # P90 over the absolute threshold
    assert not decode_converged(SlidingWindow(10), 1, 1.0, 1.5)


def test_decode_gate_opens_on_a_noisy_but_steady_host():
    """Stalls from a busy host widen the spread for ever; they must not hold the gate."""
    w = SlidingWindow(100)
    for i in range(10):
        w.add(0.19 if i % 4 == 1 else 0.029)   # P90/P50 = 6.5, as seen on two shared cores
    assert decode_converged(w, 10, 0.5, 1.5)
