"""bench/overhead_pairs.py's figures: adjacent off/on steps, a drift of the machine cancelled pair by pair."""

import pytest

from bench.overhead_pairs import summary


def test_a_drift_cancels_pair_by_pair_and_the_interval_holds_the_cost():
    # the machine slows by 2% over the run; the agent costs 1% of a step; a little noise on every step
    offs = [100.0 * (1 + 0.02 * i / 99) * (1 + 0.001 * ((7 * i) % 5 - 2)) for i in range(100)]
    ons = [o * 1.01 * (1 + 0.001 * ((3 * i) % 5 - 2)) for i, o in enumerate(offs)]
    got = summary(offs, ons)
    assert got["median"] == pytest.approx(1.0, abs=0.15)
    lo, hi = got["median_ci"]
    assert lo <= got["median"] <= hi and lo < 1.0 < hi and hi - lo < 0.5
    assert got["pairs"] == 100


def test_the_mean_carries_the_histogram_steps_the_median_leaves_out():
    offs = [100.0] * 100
    ons = [101.0 if i % 10 else 111.0 for i in range(100)]  # every 10th on-step 10% dearer
    got = summary(offs, ons)
    assert got["median"] == pytest.approx(1.0)
    assert got["mean"] == pytest.approx(2.0)
    assert got["mean_ci"][0] > got["median"]


def test_pairs_must_match():
    with pytest.raises(ValueError):
        summary([1.0, 1.0], [1.0])
