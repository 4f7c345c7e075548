"""The search's pruning rules, tested directly: ties, the incumbent's slot, the first rung, the tests."""

from __future__ import annotations

import sys
from pathlib import Path

import dspy
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "compiler"))
from fakes import category_lm, exact, examples

import flowopt
from flowopt import ConfigError
from flowopt.optimizers.search import RandomSearch
from flowopt.optimizers.search.pruners import to_prune, verdicts
from flowopt.optimizers.search.pruning import (
    ALPHA,
    _mcnemar_p,
    first_look,
    first_rung,
    looks,
    next_look,
    rungs,
    worse_than,
)


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


def test_the_default_level_is_a_one_sided_10_percent_test_at_each_look():
    from flowopt.optimizers.search import RandomSearch

    assert ALPHA == 0.1 and RandomSearch().alpha == ALPHA
    assert RandomSearch(alpha=0.05).alpha == 0.05  # the stricter level is one setting away


def test_confidence_prunes_only_what_is_significantly_worse():
    leader = [1.0] * 25
    # At the default one-sided 10%:
    assert worse_than([1.0] * 21 + [0.0] * 4, leader)       # 4 discordant, all against: p = 1/16 < 0.1
    assert not worse_than([1.0] * 22 + [0.0] * 3, leader)   # 3 against: p = 1/8, not enough
    # At 5%:
    assert worse_than([1.0] * 20 + [0.0] * 5, leader, alpha=0.05)       # 5 against: p = 1/32 < 0.05
    assert not worse_than([1.0] * 21 + [0.0] * 4, leader, alpha=0.05)   # 4 against: p = 1/16, not enough
    # 6 losses and 2 wins: p = P(Bin(8, .5) >= 6) = 0.145, not pruned though the mean trails by 0.16.
    assert not worse_than([0.0] * 6 + [1.0] * 2 + [1.0] * 17, [1.0] * 6 + [0.0] * 2 + [1.0] * 17)
    live = {1: [1.0] * 25, 2: [1.0] * 20 + [0.0] * 5, 3: [1.0] * 22 + [0.0] * 3}
    assert to_prune("confidence", live, {}, 25, incumbent=None) == {2}
    live[4] = [1.0] * 21 + [0.0] * 4
    assert to_prune("confidence", live, {}, 25, incumbent=None) == {2, 4}
    assert to_prune("confidence", live, {}, 25, incumbent=None, alpha=0.05) == {2}


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


# ---------------------------------------------------------------- the whole-valset (finite-population) test
def _pairs(losses: int, wins: int, ties: int) -> tuple[list[float], list[float]]:
    """Challenger and leader scores with that many losses, wins and (both right) ties for the challenger."""
    challenger = [0.0] * losses + [1.0] * wins + [1.0] * ties
    leader = [1.0] * losses + [0.0] * wins + [1.0] * ties
    return challenger, leader


def test_finite_population_test_prunes_what_cannot_catch_up_on_the_examples_left():
    # 3 losses, 0 wins after 97 of 100 examples: McNemar alone says p = 1/8, but even winning the 3
    # examples left only ties the whole valset, and 4 behind with 3 left cannot.
    assert not worse_than(*_pairs(3, 0, 94))
    assert worse_than(*_pairs(4, 0, 93), population=100)
    # A whole-valset tie is still possible at 3 behind with 3 left, but only if all 3 left are wins: no
    # discordant pair in 97 examples and 3 in the last 3 happens once in 160,000 orders (Berger-Boos
    # rules that count out); with 20 left it is plausible at 5% (p = 0.072), with 40 left at 10% (p =
    # 0.097 at 40, 0.104 at 50), and the challenger stays.
    assert worse_than(*_pairs(3, 0, 94), population=100)
    assert not worse_than(*_pairs(3, 0, 77), alpha=0.05, population=100)
    assert worse_than(*_pairs(3, 0, 77), population=100)
    assert not worse_than(*_pairs(3, 0, 47), population=100)
    assert worse_than(*_pairs(1, 0, 99), population=100)  # everything scored: one behind is behind


