"""The first user's whole answer on a server that pays per decode length
(warmup_agent/readiness/cold_decode.py), with the H200 figures it was built from.

H200 bench run 3 (bench/results/gpu_server_tfserve_default_h200_run3.json,
transformers serve with its defaults), start 0: the agent's warmup requests, its
first probe (263 tokens, 48 out) and the outside user's first request (243
tokens, 48 out), whose streamed tokens came 58-72 ms apart for the first 20 and
21-30 ms after: the 20 sequence lengths below the probe's that nothing had
decoded.  All four starts show the same 20."""
from __future__ import annotations

import json
from pathlib import Path as FsPath

import pytest

from warmup_agent.readiness import cold_decode
from warmup_agent.readiness.probes import FirstRequest, Probe, ProbeLog

RESULTS = FsPath(__file__).resolve().parent.parent / "bench" / "results"

# Run 3 start 0's warmup, as prewarm sent it: the anchor (310, 3 calls of 8 tokens),
# the per-length test (223 and 266, 8 tokens), the profile's lengths at 1 token
# (prefill only, 2 calls each), decode coverage's one tile before the budget ran out
# (180, 48 tokens).
WARMUP = ([(310, 318)] * 3 + [(223, 231), (266, 274)]
          + [(n, n + 1) for n in (290, 262, 230, 205, 180) for _ in range(2)] + [(180, 228)])
PROFILE = [180, 205, 230, 262, 290, 310]
PROBES = [(263, 311)] + [(263, 271)] * 3          # the first probe 48 tokens, the later ones 8
STEADY_TTFT, STEADY_TPOT = 0.02938, 0.02467       # its per-length test and probe window
STEADY_TOTAL = STEADY_TTFT + 47 * STEADY_TPOT
# the first probe as the agent measured it: 2.0x steady first token, 2.32x whole answer
FIRST = FirstRequest(2.0 * STEADY_TTFT, 2.32 * STEADY_TOTAL, 48, 263, STEADY_TTFT, STEADY_TOTAL)


def test_the_users_cold_steps_are_the_ones_the_h200_user_met_slowly():
    run = json.loads((RESULTS / "gpu_server_tfserve_default_h200_run3.json").read_text())
    seen = cold_decode.reached(WARMUP + PROBES)
    for agent in run["runs"]["agent"]:
        first = agent["first"]
        slow = [g for g in first["gaps_ms"] if g > 40]
        assert agent["probe_prompt_tokens"] == 263 and first["prompt_tokens"] == 243
        assert len(slow) == cold_decode.unreached(243, first["output_tokens"], seen) == 20
        assert first["gaps_ms"][:20] == slow      # the first 20 steps, then warm


def test_the_prediction_meets_what_the_user_saw_where_the_probes_own_figure_did_not():
    predicted = cold_decode.first_answer(FIRST, 263, WARMUP, PROBES, PROFILE)
    assert predicted is not None
    assert predicted["probe_unreached_steps"] == 40                # 264..310 less the per-length test's 267..273
    assert predicted["unreached_steps"] == {180: 0, 205: 22, 230: 33, 262: 1, 290: 20, 310: 40}
    assert predicted["worst_prompt_tokens"] == 310 and predicted["worst_unreached_steps"] == 40
    extra = (FIRST.total_seconds - FIRST.ttft_seconds) - (STEADY_TOTAL - STEADY_TTFT)
    assert predicted["step_cost_ms"] == pytest.approx(extra / 40 * 1e3, abs=1e-3)
    mean = (22 + 33 + 1 + 20 + 40) / 6
    assert predicted["total_tax"] == pytest.approx(
        (STEADY_TOTAL + STEADY_TTFT + extra / 40 * mean) / STEADY_TOTAL, rel=1e-9)
    outside = run3_outside_total_tax()
    assert abs(predicted["total_tax"] / outside - 1) <= 0.25        # issue 30: within 25 %
    assert abs(FIRST.measured_total_tax / outside - 1) > 0.25       # the probe's own figure was not


def run3_outside_total_tax() -> float:
    run = json.loads((RESULTS / "gpu_server_tfserve_default_h200_run3.json").read_text())
    return run["runs"]["agent"][0]["total_tax"]


def test_no_prediction_where_nothing_says_how_much_a_step_costs():
    # every step of the probe already reached by the warmup: no cost per step to measure
    assert cold_decode.first_answer(FIRST, 263, WARMUP + [(263, 311)], PROBES, PROFILE) is None
    # a probe that decoded no slower than steady
    quick = FirstRequest(STEADY_TTFT, STEADY_TOTAL, 48, 263, STEADY_TTFT, STEADY_TOTAL)
    assert cold_decode.first_answer(quick, 263, WARMUP, PROBES, PROFILE) is None
    # a one-token probe, no steady level, no profile lengths
    assert cold_decode.first_answer(FirstRequest(0.05, 0.05, 1, 263, 0.03, 0.03), 263, WARMUP, PROBES, PROFILE) is None
    assert cold_decode.first_answer(FirstRequest(0.05, 1.0, 48, 263, None, None), 263, WARMUP, PROBES, PROFILE) is None
    assert cold_decode.first_answer(FIRST, 263, WARMUP, PROBES, []) is None


def test_a_decode_step_is_counted_at_the_length_it_attends_over():
    assert list(cold_decode.steps(10, 4)) == [11, 12, 13]            # tokens 2..4; the first came from the prefill
    assert list(cold_decode.steps(10, 1)) == []                       # prefill only
    assert cold_decode.reached([(10, 14), (20, 21)]) == {11, 12, 13}


def test_the_probe_log_exports_the_prediction_and_keeps_the_probes_own_figure():
    log = ProbeLog()
    probes = [Probe(FIRST.ttft_seconds, FIRST.total_seconds, 48, 263)] + [
        Probe(STEADY_TTFT, STEADY_TTFT + 7 * STEADY_TPOT, 8, 263)] * 3

    def predict(fr: FirstRequest, gate: list[Probe]) -> dict | None:
        return cold_decode.first_answer(fr, 263, WARMUP, [(263, 263 + p.output_tokens) for p in gate], PROFILE)
    for p in probes:
        log.add(p)
    figures = log.freeze(predict)
    assert figures is not None and figures.cold_decode is not None
    assert figures.measured_total_tax == pytest.approx(2.32, rel=1e-9)
    assert figures.total_tax == figures.cold_decode["total_tax"] < figures.measured_total_tax
    assert log.figures is figures
    # without a prediction (a server that does not pay per length) the probe's figure is exported
    plain = ProbeLog()
    for p in probes:
        plain.add(p)
    assert plain.freeze().total_tax == pytest.approx(2.32, rel=1e-9)
