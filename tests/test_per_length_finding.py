"""The per-length finding's log line names what the user will pay (issue 30).

The per-length test runs here on scripted calls: the times H200 tfserve defaults run 6
(bench/results/gpu_server_tfserve_default_h200_run6.json, start 0) and tfserve + switch
run 8 (start 4) measured, handed to `ProfileWarmup.per_length_test` by a scripted
`send` instead of a server (the real-server path is tests/test_openai_transformers_serve.py;
on the CPU no server here pays per length)."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from exporter.metrics import AgentMetrics
from exporter.recorder import Recorder
from warmup_agent.kernel_cache.shared_findings import SharedFindings
from warmup_agent.stages.profile_warmup import (
    EACH_NEW_LENGTH_PAYS,
    SETTLE_PROMPT_TOKENS,
    ProfileWarmup,
    length_skip_reason,
    per_length_line,
    remedy_for,
    settle_prompt_tokens,
)
from warmup_agent.warmup import benefit, findings
from warmup_agent.warmup.benefit import Call


def test_the_line_names_the_first_tokens_only_when_given():
    remedy = remedy_for("transformers")
    line = per_length_line([5.347, 3.186], [2.433, 3.145], remedy)
    assert line == ("the server pays per sequence length: decode at new lengths ran 5.3x, 3.2x its steady time "
                    "per token, and their first tokens came 2.4x, 3.1x its steady first token; remedy: " + remedy)
    assert "first tokens" not in per_length_line([2.6, 2.6], [], remedy)


def scripted_warmup(probe_pairs: list[tuple[Call, Call]], data_dir: str | None = None,
                    model: str = "qwen2-1.5b", redis_url: str | None = None) -> tuple[ProfileWarmup, list[int]]:
    """A ProfileWarmup whose gate probe pairs (StageContext.probe_pair, scripted here)
    answer `probe_pairs` in turn: a first and its control (the same length again).
    `data_dir`: where prewarm.remember_findings keeps its file (None: the key is off).
    Returns it and the prompt lengths of the probes sent, in order."""
    w = object.__new__(ProfileWarmup)
    metrics = AgentMetrics()
    sent: list[int] = []
    script = list(probe_pairs)
    told: list[tuple[int, int]] = []
    remembered: list[dict] = []

    def probe_pair(probe, tokens, replay):
        first, control = script.pop(0)
        sent.extend([first.prompt_tokens, control.prompt_tokens])
        pair = benefit.Controlled(first, control)
        return pair, {**pair.as_dict(), "cold": pair.cold(0.2), "replayed_requests": 0}
    w.ctx = SimpleNamespace(metrics=metrics, recorder=Recorder(metrics), probe_length=probe_pairs[0][0].prompt_tokens,
                            engine=SimpleNamespace(server_name="transformers", capabilities={"model": model}, applied_remedy={}),
                            cfg=SimpleNamespace(data_dir=data_dir, kernel_cache=kernel_cache(redis_url)),
                            host_facts={"gpus": [{"name": "NVIDIA H200"}]},
                            probe_log=SimpleNamespace(restart=lambda: None, pair=lambda a, b: told.append((a, b)),
                                                      remembered_new_length=remembered.append),
                            probe_pair=probe_pair, probe=lambda max_tokens=None: sent.append(w.ctx.probe_length) or w.lone_ttft,
                            first_pairs=[], first_probe_alone=False, driver=SimpleNamespace(warmup_requests=0),
                            let_users_in=None)
    w.pc = SimpleNamespace(per_length_ratio=1.5, per_length_tokens=8, length_ladder=False,
                           remember_findings=data_dir is not None)
    w.tol, w.b0, w.ep0, w.fam0, w.lo, w.hi, w.answer = 0.2, 1, "chat", "sampled", 180, 310, 2
    w.concurrency = 4
    w.replayed, w.decoded, w.settle_tokens = 0, [], SETTLE_PROMPT_TOKENS
    w.stale_finding, w.before_send = False, None
    w.told = told           # (first, control) ProbeLog.pair was told hold the figures
    w.told_new_length = remembered   # what ProbeLog.remembered_new_length was told
    w.lone_ttft = probe_pairs[-1][0].ttft   # what a first probe sent alone takes
    return w, sent


SECRET = "0123456789abcdef0123456789abcdef"


def kernel_cache(redis_url: str | None, secret: str | None = SECRET) -> SimpleNamespace:
    """The kernel_cache section the shared findings read (kernel_cache/shared_findings.py)."""
    return SimpleNamespace(redis_url=redis_url, secret=secret, secret_file=None, key_prefix="warmup:test",
                           socket_timeout_seconds=0.5, ttl_seconds=3600)


def call(ttft_ms: float, tpot_ms: float, prompt: int) -> Call:
    return Call(ttft_ms / 1e3, (ttft_ms + 7 * tpot_ms) / 1e3, 8, prompt)


def test_defaults_run6_logs_decode_and_first_token_costs(caplog):
    # the probes' length (no request reached it), then a second fresh length for the
    # probes, since their first pair was cold
    lengths = [245, 199]
    # the fresh calls as run 6 start 0 measured them (decode 5.3x and 3.2x steady); their
    # controls, the same lengths again, as a warm server answers them (the steady 47.8 ms
    # first token and 35.5 ms per token: bench/results/diag_server_fresh_h200_default_run*.json
    # found no cost in a length seen before)
    steady = [call(47.8, 35.515, n) for n in lengths]
    w, sent = scripted_warmup([(call(150.32, 3.186 * 35.515, lengths[0]), steady[0]),
                               (call(140.0, 3.0 * 35.515, lengths[1]), steady[1])])
    with caplog.at_level(logging.WARNING, logger="warmup_agent.stages.prewarm"):
        per_length = w.per_length_test()
    # the first probe pair was cold: a second at another fresh length, which paid too
    assert sent == [lengths[0], lengths[0], lengths[1], lengths[1]]
    assert [p["first_ttft_ms"] for p in w.ctx.first_pairs] == [150.32, 140.0]
    assert w.ctx.probe_length != lengths[0]
    assert per_length["prefill_pays_each_new_length"] and per_length["lengths"] == [lengths[0], w.ctx.probe_length]
    # each new length pays: the figures stay the second pair's (its first paid no one-time cost)
    assert w.told == []
    assert per_length["pays"] and per_length["prefill_pays"] and per_length["ratios"] == [3.186, 3.0]
    lines = [r.getMessage() for r in caplog.records if "pays per sequence length" in r.getMessage()]
    assert len(lines) == 1
    # first tokens over their controls' 47.8 ms
    assert ", and their first tokens came 3.1x, 2.9x its steady first token; remedy: set TORCH_CUDNN" in lines[0]
    assert w.ctx.metrics.registry.get_sample_value("warmup_per_length_remedy_info",
                                                   {"remedy": per_length["remedy"]}) == 1


def test_a_server_that_does_not_pay_logs_nothing(caplog):
    """tfserve + switch run 8 start 4: decode at new lengths at steady speed; the first
    tokens read 1.28x and 1.25x steady, so prefill_pays, but no line is logged."""
    w, _ = scripted_warmup([(call(39.47, 0.97 * 24.052, 266), call(31.52, 24.052, 266)),
                            (call(39.0, 24.052, 199), call(31.52, 24.052, 199))])
    with caplog.at_level(logging.WARNING, logger="warmup_agent.stages.prewarm"):
        per_length = w.per_length_test()
    assert not per_length["pays"] and per_length["prefill_pays"]
    assert not [r for r in caplog.records if "pays per sequence length" in r.getMessage()]


def test_concurrent_requests_and_their_controls_pay_the_same_so_nothing_is_cold():
    """llama.cpp (issue 40): a fresh length after a longer request pays the slot cost of
    that predecessor, and so does its control (sent after the same): no length cost, and
    one probe pair is enough."""
    w, sent = scripted_warmup([(call(101.0, 3.0, 266), call(99.0, 3.0, 266))])
    per_length = w.per_length_test()
    assert not per_length["pays"] and not per_length["prefill_pays"]
    assert sent == [266, 266] and len(w.ctx.first_pairs) == 1 and w.told == []


def test_what_the_per_length_test_says_about_warming_the_profiles_lengths():
    from warmup_agent.stages.profile_warmup import (
        EACH_NEW_LENGTH_PAYS,
        NEW_LENGTHS_WARM,
        ONE_TIME_COST,
        length_skip_reason,
    )
    assert length_skip_reason({"tested": False}) is None          # not measured: warm them
    assert length_skip_reason({"tested": True, "prefill_pays": False}) == NEW_LENGTHS_WARM
    assert length_skip_reason({"tested": True, "prefill_pays": True, "prefill_pays_each_new_length": False}) == ONE_TIME_COST
    # both probe pairs, each at a length no request had reached, paid in their first tokens
    w, _ = scripted_warmup([(call(60.0, 3.0, 223), call(40.0, 3.0, 223)), (call(62.0, 3.0, 266), call(41.0, 3.0, 266))])
    per_length = w.per_length_test()
    assert per_length["prefill_pays_each_new_length"] and length_skip_reason(per_length) == EACH_NEW_LENGTH_PAYS


def test_a_cold_first_probe_pair_then_a_warm_one_is_a_one_time_cost():
    """H200 llama.cpp (issue 40, run at 50153de): the first probe after the warmup paid
    13-15 ms of server prefill where its control paid 7-8 ms, yet the users' first
    request, at a length no request had reached, came at 0.89-1.11x steady.  A second
    probe pair at another fresh length tells: warm, so the cost was paid once, the
    figures are the last pair's."""
    w, sent = scripted_warmup([(call(60.0, 3.0, 266), call(41.0, 3.0, 266)), (call(42.0, 3.0, 223), call(41.0, 3.0, 223))])
    per_length = w.per_length_test()
    assert len(sent) == 4 and per_length["prefill_pays"]
    assert not per_length["prefill_pays_each_new_length"] and w.told == []
    assert [p["cold"] for p in w.ctx.first_pairs] == [True, False]


