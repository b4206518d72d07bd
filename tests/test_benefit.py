"""Warmup by measured benefit (warmup_agent/benefit.py) and the probe log's
first-request figures (warmup_agent/probes.py), on their own.

`send` here is a stand-in server written for the test (named as such): each path
pays a cold cost on its first calls and then answers at its steady level, so that
the rules can be checked call by call.  The real servers (vLLM, transformers
serve, llama.cpp's server) run the same code in the slow tests."""
from __future__ import annotations

import pytest

from warmup_agent import benefit
from warmup_agent.benefit import Budget, Call, Path, SteadyLevels
from warmup_agent.probes import Probe, ProbeLog, first_request


class StandInServer:
    """Not a server: a table of what each path's n-th call costs."""

    def __init__(self, cold_calls: dict[Path, list[float]], steady_ttft=0.030, tpot=0.003, tokens=8):
        self.cold_calls, self.steady_ttft, self.tpot, self.tokens = cold_calls, steady_ttft, tpot, tokens
        self.sent: list[Path] = []

    def send(self, path: Path) -> Call:
        n = sum(1 for p in self.sent if p == path)
        self.sent.append(path)
        extra = self.cold_calls.get(path, [])
        cold = extra[n] if n < len(extra) else 0.0
        ttft = self.steady_ttft + cold
        return Call(ttft, ttft + (self.tokens - 1) * self.tpot, self.tokens, path.prompt_tokens)


def never_ends() -> Budget:
    return Budget(0, "no budget")


ANCHOR = Path("chat", "sampled", 1, 300)


def test_a_cold_path_is_sent_until_it_stops_getting_faster():
    server = StandInServer({ANCHOR: [0.200, 0.050]})        # 230 ms, 80 ms, then 30 ms, 30 ms
    out = benefit.warm_path(ANCHOR, server.send, SteadyLevels(), never_ends(), tol=0.2, max_calls=6)
    assert out.result == "converged"
    assert [round(c.ttft, 3) for c in out.calls] == [0.23, 0.08, 0.03, 0.03]


def test_a_path_that_matches_steady_on_its_first_call_gets_no_second_call():
    steady = SteadyLevels()
    server = StandInServer({})
    benefit.warm_path(ANCHOR, server.send, steady, never_ends(), tol=0.2, max_calls=4)
    shorter = Path("chat", "sampled", 1, 200)
    out = benefit.warm_path(shorter, server.send, steady, never_ends(), tol=0.2, max_calls=4)
    assert out.result == "warm_on_first_call" and len(out.calls) == 1


def test_a_cold_first_call_on_a_new_length_is_not_taken_for_warm():
    steady = SteadyLevels()
    shorter = Path("chat", "sampled", 1, 200)
    server = StandInServer({shorter: [0.090]})
    benefit.warm_path(ANCHOR, server.send, steady, never_ends(), tol=0.2, max_calls=4)
    out = benefit.warm_path(shorter, server.send, steady, never_ends(), tol=0.2, max_calls=4)
    assert out.result == "converged" and len(out.calls) == 2


def test_slower_decode_alone_makes_the_first_call_cold():
    steady = SteadyLevels()
    steady.add(ANCHOR, Call(0.030, 0.030 + 7 * 0.003, 8))
    slow_decode = Call(0.030, 0.030 + 7 * 0.009, 8)
    assert not steady.matches(Path("chat", "greedy", 1, 300), slow_decode, 0.2)
    assert steady.matches(Path("chat", "greedy", 1, 300), Call(0.031, 0.031 + 7 * 0.0031, 8), 0.2)


def test_the_reference_of_a_longer_length_is_scaled_up_and_a_batch_has_its_own():
    steady = SteadyLevels()
    steady.add(Path("chat", "sampled", 1, 100), Call(0.020, 0.020, 1))
    assert steady.ttft_ref(1, 50) == pytest.approx(0.020)       # a longer prompt bounds a shorter one
    assert steady.ttft_ref(1, 200) == pytest.approx(0.040)      # above every known length: scaled
    assert steady.ttft_ref(2, 100) is None                      # another batch size: nothing known


def test_a_noise_spike_on_the_last_call_does_not_become_the_steady_level():
    """24 ms, then 377 ms (another process took the cores): "stopped getting faster",
    but the steady level other paths are judged against is the 24 ms one."""
    steady = SteadyLevels()
    server = StandInServer({ANCHOR: [-0.006, 0.347]})          # 24 ms, then 377 ms
    out = benefit.warm_path(ANCHOR, server.send, steady, never_ends(), tol=0.2, max_calls=4)
    assert out.result == "converged" and len(out.calls) == 2
    assert steady.ttft_ref(1, 300) == pytest.approx(0.024)