@pytest.mark.parametrize("alpha, losses, wins, ties", [(0.05, 14, 6, 56),   # 76 seen: McNemar p = 0.058,
                                                       (ALPHA, 10, 5, 60)])  # 75 seen: McNemar p = 0.151
def test_finite_population_test_is_mcnemar_on_an_unbounded_valset_and_never_stricter(alpha, losses, wins, ties):
    challenger, leader = _pairs(losses, wins, ties)
    assert not worse_than(challenger, leader, alpha)
    assert not worse_than(challenger, leader, alpha, population=10**6)
    assert worse_than(challenger, leader, alpha, population=100)  # 24, 25 left: the hypergeometric p is 0.016, 0.065
    for losses, wins in [(3, 0), (4, 0), (5, 0), (6, 2), (9, 3), (12, 5)]:
        for seen in (25, 50, 75):
            plain = worse_than(*_pairs(losses, wins, seen - losses - wins), alpha)
            assert not plain or worse_than(*_pairs(losses, wins, seen - losses - wins), alpha, population=100)


@pytest.mark.parametrize("alpha", [0.05, ALPHA])
def test_finite_population_test_keeps_its_level_when_the_whole_valset_is_tied(alpha):
    # A valset of 100 where the challenger and the leader tie overall (15 losses, 15 wins): over random
    # orders, a look at any prefix prunes the challenger in at most alpha of them.
    import random

    challenger, leader = _pairs(15, 15, 70)
    rng = random.Random(0)
    for seen in (20, 40, 80, 97):
        pruned = 0
        for _ in range(300):
            order = rng.sample(range(100), seen)
            pruned += worse_than([challenger[i] for i in order], [leader[i] for i in order], alpha, population=100)
        assert pruned / 300 <= alpha + 0.025, (seen, pruned)  # 0.025: Monte Carlo slack at 300 draws


def test_graded_scores_with_everything_scored_decide_by_the_sign():
    leader = [0.5 + 0.01 * (i % 7) for i in range(40)]
    behind = [x - 0.003 for x in leader]
    assert worse_than([*behind[:39], leader[39] + 0.2], leader, population=40) is False  # ahead overall: never
    noisy = [x - 0.003 + (0.05 if i % 2 else -0.05) for i, x in enumerate(leader)]
    assert not worse_than(noisy, leader)
    assert worse_than(noisy, leader, population=40)  # the whole valset is seen: behind is behind


def test_looks_come_every_five_percent_after_the_first_look():
    assert looks(100, 20) == [20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 100]
    assert looks(1000, 200) == [*range(200, 1000, 50), 1000]
    assert looks(12, 12) == [12]
    assert looks(40, 20, every=7) == [20, 27, 34, 40]


@pytest.mark.parametrize("n, requested, expected", [(100, None, 20), (1000, None, 20), (12, None, 12),
                                                     (100, 5, 20), (100, 40, 40)])
def test_confidence_first_look_is_at_least_20_examples(n, requested, expected):
    assert first_look(n, requested) == expected


def test_next_look_fills_every_thread_and_never_skips_the_first_or_the_last():
    ends = looks(100, 20)
    assert next_look(ends, 0, 11, 8) == 20      # the first look is never skipped
    assert next_look(ends, 20, 11, 8) == 25     # 11 candidates x 5 examples fill 8 threads: no look skipped
    assert next_look(ends, 20, 2, 8) == 25      # 2 x 5 do too
    assert next_look(ends, 20, 1, 8) == 30      # 1 candidate needs 8 examples: the look at 25 is skipped
    assert next_look(ends, 95, 1, 8) == 100     # past the last look: the whole valset
    assert next_look(list(range(20, 101)), 20, 3, 8) == 23  # finer looks: 3 candidates need 3 examples each
    assert next_look([25, 50, 100], 25, 1, 8) == 50  # halving's rungs are far apart: none skipped