def test_one_slow_decode_is_not_a_per_length_cost_until_a_second_fresh_length_pays_too():
    """A first probe pair whose decode ran 3x its control's is cold (StageContext's pair
    says so on TPOT too): a second pair at another fresh length follows, and decoded at
    its control's speed, so decode does not pay per length (one slow pair on shared cores
    is noise as often as not: benefit.pays_per_length needs two)."""
    w, sent = scripted_warmup([(call(45.0, 9.0, 266), call(44.0, 3.0, 266)), (call(42.0, 3.0, 223), call(41.0, 3.0, 223))])
    per_length = w.per_length_test()
    assert sent == [266, 266, 223, 223] and len(per_length["pairs"]) == 2
    assert per_length["ratios"] == [3.0, 1.0] and per_length["pays"] is False
    assert not per_length["prefill_pays"] and not per_length["prefill_pays_each_new_length"]


def test_a_single_warm_pair_says_nothing_pays():
    """A first probe pair that was not cold is the whole test: no second pair, nothing pays."""
    w, sent = scripted_warmup([(call(45.0, 3.0, 266), call(44.0, 3.0, 266))])
    per_length = w.per_length_test()
    assert sent == [266, 266] and per_length["pays"] is False and per_length["ratios"] == [1.0]
    assert not per_length["prefill_pays"] and "anchor_pair" not in per_length


