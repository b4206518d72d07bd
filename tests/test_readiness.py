"""Readiness building blocks, each against an independent computation:
exact window quantiles vs numpy, the time-bounded window, dual and adaptive
thresholds, the breaker's steps on a hand-moved clock, the water level vs a
direct evaluation of the seed's formula."""
import math
import random

import numpy as np
import pytest

from warmup_agent.readiness.breaker import Breaker, BreakerState
from warmup_agent.readiness.thresholds import Thresholds
from warmup_agent.readiness.verdict import DecodeTest, judge
from warmup_agent.readiness.waterlevel import WaterLevel
from warmup_agent.readiness.window import SlidingWindow, nearest_rank


class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def _distributions(rng):
    n = 5000
    return {
        "uniform": rng.uniform(0.005, 0.5, n),
        "lognormal": rng.lognormal(mean=math.log(0.03), sigma=0.8, size=n),
        # a warm mode and a cold-start mode, 85/15
        "bimodal": np.where(rng.random(n) < 0.85, rng.normal(0.02, 0.003, n), rng.normal(0.6, 0.1, n)).clip(1e-4),
        "ties": rng.integers(1, 6, n) / 100.0,
    }


@pytest.mark.parametrize("size", [1, 7, 100, 1000])
def test_window_quantiles_are_exact_against_numpy_over_a_sliding_stream(size):
    rng = np.random.default_rng(size)
    for name, values in _distributions(rng).items():
        w = SlidingWindow(size)
        for i, v in enumerate(values):
            w.add(float(v))
            if i % 97 == 0 or i == len(values) - 1:
                tail = values[max(0, i + 1 - size): i + 1]
                got = w.quantiles((0.5, 0.9, 0.99))
                for q in (0.5, 0.9, 0.99):
                    want = float(np.quantile(tail, q, method="inverted_cdf"))
                    assert got[q] == want, (name, size, i, q)   # exact: relative error 0


def test_nearest_rank_definition_on_a_small_case():
    vals = sorted([5.0, 1.0, 4.0, 2.0, 3.0])
    assert [nearest_rank(vals, q) for q in (0.0, 0.2, 0.21, 0.5, 0.9, 1.0)] == [1.0, 1.0, 2.0, 3.0, 5.0, 5.0]
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)


def test_time_bounded_window_keeps_only_the_last_t_seconds():
    clock = Clock()
    w = SlidingWindow(100, max_age_seconds=10, clock=clock)
    for i in range(30):       # one sample per second, value = its second
        w.add(float(i))
        clock.now += 1
    # now = 1030; samples stamped 1020..1029 are within 10 s
    assert w.values() == [float(i) for i in range(20, 30)]
    assert len(w) == 10
    assert w.quantile(0.5) == nearest_rank([float(i) for i in range(20, 30)], 0.5)
    clock.now += 100
    assert len(w) == 0 and w.quantile(0.9) is None and w.quantiles() == {}
    w.add(1.0)
    w.clear()
    assert len(w) == 0


def test_count_bound_still_applies_with_a_time_bound():
    clock = Clock()
    w = SlidingWindow(5, max_age_seconds=1000, clock=clock)
    for i in range(12):
        w.add(float(i))
    assert w.values() == [7.0, 8.0, 9.0, 10.0, 11.0]


def test_dual_thresholds_need_min_samples_and_both_percentiles():
    t = Thresholds(0.85, 2.1, min_samples=10)
    w = SlidingWindow(100)
    for _ in range(9):
        w.add(0.1)
    assert not judge(w, t, 10).open      # 9 < 10 samples
    w.add(0.1)
    assert judge(w, t, 10).open
    for _ in range(2):
        w.add(2.5)                      # 2 of 12 over P90 threshold: P90 rank 11 -> 2.5
    assert judge(w, t, 10).reason == "readiness_thresholds_not_met"
    w2 = SlidingWindow(10)
    for _ in range(10):
        w2.add(0.9)                     # P50 0.9 > 0.85 while P90 is fine
    assert not judge(w2, t, 10).open
    with pytest.raises(ValueError):
        Thresholds(2.0, 1.0)


def test_adaptive_thresholds_refit_every_k_samples_within_bounds():
    t = Thresholds(0.85, 2.1, min_samples=5, adaptive=True, every=20, margin=1.5, floor=0.01)
    w = SlidingWindow(50)
    rng = random.Random(3)
    refits = 0
    for i in range(1, 101):
        w.add(rng.uniform(0.02, 0.04))
        if t.sample_added(w):
            refits += 1
            assert i % 20 == 0
            q = w.quantiles((0.5, 0.9))
            assert t.p50 == pytest.approx(1.5 * q[0.5]) and t.p90 == pytest.approx(1.5 * q[0.9])
    assert refits == t.refits == 5
    # slow traffic: the re-fit is clamped at the configured ceiling, never above
    for _ in range(60):
        w.add(5.0)
        t.sample_added(w)
    assert (t.p50, t.p90) == (0.85, 2.1)
    # very fast traffic: clamped at the floor
    for _ in range(60):
        w.add(0.0001)
        t.sample_added(w)
    assert (t.p50, t.p90) == (0.01, 0.01)


