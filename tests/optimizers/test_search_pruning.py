"""The search's pruning rules, tested directly: ties, the incumbent's slot, the first rung, the tests."""

from __future__ import annotations

import pytest

from flowopt.optimizers.search.pruning import first_rung, rungs, to_prune, worse_than


def _scores(mean: float, n: int, offset: int = 0) -> list[float]:
    """0/1 scores with ``round(mean * n)`` ones, placed from ``offset`` on (so overlaps are controlled)."""
    ones = round(mean * n)
    return [1.0 if (i - offset) % n < ones else 0.0 for i in range(n)]


def test_issue_tie_case_prunes_no_challenger_under_halving():
    # The issue's example at the rung of 52 examples: incumbent 0.385, bootstrap-0 0.365, sampled 0.385.
    # The old rule ranked the incumbent among the rivals: it took the only keep slot and both challengers went.
    live = {0: _scores(20 / 52, 52), 1: _scores(19 / 52, 52), 2: _scores(20 / 52, 52)}
    assert to_prune("halving", live, {}, 52, incumbent=0) == {1}
    assert to_prune("confidence", live, {}, 52, incumbent=0) == set()


def test_incumbent_takes_no_keep_slot_and_is_never_pruned():
    # Incumbent worst of all, clearly: never pruned; the keep slot goes to the best challenger.
    live = {0: [0.0] * 30, 1: [1.0] * 30, 2: [1.0] * 20 + [0.0] * 10, 3: [1.0] * 10 + [0.0] * 20}
    for rule in ("confidence", "halving", "median"):
        assert 0 not in to_prune(rule, live, {}, 30, incumbent=0)
    assert to_prune("halving", live, {}, 30, incumbent=0) == {2, 3}  # ceil(3 / 3) = 1 keep slot: candidate 1


def test_confidence_prunes_only_what_is_significantly_worse():
    leader = [1.0] * 25
    assert worse_than([1.0] * 20 + [0.0] * 5, leader)       # 5 discordant, all against: p = 1/32 < 0.05
    assert not worse_than([1.0] * 21 + [0.0] * 4, leader)   # 4 against: p = 1/16, not enough
    # 6 losses and 2 wins: p = P(Bin(8, .5) >= 6) = 0.145, not pruned though the mean trails by 0.16.
    assert not worse_than([0.0] * 6 + [1.0] * 2 + [1.0] * 17, [1.0] * 6 + [0.0] * 2 + [1.0] * 17)
    live = {1: [1.0] * 25, 2: [1.0] * 20 + [0.0] * 5, 3: [1.0] * 22 + [0.0] * 3}
    assert to_prune("confidence", live, {}, 25, incumbent=None) == {2}


def test_confidence_never_prunes_a_tie_even_with_many_discordant_pairs():
    a = [1.0, 0.0] * 20
    b = [0.0, 1.0] * 20
    assert not worse_than(a, b) and not worse_than(b, a)
    assert to_prune("confidence", {1: a, 2: b}, {}, 40, incumbent=None) == set()


def test_confidence_with_graded_scores_uses_a_paired_bound():
    leader = [0.8 + 0.01 * (i % 5) for i in range(30)]
    close = [x - 0.001 for x in leader[:15]] + [x + 0.001 for x in leader[15:]]  # mean diff 0: kept
    behind = [x - 0.2 + 0.05 * (i % 2) for i, x in enumerate(leader)]
    assert not worse_than(close, leader)
    assert worse_than(behind, leader)


def test_candidates_of_earlier_waves_can_lead():
    earlier = {5: [1.0] * 40}  # fully scored in an earlier wave
    live = {7: [0.0] * 8 + [1.0] * 12}
    assert to_prune("confidence", live, earlier, 20, incumbent=None) == {7}  # compared on the first 20


@pytest.mark.parametrize("n, requested, expected", [(100, None, 25), (40, None, 20), (12, None, 12),
                                                     (100, 5, 25), (100, 40, 40), (1000, None, 250)])
def test_first_rung_is_at_least_20_and_a_quarter_of_the_valset(n, requested, expected):
    assert first_rung(n, requested) == expected


def test_rungs_grow_to_the_whole_valset():
    assert rungs(100, 25, growth=1.5) == [25, 38, 56, 84, 100]
    assert rungs(60, 20) == [20, 40, 60]
    assert rungs(12, 12) == [12]