def test_no_second_probe_pair_above_the_profiles_range():
    """A fresh length above the profile's longest prompt may be past what the server
    takes: then the cold first pair stays alone (not each new length) instead."""
    w, sent = scripted_warmup([(call(60.0, 3.0, 266), call(41.0, 3.0, 266)), (call(61.0, 3.0, 223), call(41.0, 3.0, 223))])
    w.lo = w.hi = 266                   # no room inside the range once the first pair's length is used
    per_length = w.per_length_test()
    assert sent == [266, 266] and len(w.ctx.first_pairs) == 1
    assert per_length["prefill_pays"] and not per_length["prefill_pays_each_new_length"]


def gate_after_prewarm(each_new_length_pays: bool) -> list[int]:
    """ready.first_probe_pairs after prewarm's two cold probe pairs (both fresh lengths
    paid in their first tokens), with a scripted probe_pair whose pairs are warm.
    Returns the prompt lengths of the probes the gate sent itself."""
    from warmup_agent.stages.ready import first_probe_pairs
    sent: list[int] = []

    def probe_pair(probe, tokens, replay):
        sent.extend([223, 223])
        return None, {"cold": False, "first_ttft_ms": 41.0, "control_ttft_ms": 41.0}
    cold = {"cold": True, "first_ttft_ms": 40.0, "control_ttft_ms": 29.7}
    ctx = SimpleNamespace(cfg=SimpleNamespace(prewarm=SimpleNamespace(max_calls_per_path=4)),
                          engine=SimpleNamespace(speaks_profile=True), profile=object(), first_probe_tokens=8,
                          first_pairs=[dict(cold), dict(cold)], probe_pair=probe_pair,
                          probe_log=SimpleNamespace(gate_probes=[0.04, 0.03, 0.04, 0.03]),
                          warmup_summary={"per_length": {"prefill_pays_each_new_length": each_new_length_pays}})
    pairs = first_probe_pairs(ctx, lambda n: None, 200)
    assert pairs[:2] == [cold, cold]
    return sent


def test_where_each_new_length_pays_the_gate_sends_no_pair_after_prewarms():
    """H200 llama.cpp (run at 09e7567): both of prewarm's fresh lengths paid 8-12 ms of
    prefill over their controls, and the gate then sent a third pair at the second
    pair's length, warm by then: two probes, 0.1 s before /readyz, that said nothing a
    user meets.  Where the cold pair was a one-time cost instead, the gate goes on."""
    assert gate_after_prewarm(each_new_length_pays=True) == []
    assert gate_after_prewarm(each_new_length_pays=False) == [223, 223]