def test_non_adaptive_thresholds_never_change():
    t = Thresholds(0.85, 2.1, adaptive=False, every=1)
    w = SlidingWindow(10)
    for _ in range(10):
        w.add(0.001)
        assert not t.sample_added(w)
    assert (t.p50, t.p90) == (0.85, 2.1)


def test_breaker_trips_after_exactly_n_consecutive_overs_and_a_good_one_resets():
    clock = Clock()
    moves = []
    b = Breaker(trip_after=3, open_seconds=30, half_open_probes=2, clock=clock, on_change=lambda f, t: moves.append((f, t)))
    for over in (True, True, False, True, True):
        assert not b.closed_sample(over)
    assert b.state == BreakerState.CLOSED
    assert b.closed_sample(True)            # third in a row
    assert b.state == BreakerState.OPEN and b.trips == 1 and b.main_frozen
    assert not b.closed_sample(True)        # ignored while open
    clock.now += 29.9
    assert b.tick() == BreakerState.OPEN and b.frozen_remaining() == pytest.approx(0.1)
    clock.now += 0.1
    assert b.tick() == BreakerState.HALF_OPEN and b.main_frozen
    assert b.half_open_probe(True) == BreakerState.OPEN       # one slow half-open probe re-opens
    assert b.trips == 1                                        # a re-open is not a new trip
    clock.now += 30
    b.tick()
    assert b.half_open_probe(False) == BreakerState.HALF_OPEN
    assert b.half_open_probe(False) == BreakerState.CLOSED
    assert not b.main_frozen
    C, O, H = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
    assert moves == [(C, O), (O, H), (H, O), (O, H), (H, C)]


def _water_reference(times, now, alpha, window, period, headroom, start):
    """The seed's formula evaluated directly from the list of arrival times."""
    t_val = 0.0
    k = 1
    while start + k * period <= now:
        b = start + k * period
        end = math.floor(b - start)
        q = sum(1 for t in times if end - window <= math.floor(t - start) < end) / window
        t_val = alpha * t_val + (1 - alpha) * q * headroom
        k += 1
    return t_val


def test_water_level_equals_the_seed_formula_evaluated_directly():
    clock = Clock(0.0)
    wl = WaterLevel(alpha=0.85, window_seconds=60, period_seconds=5, headroom=1.2, clock=clock)
    rng = random.Random(7)
    times = []
    # bursts, a ramp, a long idle gap, then traffic again
    for phase_rate, seconds in ((2, 40), (20, 30), (0, 400), (8, 50)):
        end = clock.now + seconds
        while clock.now < end:
            clock.now += rng.expovariate(phase_rate) if phase_rate else seconds
            if clock.now >= end:
                clock.now = end
                break
            wl.request()
            times.append(clock.now)
        got = wl.read()
        want = _water_reference(times, clock.now, 0.85, 60, 5, 1.2, 0.0)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (phase_rate, clock.now)
    assert wl.read() > 0


def test_water_level_tracks_steady_qps_times_headroom():
    clock = Clock(0.0)
    wl = WaterLevel(alpha=0.85, window_seconds=60, period_seconds=5, headroom=1.2, clock=clock)
    for _ in range(600 * 10):      # 10 requests per second for 600 s
        clock.now += 0.1
        wl.request()
    assert wl.last_qps == pytest.approx(10.0, rel=0.02)
    assert wl.read() == pytest.approx(12.0, rel=0.02)


def test_the_verdict_names_why_the_gate_stays_shut():
    """Too few probes, a tail over its threshold, and decode still getting faster each
    give a named reason and the figures; the gate and the breaker share the tail test."""
    t = Thresholds(0.85, 2.1)
    w = SlidingWindow(100)
    assert judge(w, t, 1).message == "0 of the 1 probes needed are in the window"
    for _ in range(10):
        w.add(2.2)
    v = judge(w, t, 3)
    assert (v.open, v.reason) == (False, "readiness_thresholds_not_met") and "P90 2200.0 ms" in v.message
    assert not t.tail_ok(2.2) and t.tail_ok(2.1)
    w.clear()
    for _ in range(4):
        w.add(0.1)
    decode = SlidingWindow(100)
    for s in (0.04, 0.04, 0.01, 0.01):      # the older half 4x the newer
        decode.add(s)
    v = judge(w, t, 4, DecodeTest(decode, p90_max=1.0, ratio=1.5))
    assert v.reason == "decode_not_converged" and "at most 1.5 x slower" in v.message
    assert judge(w, t, 4, DecodeTest(decode, p90_max=1.0)).open     # no ratio to meet
