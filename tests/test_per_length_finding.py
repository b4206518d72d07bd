"""The per-length finding's log line names what the user will pay (issue 30).

The per-length test runs here on scripted calls: the times H200 tfserve defaults run 6
(bench/results/gpu_server_tfserve_default_h200_run6.json, start 0) and tfserve + switch
run 8 (start 4) measured, handed to `_ProfileWarmup.per_length_test` by a scripted
`send` instead of a server (the real-server path is tests/test_openai_transformers_serve.py;
on the CPU no server here pays per length)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from exporter.metrics import AgentMetrics
from exporter.recorder import Recorder
from warmup_agent.stages.prewarm import _ProfileWarmup, per_length_line, remedy_for
from warmup_agent.warmup import benefit
from warmup_agent.warmup.benefit import Call, Path


def test_the_line_names_the_first_tokens_only_when_given():
    remedy = remedy_for("transformers serve")
    line = per_length_line([5.347, 3.186], [2.433, 3.145], remedy)
    assert line == ("the server pays per sequence length: decode at new lengths ran 5.3x, 3.2x its steady time "
                    "per token, and their first tokens came 2.4x, 3.1x its steady first token; remedy: " + remedy)
    assert "first tokens" not in per_length_line([2.6, 2.6], [], remedy)


def scripted_warmup(fresh: list[Call], controls: list[Call]) -> tuple[_ProfileWarmup, list[int]]:
    """A _ProfileWarmup whose per-length test gets each `fresh` call and then its control
    (the same length again) in turn: with two, the first pair is the anchor path's first
    call and its control, the second the gate's first probe pair (StageContext.probe_pair,
    scripted here); with one, the probe pair alone (no anchor pair).  Returns it and the
    prompt lengths of the probe pair, in order."""
    w = object.__new__(_ProfileWarmup)
    metrics = AgentMetrics()
    sent: list[int] = []
    pairs = list(zip(fresh, controls, strict=True))
    probe_first, probe_control = pairs[-1]

    def probe_pair(probe, tokens, replay, figures=True):
        sent.extend([probe_first.prompt_tokens, probe_control.prompt_tokens])
        pair = benefit.Controlled(probe_first, probe_control)
        return pair, {**pair.as_dict(), "cold": pair.cold(0.2), "replayed_requests": 0}
    w.ctx = SimpleNamespace(metrics=metrics, recorder=Recorder(metrics), probe_length=probe_first.prompt_tokens,
                            engine=SimpleNamespace(server_name="transformers serve"),
                            probe_log=SimpleNamespace(restart=lambda: None), probe_pair=probe_pair,
                            probe=lambda max_tokens=None: None, first_pair=None,
                            driver=SimpleNamespace(warmup_requests=0))
    w.pc = SimpleNamespace(per_length_ratio=1.5, per_length_tokens=8)
    w.tol, w.b0, w.ep0, w.fam0, w.lo, w.hi, w.answer = 0.2, 1, "chat", "sampled", 180, 310, 2
    w.replayed = 0
    w.anchor = (benefit.Outcome(Path("chat", "sampled", 1, pairs[0][0].prompt_tokens), "converged",
                                calls=list(pairs[0])) if len(pairs) == 2 else None)
    return w, sent


def call(ttft_ms: float, tpot_ms: float, prompt: int) -> Call:
    return Call(ttft_ms / 1e3, (ttft_ms + 7 * tpot_ms) / 1e3, 8, prompt)


def test_defaults_run6_logs_decode_and_first_token_costs(caplog):
    fresh_lengths = [310, 245]      # the anchor's length, then the probes' (a length no request reached)
    # the fresh calls as run 6 start 0 measured them (decode 5.3x and 3.2x steady); their
    # controls, the same lengths again, as a warm server answers them (the steady 47.8 ms
    # first token and 35.5 ms per token: bench/results/diag_server_fresh_h200_default_run*.json
    # found no cost in a length seen before)
    w, sent = scripted_warmup([call(116.29, 5.347 * 35.515, fresh_lengths[0]), call(150.32, 3.186 * 35.515, fresh_lengths[1])],
                              [call(47.8, 35.515, fresh_lengths[0]), call(47.8, 35.515, fresh_lengths[1])])
    with caplog.at_level(logging.WARNING, logger="warmup_agent.stages.prewarm"):
        per_length = w.per_length_test()
    assert sent == [fresh_lengths[1], fresh_lengths[1]]        # the probe pair: a first and its control
    assert w.ctx.first_pair is not None and w.ctx.first_pair["first_ttft_ms"] == 150.32
    assert per_length["prefill_pays_each_new_length"]
    assert per_length["pays"] and per_length["prefill_pays"]
    lines = [r.getMessage() for r in caplog.records if "pays per sequence length" in r.getMessage()]
    assert len(lines) == 1
    # first tokens over their controls' 47.8 ms
    assert ", and their first tokens came 2.4x, 3.1x its steady first token; remedy: set TORCH_CUDNN" in lines[0]
    assert w.ctx.metrics.registry.get_sample_value("warmup_per_length_remedy_info",
                                                   {"remedy": per_length["remedy"]}) == 1


def test_a_server_that_does_not_pay_logs_nothing(caplog):
    """tfserve + switch run 8 start 4: decode at new lengths at steady speed; the first
    tokens read 1.28x and 1.25x steady, so prefill_pays, but no line is logged."""
    w, _ = scripted_warmup([call(40.44, 1.067 * 24.052, 223), call(39.47, 0.97 * 24.052, 266)],
                           [call(31.52, 24.052, 223), call(31.52, 24.052, 266)])
    with caplog.at_level(logging.WARNING, logger="warmup_agent.stages.prewarm"):
        per_length = w.per_length_test()
    assert not per_length["pays"] and per_length["prefill_pays"]
    assert not [r for r in caplog.records if "pays per sequence length" in r.getMessage()]


def test_concurrent_requests_and_their_controls_pay_the_same_so_nothing_is_cold():
    """llama.cpp (issue 40): a fresh length after a longer request pays the slot cost of
    that predecessor, and so does its control (sent after the same): no length cost."""
    w, _ = scripted_warmup([call(95.0, 3.0, 223), call(101.0, 3.0, 266)], [call(93.0, 3.0, 223), call(99.0, 3.0, 266)])
    per_length = w.per_length_test()
    assert not per_length["pays"] and not per_length["prefill_pays"]


def test_what_the_per_length_test_says_about_warming_the_profiles_lengths():
    from warmup_agent.stages.prewarm import EACH_NEW_LENGTH_PAYS, NEW_LENGTHS_WARM, ONE_TIME_COST, length_skip_reason
    assert length_skip_reason({"tested": False}) is None          # not measured: warm them
    assert length_skip_reason({"tested": True, "prefill_pays": False}) == NEW_LENGTHS_WARM
    assert length_skip_reason({"tested": True, "prefill_pays": True, "prefill_pays_each_new_length": False}) == ONE_TIME_COST
    # H200 llama.cpp (seed 170679385): each profile length's first call 72-95 ms, 46-62 ms
    # after; the user's first request at a length none of them had was 1.32x steady anyway
    w, _ = scripted_warmup([call(60.0, 3.0, 223), call(62.0, 3.0, 266)], [call(40.0, 3.0, 223), call(41.0, 3.0, 266)])
    per_length = w.per_length_test()
    assert per_length["prefill_pays_each_new_length"] and length_skip_reason(per_length) == EACH_NEW_LENGTH_PAYS


def test_the_anchors_first_call_and_its_control_are_the_first_pair():
    """The anchor was a length no request had reached: its first call and its control
    are a fresh length's pair, and the gate's first probe pair, at another length no
    request reached, is the second: the per-length test sends nothing of its own."""
    w, sent = scripted_warmup([call(90.0, 9.0, 310), call(60.0, 3.0, 266)], [call(45.0, 3.0, 310), call(41.0, 3.0, 266)])
    per_length = w.per_length_test()
    assert sent == [266, 266]            # the probes: a first and its control
    assert per_length["anchor_pair"] and per_length["probe_pair"] and len(per_length["pairs"]) == 2
    assert per_length["pairs"][0]["first_ttft_ms"] == 90.0 and per_length["pairs"][0]["control_ttft_ms"] == 45.0
    assert per_length["pays"] is False                      # decode 3x at the anchor, 1x at the fresh length
    assert per_length["prefill_pays"] and per_length["prefill_pays_each_new_length"]


def test_without_an_anchor_pair_one_cold_probe_pair_is_not_each_new_length():
    """One pair cannot tell a one-time cost from one that each new length pays."""
    w, _ = scripted_warmup([call(60.0, 3.0, 266)], [call(41.0, 3.0, 266)])
    per_length = w.per_length_test()
    assert not per_length["anchor_pair"] and per_length["prefill_pays"]
    assert not per_length["prefill_pays_each_new_length"]
