"""Choices from interleaved rounds: never from one timing, a near-tie keeps the user's way, every round kept."""

from __future__ import annotations

import itertools
import time

import pytest

from monai_fast.tune.rounds import MIN_ROUNDS, decide


def _seq(*values: float):
    """A callable returning the given seconds in turn (the last one repeated), counting its calls."""
    it = itertools.chain(values, itertools.repeat(values[-1]))

    def call() -> float:
        call.calls += 1
        return next(it)

    call.calls = 0
    return call


def test_a_fast_warm_up_alone_never_decides():
    # the candidate's first call is 6x faster (a warm-up effect), then both take the same time
    base, cand = _seq(0.6, 0.1), _seq(0.1, 0.1)
    d = decide(base, cand, names=("contiguous", "channels_last_3d"))
    assert d.choice == "contiguous" and d.clear  # every counted round: 1.0x, below the gain
    assert len(d.rounds) == MIN_ROUNDS and d.warmup == (0.6, 0.1)
    assert base.calls == cand.calls == 1 + MIN_ROUNDS


def test_a_clear_gain_stops_after_the_fewest_rounds_and_keeps_each_one():
    d = decide(_seq(0.2), _seq(0.1), names=("eager", "compiled"))
    assert (d.choice, d.clear, len(d.rounds)) == ("compiled", True, MIN_ROUNDS)
    assert d.gain == pytest.approx(2.0) and "2.00x median over 3 rounds, 2.00x-2.00x" in d.reason
    row = d.as_row()
    assert row["rounds_s"] == [[0.2, 0.1]] * 3 and row["choice"] == "compiled" and row["warmup_s"] == [0.2, 0.1]


def test_one_fast_round_among_slow_ones_is_not_a_gain():
    # one round (the second) says 6.48x; the others say 0.95x: the median decides, the user's way stays
    base = _seq(1.0, 1.0, 6.48, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95)
    d = decide(base, _seq(1.0), names=("contiguous", "channels_last_3d"), max_rounds=7)
    assert d.choice == "contiguous" and len(d.rounds) == 7  # the rounds disagreed: measured to the end
    assert max(d.ratios) == pytest.approx(6.48) and d.gain == pytest.approx(0.95)


def test_a_near_tie_keeps_the_users_way_and_says_so():
    base = _seq(1.0, 1.06, 0.98, 1.07, 1.0, 1.04)  # straddles the 1.05x needed, median 1.04x
    d = decide(base, _seq(1.0), names=("on demand", "ahead"), max_rounds=5)
    assert d.choice == "on demand" and not d.clear and "near-tie" in d.reason and len(d.rounds) == 5


def test_a_budget_too_small_for_the_fewest_rounds_measures_nothing_more():
    base, cand = _seq(1.0), _seq(0.5)
    d = decide(base, cand, budget_s=2.0)  # the warm-up pair took 1.5 s: 3 rounds need 4.5 s more
    assert d.choice == "baseline" and not d.clear and d.rounds == () and "more than the 2.0 s" in d.reason
    assert base.calls == cand.calls == 1


def test_the_rounds_alternate_which_way_goes_first():
    order = []
    base = lambda: order.append("b") or 0.1
    cand = lambda: order.append("c") or 0.05
    decide(base, cand, min_rounds=4, max_rounds=4)
    assert order == ["b", "c", "b", "c", "c", "b", "b", "c", "c", "b"]


def test_real_work_of_known_durations():
    def work(seconds: float):
        def call() -> float:
            t = time.perf_counter()
            time.sleep(seconds)
            return time.perf_counter() - t

        return call

    assert decide(work(0.03), work(0.01)).choice == "candidate"
    assert decide(work(0.01), work(0.03)).choice == "baseline"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="min_rounds"):
        decide(_seq(1.0), _seq(1.0), min_rounds=1)
    with pytest.raises(ValueError, match="min_gain"):
        decide(_seq(1.0), _seq(1.0), min_gain=0.9)


def test_rounds_that_vary_but_mostly_gain_choose_the_candidate():
    base = _seq(1.0, 1.3, 1.02, 1.4, 1.35, 1.3)  # one round barely faster, the median 1.3x
    d = decide(base, _seq(1.0), max_rounds=5)
    assert d.choice == "candidate" and d.clear and len(d.rounds) == 5 and "rounds vary" in d.reason