def test_a_probes_control_follows_the_settle_request_again():
    """The first probe follows the settle request (short); its control would follow the
    first probe instead, and on llama.cpp the next request pays for saving its
    predecessor's slot (H200, run at 544597f: the control paid as much as the first and
    the pair said "not cold" where users met 1.3-1.6x).  So the settle request is re-sent
    before the control, even though it is no harder a predecessor than a probe."""
    from warmup_agent.stages.profile_warmup import SETTLE_PROMPT_TOKENS
    w, _ = scripted_warmup([(call(45.0, 3.0, 266), call(44.0, 3.0, 266))])
    resent: list[list[int]] = []
    w.send_requests = lambda reqs, label: resent.append([r.prompt_tokens for r in reqs])
    w.replays = 0
    w.last = [SimpleNamespace(prompt_tokens=SETTLE_PROMPT_TOKENS)]
    assert w.replay_for(266, 1) is None                 # no harder than the probe
    replay = w.replay_before_probe_control(266, 1)
    assert replay is not None
    replay()
    assert resent == [[SETTLE_PROMPT_TOKENS]] and w.replayed == 1 and w.replays == 1
    w.last = [SimpleNamespace(prompt_tokens=266)]       # the probe's own shape: nothing to re-send
    assert w.replay_before_probe_control(266, 1) is None
    w.last = []
    assert w.replay_before_probe_control(266, 1) is None


def test_a_fresh_length_that_paid_in_prefill_gets_a_ladder_before_the_second():
    """H200 llama.cpp (diag_llamacpp_length_h200_run2.json): a new prompt length paid 6-13
    ms more where no request of a similar length had run, 0-4.5 ms after one request per
    rung of a length ladder.  So where the first fresh length paid in prefill, the ladder
    (rungs up to the profile's longest prompt, one request each, one at a time) and the
    settle request go before the second fresh length, whose first and control then both
    follow the settle request (replayed)."""
    from warmup_agent.stages.profile_warmup import LADDER_FIRST, SETTLE_PROMPT_TOKENS, ladder_lengths
    assert ladder_lengths(310) == [48, 72, 108, 162, 243] and ladder_lengths(47) == []
    w, sent = scripted_warmup([(call(60.0, 3.0, 266), call(41.0, 3.0, 266)), (call(42.0, 3.0, 223), call(41.0, 3.0, 223))])
    w.pc.length_ladder = True
    w.budget, w.concurrency = benefit.Budget(10.0, "test"), 4
    wire: list[tuple[list[int], int]] = []
    replays: list[bool] = []

    def send_requests(reqs, label):
        wire.append(([r.prompt_tokens for r in reqs], reqs[0].max_tokens))
        w.decoded += [(r.prompt_tokens, r.prompt_tokens + r.max_tokens) for r in reqs]
    w.send_requests, w.settled = send_requests, 0
    w.request = lambda path, tokens=None: SimpleNamespace(prompt_tokens=path.prompt_tokens, max_tokens=tokens or 2)
    probe_pair = w.ctx.probe_pair
    w.ctx.probe_pair = lambda probe, tokens, replay: (replays.append(replay), probe_pair(probe, tokens, replay))[1]
    per_length = w.per_length_test()
    # one request per rung (48 up to the profile's longest prompt, 310 here), alone, one
    # output token each, then the settle request; the second fresh length after them
    assert wire == [([n], 1) for n in [48, 72, 108, 162, 243]] + [([SETTLE_PROMPT_TOKENS], 1)]
    assert per_length["ladder"] == [48, 72, 108, 162, 243] and w.settled == 1 and LADDER_FIRST == 48
    assert replays == [True, True] and len(sent) == 4
    # the second fresh length did not pay after the ladder: not each new length
    assert not per_length["prefill_pays_each_new_length"]


def test_no_ladder_where_the_first_fresh_length_paid_only_in_decode():
    w, sent = scripted_warmup([(call(45.0, 9.0, 266), call(44.0, 3.0, 266)), (call(42.0, 3.0, 223), call(41.0, 3.0, 223))])
    w.pc.length_ladder = True
    w.ladder = lambda: (_ for _ in ()).throw(AssertionError("no ladder for a decode-only cost"))
    per_length = w.per_length_test()
    assert per_length["ladder"] == [] and sent == [266, 266, 223, 223]


