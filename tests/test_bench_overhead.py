"""bench/agent_overhead.py's paired overhead: each on-phase against the off-phases around it."""

import pytest

from bench.agent_overhead import paired


def test_a_drift_of_the_clocks_cancels_in_the_pairs():
    # the machine slows by 1% a round; the agent costs 0.5% of the step in every round
    offs = [[100.0 * 1.01 ** (2 * r)] * 5 for r in range(4)]
    ons = [[100.0 * 1.01 ** (2 * r + 1) * 1.005] * 5 for r in range(4)]
    pooled = (sorted(t for p in ons for t in p)[10] / sorted(t for p in offs for t in p)[10] - 1) * 100
    assert paired(offs, ons) == pytest.approx(0.5, abs=0.02)
    assert abs(pooled - 0.5) > 1.0  # what the pooled medians make of the same run


def test_a_single_round_is_its_on_phase_against_its_off_phase():
    assert paired([[10.0, 10.2, 9.8]], [[10.1, 10.3, 9.9]]) == pytest.approx(1.0)


def test_each_phase_counts_by_its_median():
    # one slow outlier step in an on-phase does not move it
    assert paired([[10.0] * 5, [10.0] * 5], [[10.1, 10.1, 10.1, 10.1, 50.0]]) == pytest.approx(1.0)
