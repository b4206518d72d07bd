"""Warmup by measured benefit (warmup_agent/warmup/benefit.py) and the probe log's
first-request figures (warmup_agent/readiness/probes.py), on their own.

`send` here is a stand-in server written for the test (named as such): each path
pays a cold cost on its first calls and then answers at its steady level, so that
the rules can be checked call by call.  The real servers (vLLM, transformers
serve, llama.cpp's server) run the same code in the slow tests."""
from __future__ import annotations

import pytest

from warmup_agent.warmup import benefit
from warmup_agent.warmup.benefit import Budget, Call, Path, SteadyLevels


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
    # the second call is the first's control: not faster, so the first was not cold
    assert out.result == "warm_on_first_call" and len(out.calls) == 2 and out.reason == benefit.ORDINARY
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


def pair(first_ttft: float, first_tpot: float, control_ttft: float, control_tpot: float, tokens: int = 8,
         first_server: float | None = None, control_server: float | None = None) -> benefit.Controlled:
    return benefit.Controlled(Call(first_ttft, first_ttft + (tokens - 1) * first_tpot, tokens, server_prefill=first_server),
                              Call(control_ttft, control_ttft + (tokens - 1) * control_tpot, tokens,
                                   server_prefill=control_server))


def test_pays_per_length_needs_every_new_length_slower_than_its_control():
    slow = [pair(0.03, 0.09, 0.03, 0.03), pair(0.03, 0.08, 0.03, 0.03)]
    assert benefit.pays_per_length(slow, 1.5) == (True, [3.0, 2.667])
    mixed = [slow[0], pair(0.03, 0.031, 0.03, 0.03)]
    assert benefit.pays_per_length(mixed, 1.5)[0] is False
    one_token = [benefit.Controlled(Call(0.03, 0.03, 1), Call(0.03, 0.03, 1))]
    assert benefit.pays_per_length(one_token, 1.5) == (False, [])
    assert benefit.pays_per_length(slow[:1], 1.5) == (False, [3.0])       # one slow pair alone is not enough


def test_prefill_is_cold_only_beyond_its_control_and_the_server_clock_decides_where_there_is_one():
    assert not benefit.prefill_cold(pair(0.036, 0.003, 0.033, 0.003), 0.2)     # within 10 % + 2 ms
    assert benefit.prefill_cold(pair(0.045, 0.003, 0.033, 0.003), 0.2)
    # llama.cpp: 60 ms in the slot after concurrent requests, the prefill itself at its control's speed
    assert not benefit.prefill_cold(pair(0.095, 0.003, 0.040, 0.003, first_server=0.0090, control_server=0.0088), 0.2)
    assert benefit.prefill_cold(pair(0.040, 0.003, 0.040, 0.003, first_server=0.0187, control_server=0.0088), 0.2)


def test_the_ordinary_cost_a_control_pays_too_is_not_cold():
    """H200 llama.cpp (issue 40): the first probe after four concurrent 490-token warmup
    requests took 91.5 ms where steady was 24.4 ms; a control after the same
    predecessor pays the same slot cost, so the tax is about 1, not 3.75."""
    ordinary = benefit.Controlled(Call(0.0915, 0.0915, 1), Call(0.0890, 0.0890, 1))
    assert not ordinary.cold(0.2)
    assert ordinary.ttft_tax(0.0244) == pytest.approx(1 + 0.0025 / 0.0244)
    noise = benefit.Controlled(Call(0.0240, 0.0240, 1), Call(0.0600, 0.0600, 1))     # a control slower than its first
    assert noise.ttft_tax(0.0244) == 1.0
    cold = benefit.Controlled(Call(0.0915, 0.0915, 1), Call(0.0250, 0.0250, 1))
    assert cold.cold(0.2) and cold.ttft_tax(0.0244) == pytest.approx(1 + 0.0665 / 0.0244)
    slow_decode = benefit.Controlled(Call(0.03, 0.03 + 7 * 0.009, 8), Call(0.03, 0.03 + 7 * 0.003, 8))
    assert slow_decode.cold(0.2) and slow_decode.total_tax(0.051) == pytest.approx(1 + 0.042 / 0.051)


def test_a_control_after_a_replayed_predecessor_decides_whether_the_first_call_was_cold():
    """The first call after a longer predecessor pays 60 ms more; its control is sent
    after the same predecessor (replay) and pays it too: one call, warm."""
    sent: list[str] = []
    after_long = [True]          # the path's first call follows a longer request

    def send(path: Path) -> Call:
        sent.append("path")
        extra = 0.060 if after_long[0] else 0.0
        after_long[0] = False
        return Call(0.030 + extra, 0.030 + extra, 1)

    def replay() -> None:
        sent.append("replay")
        after_long[0] = True
    out = benefit.warm_path(ANCHOR, send, SteadyLevels(), never_ends(), tol=0.2, max_calls=4, replay=replay)
    assert sent == ["path", "replay", "path"] and out.result == "warm_on_first_call"
    # without the replay, the same server looks cold and gets a third call
    sent.clear()
    after_long[0] = True
    out = benefit.warm_path(ANCHOR, send, SteadyLevels(), never_ends(), tol=0.2, max_calls=4)
    assert sent == ["path", "path", "path"] and out.result == "converged"


def test_a_wave_sends_one_call_per_path_at_once_then_their_controls_and_only_cold_paths_go_on():
    a, b, c = (Path("chat", "greedy", 1, 300), Path("completions", "sampled", 1, 300), Path("chat", "sampled", 2, 300))
    waves: list[list[Path]] = []
    cold = {b: [0.200]}                 # b pays 200 ms on its first call only

    def send_wave(paths):
        waves.append(list(paths))
        n = len(waves)
        return [Call(0.050 + (cold.get(p, [0])[0] if n == 1 else 0), 0.06, 2) for p in paths]

    server = StandInServer({})
    outs = benefit.warm_wave([a, b, c], send_wave, server.send, SteadyLevels(), never_ends(), tol=0.2, max_calls=4)
    assert waves == [[a, b, c], [a, b, c]]
    assert [o.result for o in outs] == ["warm_on_first_call", "converged", "warm_on_first_call"]
    assert server.sent == [b, b]                 # only the cold path went on, alone
    assert outs[0].reason == benefit.ORDINARY