def test_max_calls_ends_a_path_that_keeps_getting_faster():
    server = StandInServer({ANCHOR: [0.8, 0.4, 0.2, 0.1]})
    out = benefit.warm_path(ANCHOR, server.send, SteadyLevels(), never_ends(), tol=0.2, max_calls=3)
    assert out.result == "still_improving" and len(out.calls) == 3 and "max_calls_per_path" in out.reason


def test_an_exhausted_budget_skips_the_path_with_the_reason():
    t = [0.0]
    budget = Budget(1.0, "test", clock=lambda: t[0])
    t[0] = 1.5
    server = StandInServer({})
    out = benefit.warm_path(ANCHOR, server.send, SteadyLevels(), budget, tol=0.2, max_calls=4)
    assert out.result == "skipped" and out.reason == "budget" and server.sent == []


def test_the_budget_follows_the_server_start_up():
    assert benefit.budget_for(20.0, 0.3, 1.0, 0.0)[0] == pytest.approx(6.0)
    assert benefit.budget_for(1.4, 0.3, 1.0, 0.0)[0] == pytest.approx(1.0)      # the floor
    assert benefit.budget_for(None, 0.3, 1.0, 0.0)[0] == pytest.approx(30.0)    # server already running
    seconds, why = benefit.budget_for(20.0, 0.3, 1.0, 7.0)
    assert seconds == 7.0 and why == "prewarm.budget_seconds"


def test_fresh_lengths_avoid_every_decoded_range():
    used = [(300, 308), (16, 17)]
    picks = benefit.fresh_lengths(180, 310, used, 2, 8)
    assert len(picks) == 2
    for n in picks:
        assert all(n + 8 < a or n > b for a, b in used)
    assert abs(picks[0] - picks[1]) > 8
    # no room inside the range: above it
    assert all(n > 20 for n in benefit.fresh_lengths(10, 12, [(10, 20)], 2, 8))


def test_pays_per_length_needs_every_new_length_slower():
    steady_tpot = 0.030
    slow = [Call(0.03, 0.03 + 7 * 0.09, 8), Call(0.03, 0.03 + 7 * 0.08, 8)]
    assert benefit.pays_per_length(slow, steady_tpot, 1.5) == (True, [3.0, 2.667])
    mixed = [slow[0], Call(0.03, 0.03 + 7 * 0.031, 8)]
    assert benefit.pays_per_length(mixed, steady_tpot, 1.5)[0] is False
    assert benefit.pays_per_length(slow, None, 1.5) == (False, [])


def test_prefill_is_warm_only_when_every_fresh_length_matches_the_anchor():
    steady = SteadyLevels()
    steady.add(Path("chat", "sampled", 1, 310), Call(0.033, 0.033 + 7 * 0.0033, 8))
    warm = [(223, Call(0.030, 0.06, 8)), (266, Call(0.036, 0.07, 8))]      # within 20 % + 2 ms of 33 ms
    assert benefit.prefill_warm(warm, steady, 1, 0.2)
    cold = [warm[0], (266, Call(0.045, 0.08, 8))]                           # 45 ms > 38.3 ms: a new length costs
    assert not benefit.prefill_warm(cold, steady, 1, 0.2)
    # llama.cpp on the H200: 41.2 ms against an anchor of 33.6 ms is inside 20 % + 2 ms
    # (42.3 ms) but not inside half of it (39.0 ms): the user's first request paid 1.32x
    llama = SteadyLevels()
    llama.add(Path("chat", "sampled", 1, 310), Call(0.0336, 0.0336 + 7 * 0.0033, 8))
    assert not benefit.prefill_warm([(223, Call(0.04117, 0.07, 8)), (266, Call(0.04027, 0.07, 8))], llama, 1, 0.2)
    assert not benefit.prefill_warm([], steady, 1, 0.2)                     # not measured: not warm
    assert not benefit.prefill_warm(warm, steady, 2, 0.2)                   # no steady level at batch 2


def test_the_servers_own_prefill_clock_decides_where_it_reports_one():
    """H200 llama.cpp run 7, start 0: fresh lengths' first tokens 30.1 and 31.9 ms against
    the anchor's 27.7 ms are inside tol / 2 + 2 ms, but the server's own prefill says a
    new length costs (the user's first request then prefilled in 16.1 ms against 8.7 ms)."""
    steady = SteadyLevels()
    steady.add(Path("chat", "sampled", 1, 310), Call(0.0277, 0.0277 + 47 * 0.003, 48, 310, server_prefill=0.0087))
    assert steady.prefill_ref(1, 223) == pytest.approx(0.0087) and steady.prefill_ref(2, 223) is None
    client_only = [(223, Call(0.03013, 0.18, 48, 223)), (266, Call(0.03189, 0.18, 48, 266))]
    assert benefit.prefill_warm(client_only, steady, 1, 0.2)                # the client's clock alone: "warm"
    cold = [(223, Call(0.03013, 0.18, 48, 223, server_prefill=0.0161)), (266, Call(0.03189, 0.18, 48, 266, server_prefill=0.0158))]
    assert not benefit.prefill_warm(cold, steady, 1, 0.2)
    # and the other way: a noisy client first token, while the server prefilled at its steady speed
    # (the reference is the anchor's 8.7 ms scaled to each length: 6.26 ms at 223, 7.47 ms at 266)
    warm = [(223, Call(0.045, 0.2, 48, 223, server_prefill=0.0066)), (266, Call(0.050, 0.2, 48, 266, server_prefill=0.0079))]
    assert benefit.prefill_warm(warm, steady, 1, 0.2)
    # 7.47 ms x 1.1 + 0.5 ms = 8.71 ms at 266: just over it pays
    assert benefit.prefill_warm([(266, Call(0.028, 0.2, 48, 266, server_prefill=0.0086))], steady, 1, 0.2)
    assert not benefit.prefill_warm([(266, Call(0.028, 0.2, 48, 266, server_prefill=0.0088))], steady, 1, 0.2)