def test_the_settle_request_is_long_enough_to_take_the_least_recently_used_slot():
    """llama-server gives a request the slot whose prompt it shares more than 0.1 of
    (--slot-prompt-similarity), and a short chat prompt shares the template's opening
    with every slot: a 27-token settle request (0.156 shared) waited 19-23 ms for the
    server to save the last long request's slot (H200 run 9).  So the settle request is
    at least SETTLE_OPENING_SHARE times the opening, and never under 64 tokens."""
    from warmup_agent.stages.profile_warmup import SETTLE_OPENING_SHARE
    assert settle_prompt_tokens(None) == SETTLE_PROMPT_TOKENS == 64
    assert settle_prompt_tokens(SimpleNamespace(opening_tokens=lambda: 5)) == 64
    long_system_prompt = SimpleNamespace(opening_tokens=lambda: 30)
    assert settle_prompt_tokens(long_system_prompt) == 360 and 30 / 360 < 0.1 and SETTLE_OPENING_SHARE == 12


def test_the_template_opening_is_what_every_chat_prompt_begins_with(tmp_path):
    """TextPrompts.opening_tokens: the rendered template before the user's content."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from warmup_agent.engines.text_prompts import TextPrompts
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "user": 2, "system": 3, "be": 4, "brief": 5}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    plain = TextPrompts(tok, "<s> user {{ messages[0]['content'] }} <s> assistant")
    system = TextPrompts(tok, "<s> system be brief <s> user {{ messages[0]['content'] }} <s> assistant")
    assert plain.opening_tokens() == 2 and system.opening_tokens() == 6
    assert TextPrompts(tok, None).opening_tokens() == 0
    rewrites = TextPrompts(tok, "<s> user {{ messages[0]['content'] | upper }} <s> assistant")
    assert rewrites.opening_tokens() == 0          # the content is not found: no opening known


def test_discoverys_request_stands_in_for_the_first_settle_request():
    """Where prewarm sent nothing before the probes, the server's last request was
    discovery's (short, one token, alone): no settle request is sent, and a probe's
    control follows a settle request sent in its place (the replay), as its first
    followed discovery's."""
    w, _ = scripted_warmup([(call(45.0, 3.0, 266), call(44.0, 3.0, 266))])
    wire: list[list[int]] = []

    def send_requests(reqs, label):
        wire.append([r.prompt_tokens for r in reqs])
        w.sent += 1
        w.last = list(reqs)
    w.send_requests, w.sent, w.settled, w.replays, w.last, w.settled_by_discovery = send_requests, 0, 0, 0, [], False
    w.request = lambda path, tokens=None: SimpleNamespace(prompt_tokens=path.prompt_tokens, max_tokens=tokens or 2)
    w.settle_unless_discovery_did()
    assert wire == [] and w.settled == 0 and [r.prompt_tokens for r in w.last] == [SETTLE_PROMPT_TOKENS]
    assert w.settled_by_discovery
    replay = w.replay_before_probe_control(266, 1)
    assert replay is not None
    replay()
    assert wire == [[SETTLE_PROMPT_TOKENS]] and w.replayed == 1
    w.settle_unless_discovery_did()         # something was sent since: a real settle request
    assert wire == [[SETTLE_PROMPT_TOKENS], [SETTLE_PROMPT_TOKENS]] and w.settled == 1


# -- prewarm.remember_findings: the outcome kept for the server's next start (issue 40) -------------

def llamacpp_pairs() -> list[tuple[Call, Call]]:
    """H200 llama.cpp run 14, start 0 (bench/results/gpu_server_llamacpp_h200_issue40_run14.json):
    a first fresh length 56.9 ms against its control's 45.2, a second 46.2 against 35.5;
    decode at steady speed in both."""
    return [(call(56.9, 3.3, 661), call(45.19, 3.3, 661)), (call(46.18, 3.3, 479), call(35.45, 3.3, 479))]


def test_a_server_measured_before_skips_the_second_pair(tmp_path):
    # the first start runs the whole test: two fresh lengths, each paid in prefill
    w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path))
    first = w.per_length_test()
    assert len(sent) == 4 and first["prefill_pays_each_new_length"] and not first["pays"]
    assert "remembered" not in first and w.told_new_length == []
    kept = json.loads((tmp_path / findings.FILENAME).read_text())
    assert [e["prefill_pays_each_new_length"] for e in kept.values()] == [True]
    assert list(kept.values())[0]["about"]["model"] == "qwen2-1.5b"
    # what the second fresh length paid beyond its control (46.18 against 35.45 ms to the
    # first token, the whole answers 69.28 against 58.55 ms) is kept with it
    excess = {"ttft": round(10.73 / 35.45, 4), "total": round(10.73 / 58.55, 4), "first_ttft_seconds": 0.04618}
    assert first[findings.EXCESS] == excess and list(kept.values())[0][findings.EXCESS] == excess
    # the next start of the same server: a pair would say again what the finding says; the
    # first probe goes alone (no control, no second pair), and the record says why
    w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path))
    second = w.per_length_test()
    assert sent == [661] and w.ctx.first_pairs == [] and w.ctx.first_probe_alone
    assert second["prefill_pays_each_new_length"] and second["lengths"] == [661] and second["pairs"] == []
    assert second["remembered"]["control"].startswith("skipped") and not second["pays"]
    assert second["remembered"]["from"] == str(tmp_path / findings.FILENAME)
    assert second["remembered"]["measured_at"] == list(kept.values())[0]["measured_at"]
    assert length_skip_reason(second) == EACH_NEW_LENGTH_PAYS
    # a first pair's excess would hold this start's one-time costs too: the figures are the
    # remembered second length's, and the record says so
    assert w.told_new_length == [{**excess, "measured_at": list(kept.values())[0]["measured_at"]}]
    assert second["remembered"][findings.EXCESS] == excess