def test_berger_boos_bound_is_tighter_than_the_worst_case_and_still_exact_at_the_end():
    # 15 losses, 6 wins in 60 of 100 examples: the worst case over every discordant count of the 40
    # left would say p = 0.015; the counts the 21 of 60 seen leave plausible give 0.0105 (with gamma).
    import numpy as np
    from scipy.stats import hypergeom

    totals = np.arange(21, 62)
    worst = float(np.max(hypergeom.sf(14, totals, totals // 2, 21)))
    assert _mcnemar_p(15, 6, 40, 60) < worst
    assert _mcnemar_p(15, 6, 40, 60) >= 0.001  # gamma is paid: never below it before the end
    assert _mcnemar_p(15, 6, 0, 100) == 0.0     # everything scored: 15 v 6 is certain
    assert _mcnemar_p(6, 6, 0, 100) == 1.0      # and a tie is a tie


def test_verdicts_say_why_each_candidate_was_pruned():
    live = {0: [0.0] * 25, 1: [1.0] * 25, 2: [1.0] * 19 + [0.0] * 6, 3: [1.0] * 24 + [0.0]}
    why = verdicts("confidence", live, {}, 25, incumbent=0)
    assert set(why) == {2}
    assert "worse than candidate 1" in why[2] and "(6 losses, 0 wins)" in why[2] and "first 25" in why[2]
    halving = verdicts("halving", live, {}, 25, incumbent=0)
    assert set(halving) == {2, 3} and all("best 1/3" in text for text in halving.values())
    assert to_prune("halving", live, {}, 25, incumbent=0) == set(halving)
    median = verdicts("median", live, {}, 25, incumbent=0)
    assert set(median) == {2} and "median" in median[2]


@pytest.mark.parametrize("alpha, bound", [(0.05, 0.05 + 0.02),   # 16 of these 300 (0.053); 0.02: Monte Carlo slack
                                          (ALPHA, 0.15)])         # 38 of 300 (0.127): the looks add about a quarter
def test_the_stages_looks_together_stay_near_the_level_on_a_tied_valset(alpha, bound):
    # Each look is a level-alpha test; a candidate is looked at up to 17 times on a valset of 100. With
    # 15 + 15 discordant examples that tie overall, the chance that *some* look prunes it stays near
    # alpha over random orders (the search benchmark's tie_prune_rates: more at 35 + 35 discordant).
    import random

    challenger, leader = _pairs(15, 15, 70)
    rng = random.Random(1)
    ends, pruned, orders = looks(100, first_look(100)), 0, 300
    for _ in range(orders):
        order = rng.sample(range(100), 100)
        c, lead = [challenger[i] for i in order], [leader[i] for i in order]
        pruned += any(worse_than(c[:end], lead[:end], alpha, population=100) for end in ends[:-1])
    assert pruned / orders <= bound, pruned


def test_the_stage_looks_from_20_examples_with_confidence_and_from_a_quarter_otherwise():
    from flowopt.optimizers.search import RandomSearch

    assert RandomSearch().rung_ends(100) == looks(100, 20)
    assert RandomSearch(minibatch_size=30).rung_ends(100)[:2] == [30, 35]
    assert RandomSearch(pruner="halving").rung_ends(100) == [25, 50, 100]
    assert RandomSearch(pruner="none").rung_ends(100) == [100]


# ---------------------------------------------------------------- the anytime (betting) rule
def test_anytime_rule_never_prunes_a_tie_or_a_challenger_ahead():
    from flowopt.optimizers.search.pruning import anytime_worse

    a, b = [1.0, 0.0] * 30, [0.0, 1.0] * 30
    assert not anytime_worse(a, b, population=60) and not anytime_worse(b, a, population=60)
    assert not anytime_worse([1.0] * 30, [0.0] * 30)
    assert to_prune("anytime", {1: a, 2: b}, {}, 60, incumbent=None) == set()


def test_anytime_rule_prunes_a_clearly_worse_challenger_early():
    from flowopt.optimizers.search.pruning import anytime_worse

    # 0.5 vs 1.0 on a valset of 100, in an order where the challenger loses every other example.
    challenger, leader = _pairs(losses=50, wins=0, ties=50)
    order = [i for pair in zip(range(50), range(50, 100)) for i in pair]
    c, lead = [challenger[i] for i in order], [leader[i] for i in order]
    # At most 7 losses in 14 examples at 5% (log wealth 7 * log(1.6) = 3.3 >= log 20), 5 in 10 at 10% (2.35 >= log 10).
    for alpha, by in ((0.05, 14), (ALPHA, 10)):
        first = next(end for end in range(1, 101) if anytime_worse(c[:end], lead[:end], alpha, population=100))
        assert first <= by
        assert not anytime_worse(c[:first - 1], lead[:first - 1], alpha, population=100)


def test_anytime_rule_is_sure_when_the_challenger_cannot_catch_up():
    from flowopt.optimizers.search.pruning import anytime_worse, evidence

    assert anytime_worse(*_pairs(4, 0, 93), population=100)  # 4 behind, 3 left: certain
    assert evidence(*_pairs(4, 0, 93), population=100)[-1] == float("inf")
    # 3 behind after 80 of 100 (8 losses and 5 wins, mixed in): the 20 left may well hold 3 more wins.
    challenger, leader = [0.0, 1.0] * 5 + [0.0] * 3 + [1.0] * 67, [1.0, 0.0] * 5 + [1.0] * 3 + [1.0] * 67
    assert not anytime_worse(challenger, leader, population=100)
    assert not anytime_worse(challenger, leader, 0.05, population=100)
    # The same 3 losses followed by 77 concordant examples are strong evidence: under a whole-valset tie
    # the 20 left would have to hold all 3 wins for the challenger: C(20, 3) / C(97, 3), about 1 in 125.
    assert anytime_worse(*_pairs(3, 0, 77), population=100)
    assert anytime_worse(*_pairs(1, 0, 99), population=100)      # everything scored: behind is behind


@pytest.mark.parametrize("alpha, slack", [(0.05, 0.015), (ALPHA, 0.019)])  # 2 sd of a rate alpha at 1000 orders
@pytest.mark.parametrize("discordant", [15, 35])
def test_anytime_rule_keeps_its_level_over_every_look_on_a_tied_valset(discordant, alpha, slack):
    # A valset of 100 where the two tie overall. Looking after *every* example, over random orders, the
    # rule prunes the challenger in at most alpha of them (Ville's inequality; the per-look rules exceed
    # alpha over all their looks as discordance grows: the search benchmark's tie_prune_rates).
    import math
    import random

    from flowopt.optimizers.search.pruning import evidence

    challenger, leader = _pairs(discordant, discordant, 100 - 2 * discordant)
    rng, orders, pruned = random.Random(2), 1000, 0
    for _ in range(orders):
        order = rng.sample(range(100), 100)
        wealth = evidence([challenger[i] for i in order], [leader[i] for i in order], population=100)
        # The same as asking anytime_worse at every prefix where the challenger trails, and more: any look.
        pruned += max(wealth[:-1]) >= math.log(1.0 / alpha)
    assert pruned / orders <= alpha + slack, pruned  # 4000 orders give ~4% at alpha 0.05


def test_anytime_rule_wants_scores_in_the_unit_interval():
    from flowopt.errors import ConfigError
    from flowopt.optimizers.search.pruning import anytime_worse

    with pytest.raises(ConfigError, match=r"scores in \[0, 1\]"):
        anytime_worse([0.0, 2.0], [3.0, 3.0])


def test_anytime_rule_says_why_and_looks_after_every_example():
    from flowopt.optimizers.search import RandomSearch

    live = {0: [0.0] * 25, 1: [1.0] * 25, 2: [1.0] * 15 + [0.0] * 10}
    why = verdicts("anytime", live, {}, 25, incumbent=0, population=100)
    assert set(why) == {2} and "worse than candidate 1 at 10% over every look" in why[2]
    why = verdicts("anytime", live, {}, 25, incumbent=0, alpha=0.05, population=100)
    assert set(why) == {2} and "worse than candidate 1 at 5% over every look" in why[2]
    assert RandomSearch(pruner="anytime").rung_ends(100) == list(range(20, 101))


# ---------------------------------------------------------------- the stratified rule (a fully scored reference)
def test_stratified_rule_never_prunes_a_tie_or_a_challenger_ahead():
    from flowopt.optimizers.search.pruning import stratified_worse

    reference = [1.0, 0.0] * 50  # 50 right of 100
    # Right exactly where the reference is wrong: a whole-valset tie on course, with every pair discordant.
    assert not stratified_worse([0.0, 1.0] * 10, reference)
    assert not stratified_worse([0.0, 1.0] * 49, reference)
    assert not stratified_worse([1.0] * 20, reference)  # ahead
    # A tie on the whole valset, fully scored: never pruned.
    assert not stratified_worse([0.0, 1.0] * 50, reference)


def test_stratified_rule_prunes_a_clearly_worse_challenger_and_what_cannot_catch_up():
    from flowopt.optimizers.search.pruning import stratified_p, stratified_worse

    reference = [1.0, 0.0] * 50
    assert stratified_worse([1.0, 0.0] * 5 + [0.0, 0.0] * 5, reference)  # 5 of 20 right: on course for 25
    assert not stratified_worse([1.0, 0.0] * 8 + [0.0, 0.0] * 2, reference)  # 8 of 20: 40 is within reach
    # 49 behind with 2 left: no split of a total of 50 fits what is seen; p is 0, the prune certain.
    assert stratified_p([0.0] * 98, reference) == 0.0
    assert stratified_worse([0.0] * 98, reference)


def test_stratified_p_is_the_worst_split_and_keeps_its_level_exactly():
    # A valset of 12, the reference right on 6. For every split of a challenger's total that ties the
    # reference's (the null's boundary), enumerate every prefix of 6 examples (every order gives one):
    # the share of prefixes with p < alpha is at most alpha, for every split, at several alphas.
    import itertools

    from flowopt.optimizers.search.pruning import stratified_p

    reference = [1.0] * 6 + [0.0] * 6
    for right_where_reference_right in range(7):
        challenger = ([1.0] * right_where_reference_right + [0.0] * (6 - right_where_reference_right)
                      + [1.0] * (6 - right_where_reference_right) + [0.0] * right_where_reference_right)
        assert sum(challenger) == 6
        prefixes = list(itertools.combinations(range(12), 6))
        for alpha in (0.05, ALPHA, 0.2):
            rejected = 0
            for prefix in prefixes:
                rest = [i for i in range(12) if i not in prefix]
                order = [*prefix, *rest]
                p = stratified_p([challenger[i] for i in prefix], [reference[i] for i in order])
                rejected += p < alpha
            assert rejected / len(prefixes) <= alpha, (right_where_reference_right, alpha, rejected)


def test_stratified_p_counts_each_stratum_from_the_reference_order():
    # Stratum bookkeeping: the reference's wrong/right examples define the strata over the whole valset;
    # the challenger's scores are read against the reference's first len(challenger) entries.
    from scipy.stats import hypergeom

    from flowopt.optimizers.search.pruning import stratified_p

    reference = [1.0] * 4 + [0.0] * 4 + [1.0] * 46 + [0.0] * 46  # 50 right; the prefix of 8 has 4 of each
    challenger = [1.0, 1.0, 0.0, 0.0] + [0.0] * 4  # 2 of 4 where it was right, 0 of 4 where it was wrong
    # Estimate 50 * 2/4 + 50 * 0/4 = 25. By hand, the worst split of 50 that fits (C_wrong <= 46):
    # P(50 K1 / 4 + 50 K0 / 4 <= 25) = P(K1 + K0 <= 2) with K_s ~ Hypergeom(50, C_s, 4).
    best = 0.0
    for wrong_right in range(0, 47):
        c1 = 50 - wrong_right
        if not 2 <= c1 <= 48:
            continue
        p = sum(hypergeom.pmf(a, 50, c1, 4) * hypergeom.pmf(b, 50, wrong_right, 4)
                for a in range(5) for b in range(5) if a + b <= 2)
        best = max(best, p)
    assert stratified_p(challenger, reference) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("alpha", [0.05, ALPHA])
def test_stratified_rule_keeps_its_level_at_each_look_on_a_tied_valset(alpha):
    # Each look is a level-alpha test (the guarantee). Over *all* looks the rate is higher than the
    # confidence rule's (its looks are less alike, and McNemar's is conservative with few discordant
    # pairs); the benchmark reports both (tie_prune_rates in benchmarks/results/search_generalisation).
    import random

    from flowopt.optimizers.search.pruning import stratified_worse

    challenger, reference = _pairs(15, 15, 70)
    rng, orders = random.Random(3), 300
    for seen in (20, 50, 80):
        pruned = 0
        for _ in range(orders):
            order = rng.sample(range(100), 100)
            pruned += stratified_worse([challenger[i] for i in order[:seen]], [reference[i] for i in order], alpha)
        assert pruned / orders <= alpha + 0.025, (seen, pruned)  # 0.025: Monte Carlo slack at 300 orders


def test_stratified_rule_tests_against_the_best_fully_scored_candidate_and_spares_the_incumbent():
    # Candidate 1 is fully scored (100 examples); the others have 20. The incumbent (0) trails badly and
    # is never pruned; candidate 2 trails the reference and goes; 3 ties it on course and stays.
    reference = [1.0, 0.0] * 50
    live = {0: [0.0] * 20, 1: reference, 2: [1.0, 0.0] * 2 + [0.0] * 16, 3: [0.0, 1.0] * 10}
    why = verdicts("stratified", live, {}, 20, incumbent=0, population=100)
    assert set(why) == {2}
    assert "worse than candidate 1 (whole valset 0.500)" in why[2] and "stratified" in why[2]
    # A fully scored reference from an earlier wave works too; a fully scored challenger is not pruned here.
    assert set(verdicts("stratified", {2: live[2], 4: [0.0] * 100}, {1: reference}, 20, incumbent=None,
                        population=100)) == {2}
    # No fully scored candidate yet: the confidence rule against the leader of the prefix.
    assert verdicts("stratified", {1: [1.0] * 20, 2: [0.0] * 20}, {}, 20, None, population=100).keys() == {2}
    from flowopt.optimizers.search import RandomSearch

    assert RandomSearch(pruner="stratified").rung_ends(100) == looks(100, 20)


def test_each_rule_is_a_registered_pruner_class_with_its_own_docstring():
    from flowopt.optimizers.search.pruners import PRUNE_RULES, Pruner, get_pruner, pruner_names

    assert set(PRUNE_RULES) <= set(pruner_names())
    for name in PRUNE_RULES:
        cls = get_pruner(name)
        assert issubclass(cls, Pruner) and cls.name == name and cls.__doc__ and f'"{name}"' in cls.__doc__
    with pytest.raises(ConfigError, match="unknown pruner 'nope'"):
        get_pruner("nope")


def test_a_users_own_pruner_plugs_into_the_search():
    from flowopt.optimizers.search.pruners import Look, Pruner, register_pruner

    seen: list[int] = []

    @register_pruner
    class EveryoneButTheLeader(Pruner):
        """Prune every challenger but the best so far, at the first look only."""

        name = "test-everyone-but-the-leader"

        def rung_ends(self, n, minibatch_size):
            return [20, n]

        def prune(self, look: Look) -> dict[int, str]:
            seen.append(look.step)
            means = look.means()
            best = max(means, key=lambda k: (means[k], -k))
            return {k: "not the leader" for k in look.challengers() if k != best}

    with pytest.raises(ConfigError, match="pruner"):
        RandomSearch(pruner="test-no-such-rule")
    stage = RandomSearch(n_candidates=5, seeded=2, max_demos=3, max_labeled_demos=3, extra=0,
                         pruner="test-everyone-but-the-leader")
    with dspy.context(lm=category_lm()):
        out = flowopt.compile(dspy.Predict("question -> answer"), examples(15, categories=True), exact,
                              valset=examples(40, 200, categories=True), stages=[stage], quiet=True, num_threads=4)
    info = out.report.stage("search").info
    assert seen and set(seen) == {20}
    assert info["pruned"] >= 1 and all(c["pruned"] == "not the leader" for c in info["candidates"] if "pruned" in c)