def test_the_servers_prefill_reference_scales_down_to_a_shorter_fresh_length():
    """H200 llama.cpp run 9, start 2: the anchor at 310 tokens read 17.69 ms steady on the
    server; fresh lengths 223 and 266 read 14.88 and 16.25 ms, under the anchor's time but
    over its time scaled to their length (12.7 and 15.2 ms). The old upper-bound reference
    called them warm, the lengths were skipped, and the user's first request paid 1.95x."""
    steady = SteadyLevels()
    steady.add(Path("chat", "sampled", 1, 310), Call(0.03, 0.03 + 47 * 0.003, 48, 310, server_prefill=0.01769))
    assert steady.prefill_ref_at(1, 223) == pytest.approx(0.01769 * 223 / 310)
    assert steady.prefill_ref_at(1, 400) == pytest.approx(0.01769 * 400 / 310)
    tested = [(223, Call(0.033, 0.18, 48, 223, server_prefill=0.014878)), (266, Call(0.034, 0.18, 48, 266, server_prefill=0.016252))]
    assert not benefit.prefill_warm(tested, steady, 1, 0.2)


def test_a_batch_reports_a_server_prefill_only_when_every_request_has_one():
    from warmup_agent.engines.base import RequestResult
    both = [RequestResult(0.03, 0.1, 20, 4, 0.008), RequestResult(0.031, 0.12, 20, 4, 0.009)]
    assert benefit.call_of(both).server_prefill == pytest.approx(0.009)
    assert benefit.call_of([both[0], RequestResult(0.03, 0.1, 20, 4)]).server_prefill is None


# --- the probe log ---------------------------------------------------------------------
def test_first_request_figures_against_later_probes_of_the_same_length():
    probes = [Probe(0.060, 0.060 + 47 * 0.004, 48, 262),        # first: the profile's longest answer
              Probe(0.030, 0.030 + 7 * 0.003, 8, 262), Probe(0.032, 0.032 + 7 * 0.003, 8, 262)]
    fr = first_request(probes)
    assert fr is not None
    assert fr.ttft_tax == pytest.approx(0.060 / 0.031)
    # steady whole answer of 48 tokens: steady TTFT + 47 x steady time per token
    assert fr.steady_total_seconds == pytest.approx(0.031 + 47 * 0.003)
    assert fr.total_tax == pytest.approx((0.060 + 47 * 0.004) / (0.031 + 47 * 0.003))


def test_same_length_answers_compare_whole_answers_directly():
    probes = [Probe(0.02, 0.02, 1), Probe(0.01, 0.01, 1), Probe(0.03, 0.03, 1)]
    fr = first_request(probes)
    assert fr is not None and fr.ttft_tax == pytest.approx(1.0) and fr.total_tax == pytest.approx(1.0)


def test_one_probe_has_no_tax_and_no_probe_no_figures():
    fr = first_request([Probe(0.02, 0.05, 4)])
    assert fr is not None and fr.ttft_tax is None and fr.total_tax is None
    assert first_request([]) is None


def test_the_figures_freeze_when_the_gate_opens():
    log = ProbeLog()
    for p in (Probe(0.05, 0.05, 1), Probe(0.01, 0.01, 1), Probe(0.01, 0.01, 1)):
        log.add(p)
    frozen = log.freeze()
    log.add(Probe(0.5, 0.5, 1))          # a slow probe after SERVING
    assert log.figures == frozen and len(log.gate_probes) == 3 and len(log.ttfts) == 4
    log.restart()                        # a re-warm: the next probe is a first request again
    assert log.figures is None and len(log.ttfts) == 4
    log.add(Probe(0.2, 0.2, 1))
    log.add(Probe(0.1, 0.1, 1))
    fr = log.figures
    assert fr is not None and fr.ttft_seconds == 0.2 and fr.ttft_tax == pytest.approx(2.0)