def test_a_finding_without_the_new_length_excess_is_measured_again(tmp_path):
    """An entry an older agent wrote (no new_length_excess) cannot give the figures a
    skipped second pair would have measured: both pairs run, and the entry is rewritten."""
    w, _ = scripted_warmup(llamacpp_pairs(), str(tmp_path))
    w.per_length_test()
    path = tmp_path / findings.FILENAME
    kept = json.loads(path.read_text())
    for entry in kept.values():
        del entry[findings.EXCESS]
    path.write_text(json.dumps(kept))
    w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path))
    per_length = w.per_length_test()
    assert len(sent) == 4 and "remembered" not in per_length and w.told_new_length == []
    assert all(findings.EXCESS in e for e in json.loads(path.read_text()).values())
    # a malformed one is not used either
    assert findings.excess_of({findings.EXCESS: {"ttft": "0.3", "total": 0.1}}) is None
    assert findings.excess_of({findings.EXCESS: {"ttft": -0.1, "total": 0.1}}) is None
    assert not findings.skips_second_pair({"prefill_pays_each_new_length": True, "pays": False})


def test_a_finding_the_first_probe_disagrees_with_is_measured_again(tmp_path):
    """A finding measured on a loaded machine (there: a first fresh length at 6.5x its
    control) is measured again when this start's lone first probe takes far less than
    the fresh length took then; one without that time kept is measured again too."""
    for then_ms, now_ms, again in ((46.18, 46.18 * 2.9, False), (46.18, 46.18 * 0.45, True), (None, 46.18, True)):
        w, _ = scripted_warmup(llamacpp_pairs(), str(tmp_path))
        w.per_length_test()
        path = tmp_path / findings.FILENAME
        kept = json.loads(path.read_text())
        for entry in kept.values():
            entry["measured_at"] = "2026-01-01T00:00:00+00:00"
            if then_ms is None:
                del entry[findings.EXCESS][findings.FIRST_TTFT]
        path.write_text(json.dumps(kept))
        w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path))
        w.lone_ttft = now_ms / 1e3
        per_length = w.per_length_test()
        if not again:
            assert sent == [661] and "remembered" in per_length
            continue
        # the lone probe, then both pairs at fresh lengths (not the lone probe's), rewritten
        assert len(sent) == 5 and per_length["lengths"][0] != 661 and "remembered" not in per_length and w.told_new_length == []
        entry = list(json.loads(path.read_text()).values())[0]
        assert entry["measured_at"] != "2026-01-01T00:00:00+00:00"
        assert entry[findings.EXCESS][findings.FIRST_TTFT] == 0.04618
    # where the pair measured again is warm (no second pair), its outcome replaces the finding too
    w, _ = scripted_warmup(llamacpp_pairs(), str(tmp_path))
    w.lone_ttft = 0.001
    w.ctx.probe_pair = lambda probe, tokens, replay: (benefit.Controlled(call(35.5, 3.3, 300), call(35.4, 3.3, 300)),
                                                       {"cold": False, "replayed_requests": 0})
    assert not w.per_length_test()["prefill_pays_each_new_length"]
    assert not findings.skips_second_pair(list(json.loads(path.read_text()).values())[0])


def test_held_users_are_let_in_only_where_the_first_probe_confirms_the_finding(tmp_path):
    """The first start lets held users in after a lone first probe that agrees with the
    finding (Agent.let_users_in), never on the path that measures it again; with no fresh
    length left inside the profile's range the finding is kept rather than probed beyond it."""
    w, _ = scripted_warmup(llamacpp_pairs(), str(tmp_path))
    w.per_length_test()
    wait = object()
    for lone_ms, lo_hi, let_in in ((46.18, (180, 310), True), (46.18 * 0.3, (180, 310), False),
                                   (46.18 * 0.3, (661, 661), True)):
        w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path))
        calls: list[int] = []
        w.ctx.let_users_in = lambda calls=calls: calls.append(1) or wait
        w.lone_ttft, (w.lo, w.hi) = lone_ms / 1e3, lo_hi
        per_length = w.per_length_test()
        assert bool(calls) == let_in and (w.before_send is wait) == let_in, (lone_ms, lo_hi)
        assert ("remembered" in per_length) == let_in and all(n <= 661 for n in per_length["lengths"])


def test_another_model_or_the_key_off_measures_again(tmp_path):
    w, _ = scripted_warmup(llamacpp_pairs(), str(tmp_path))
    w.per_length_test()
    w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path), model="another-model")
    assert "remembered" not in w.per_length_test() and len(sent) == 4
    w, sent = scripted_warmup(llamacpp_pairs(), None)
    assert "remembered" not in w.per_length_test() and len(sent) == 4


def test_a_one_time_cost_remembered_does_not_skip_anything(tmp_path):
    """The second fresh length was warm: the first paid a one-time cost.  Nothing to
    skip on the next start: its first pair may be cold for another reason."""
    one_time = [(call(56.9, 3.3, 661), call(45.19, 3.3, 661)), (call(35.9, 3.3, 479), call(35.45, 3.3, 479))]
    w, _ = scripted_warmup(one_time, str(tmp_path))
    assert not w.per_length_test()["prefill_pays_each_new_length"]
    w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path))
    per_length = w.per_length_test()
    assert len(sent) == 4 and "remembered" not in per_length and per_length["prefill_pays_each_new_length"]
    # ... and that start's whole test replaced the finding
    kept = json.loads((tmp_path / findings.FILENAME).read_text())
    assert [e["prefill_pays_each_new_length"] for e in kept.values()] == [True]


def test_a_start_that_remembers_nothing_to_skip_sends_the_whole_pair(tmp_path):
    """Only a finding that each new length pays sends the first probe alone: with the key
    off, or nothing kept yet, the first pair runs with its control."""
    w, sent = scripted_warmup([(call(45.5, 3.3, 661), call(45.19, 3.3, 661))], str(tmp_path))
    per_length = w.per_length_test()
    assert sent == [661, 661] and not per_length["prefill_pays"] and "remembered" not in per_length
    assert not w.ctx.first_probe_alone and len(w.ctx.first_pairs) == 1


def test_a_first_probe_sent_alone_exports_the_remembered_figures_without_a_steady_level():
    """A gate of the first probe alone has no steady level of its own; its figures are
    1 + the remembered excess all the same, and its own times stay in the record."""
    from warmup_agent.readiness.probes import ProbeLog
    log = ProbeLog()
    log.restart()
    log.add(Call(0.02888, 0.05608, 8, 264))
    log.remembered_new_length({"ttft": 0.2189, "total": 0.0975, "measured_at": "2026-12-04T11:34:13+00:00"})
    fr = log.freeze()
    assert fr.steady_ttft_seconds is None and fr.control is None
    assert fr.ttft_tax == 1.2189 and fr.total_tax == 1.0975 and fr.measured_total_tax is None
    assert fr.ttft_seconds == 0.02888
    # without a remembered excess one probe gives no figures, as before
    log.restart()
    log.add(Call(0.03, 0.05, 8, 264))
    assert log.figures.ttft_tax is None and log.figures.total_tax is None


def test_decode_of_a_first_probe_alone_is_judged_on_its_threshold_only():
    """ready.decode_converged: with no convergence ratio to meet (a first probe sent alone,
    or a pair whose first decoded no slower), min_probes samples under the P90 threshold
    do; with a ratio, two are needed to compare."""
    import math

    from warmup_agent.readiness.verdict import decode_converged
    from warmup_agent.readiness.window import SlidingWindow
    window = SlidingWindow(10)
    window.add(0.004)
    assert decode_converged(window, 1, 0.5, math.inf)
    assert not decode_converged(window, 1, 0.5, 1.5) and not decode_converged(window, 2, 0.5, math.inf)
    assert not decode_converged(window, 1, 0.003, math.inf)      # over the threshold


def test_an_unreadable_findings_file_is_measured_again_and_rewritten(tmp_path, caplog):
    (tmp_path / findings.FILENAME).write_text("{not json")
    w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="warmup_agent.warmup"):
        per_length = w.per_length_test()
    assert len(sent) == 4 and "remembered" not in per_length
    assert any("not readable as the agent's server findings" in r.getMessage() and findings.FILENAME in r.getMessage()
               for r in caplog.records)
    assert [e["prefill_pays_each_new_length"] for e in json.loads((tmp_path / findings.FILENAME).read_text()).values()] \
        == [True]


def test_a_findings_write_that_fails_is_logged_and_leaves_no_temporary_file(tmp_path, caplog):
    (tmp_path / findings.FILENAME).mkdir()          # the rename onto it fails
    with caplog.at_level(logging.WARNING, logger="warmup_agent.warmup"):
        findings.Findings(str(tmp_path)).put("k", {"prefill_pays_each_new_length": True, "pays": False}, {})
    assert any("cannot write the server findings" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in tmp_path.iterdir()) == [findings.FILENAME]


def test_a_gate_that_skipped_the_second_pair_exports_the_remembered_excess():
    """H200 llama.cpp run 20 (bench/results/gpu_server_llamacpp_h200_issue40_run20.json):
    start 0 measured both fresh lengths, the second 28.90 ms against its control's 23.71;
    start 1 remembered that and sent one pair, 28.88 against 19.69 ms, whose first probe
    also paid the start's one-time costs: its own figure read 1.47 where the outside
    client's first request met 0.91x steady.  The gate exports 1 + the remembered excess."""
    from warmup_agent.readiness.probes import ProbeLog
    measured = benefit.Controlled(Call(0.02890, 0.04997, 8, 303), Call(0.02371, 0.04553, 8, 303)).excess()
    assert measured == {"ttft": round(5.19 / 23.71, 4), "total": round(4.44 / 45.53, 4), "first_ttft_seconds": 0.0289}
    log = ProbeLog()
    log.restart()
    for c in (Call(0.02888, 0.05608, 8, 264), Call(0.01969, 0.04123, 8, 264)):
        log.add(c)
    log.pair(0, 1)
    assert round(log.figures.ttft_tax, 3) == round(1 + 9.19 / 19.69, 3)     # the pair's own: 1.467
    log.remembered_new_length({**measured, "measured_at": "2026-12-03T17:20:00+00:00"})
    fr = log.freeze()
    assert fr.ttft_tax == 1 + measured["ttft"] and fr.total_tax == 1 + measured["total"]
    # the probes' own times stay as measured, for the record
    assert fr.ttft_seconds == 0.02888 and round(fr.measured_total_tax, 3) == round(1 + 14.85 / 41.23, 3)
    assert fr.new_length["measured_at"] == "2026-12-03T17:20:00+00:00"
    # a re-warm's gate measures afresh
    log.restart()
    log.add(Call(0.030, 0.05, 8, 264))
    log.add(Call(0.020, 0.04, 8, 264))
    log.pair(0, 1)
    assert log.figures.new_length is None and round(log.figures.ttft_tax, 3) == 1.5


# -- the findings shared by every pod through the kernel cache's Redis ----------------------------

def test_a_new_pod_remembers_what_another_pod_measured_through_redis(tmp_path, redis_server):
    """The chart's data directory is an emptyDir: a new pod's file is empty.  Where the
    kernel cache shares through Redis, the first pod's finding reaches the next pod, whose
    first probe goes alone; the entry is then kept in its own file too."""
    w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path / "pod-a"), redis_url=redis_server.url)
    first = w.per_length_test()
    assert len(sent) == 4 and first["prefill_pays_each_new_length"] and "remembered" not in first
    pod_b = tmp_path / "pod-b"
    w, sent = scripted_warmup(llamacpp_pairs(), str(pod_b), redis_url=redis_server.url)
    second = w.per_length_test()
    assert sent == [661] and w.ctx.first_probe_alone
    assert second["remembered"]["from"] == f"redis 127.0.0.1:{redis_server.port}/0 warmup:test:findings"
    kept = json.loads((pod_b / findings.FILENAME).read_text())
    assert [e[findings.EXCESS] for e in kept.values()] == [second["remembered"][findings.EXCESS]]
    # a pod whose Redis entry cannot be verified (another secret) measures again
    store = findings.Findings(str(tmp_path / "pod-c"), SharedFindings.from_config(
        kernel_cache(redis_server.url, secret="another secret of 32 bytes......")))
    key = next(iter(kept))
    assert store.get(key) is None


def test_redis_trouble_is_a_warning_and_the_pod_measures(tmp_path, caplog):
    """A Redis that refuses: one warning per read or write, never a failed start; without
    a secret nothing is shared at all."""
    from tests.helpers.servers import free_port
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert SharedFindings.from_config(kernel_cache(url, secret=None)) is None
    assert SharedFindings.from_config(kernel_cache(None)) is None
    with caplog.at_level(logging.WARNING, logger="warmup_agent.warmup"):
        w, sent = scripted_warmup(llamacpp_pairs(), str(tmp_path), redis_url=url)
        per_length = w.per_length_test()
    assert len(sent) == 4 and per_length["prefill_pays_each_new_length"]
    lines = [r.getMessage() for r in caplog.records]
    assert any("server findings not read from redis" in m for m in lines)
    assert any("server findings not shared through redis" in m for m in lines)
    # the pod's own file still has it
    assert json.loads((tmp_path / findings.FILENAME).read_text())
