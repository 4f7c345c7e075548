"""The search's anytime (betting) and stratified pruning rules, tested directly: ties, clear losers,
what cannot catch up, their level on tied valsets. The other rules: ``test_search_pruning.py``."""

from __future__ import annotations

import pytest

from flowopt.optimizers.search import RandomSearch
from flowopt.optimizers.search.pruners import to_prune, verdicts
from flowopt.optimizers.search.pruning import ALPHA, looks
from tests.optimizers.paired_scores import pairs


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
    challenger, leader = pairs(losses=50, wins=0, ties=50)
    order = [i for pair in zip(range(50), range(50, 100)) for i in pair]
    c, lead = [challenger[i] for i in order], [leader[i] for i in order]
    # At most 7 losses in 14 examples at 5% (log wealth 7 * log(1.6) = 3.3 >= log 20), 5 in 10 at 10% (2.35 >= log 10).
    for alpha, by in ((0.05, 14), (ALPHA, 10)):
        first = next(end for end in range(1, 101) if anytime_worse(c[:end], lead[:end], alpha, population=100))
        assert first <= by
        assert not anytime_worse(c[:first - 1], lead[:first - 1], alpha, population=100)


def test_anytime_rule_is_sure_when_the_challenger_cannot_catch_up():
    from flowopt.optimizers.search.pruning import anytime_worse, evidence

    assert anytime_worse(*pairs(4, 0, 93), population=100)  # 4 behind, 3 left: certain
    assert evidence(*pairs(4, 0, 93), population=100)[-1] == float("inf")
    # 3 behind after 80 of 100 (8 losses and 5 wins, mixed in): the 20 left may well hold 3 more wins.
    challenger, leader = [0.0, 1.0] * 5 + [0.0] * 3 + [1.0] * 67, [1.0, 0.0] * 5 + [1.0] * 3 + [1.0] * 67
    assert not anytime_worse(challenger, leader, population=100)
    assert not anytime_worse(challenger, leader, 0.05, population=100)
    # The same 3 losses followed by 77 concordant examples are strong evidence: under a whole-valset tie
    # the 20 left would have to hold all 3 wins for the challenger: C(20, 3) / C(97, 3), about 1 in 125.
    assert anytime_worse(*pairs(3, 0, 77), population=100)
    assert anytime_worse(*pairs(1, 0, 99), population=100)      # everything scored: behind is behind


@pytest.mark.parametrize("alpha, slack", [(0.05, 0.015), (ALPHA, 0.019)])  # 2 sd of a rate alpha at 1000 orders
@pytest.mark.parametrize("discordant", [15, 35])
def test_anytime_rule_keeps_its_level_over_every_look_on_a_tied_valset(discordant, alpha, slack):
    # A valset of 100 where the two tie overall. Looking after *every* example, over random orders, the
    # rule prunes the challenger in at most alpha of them (Ville's inequality; the per-look rules exceed
    # alpha over all their looks as discordance grows: the search benchmark's tie_prune_rates).
    import math
    import random

    from flowopt.optimizers.search.pruning import evidence

    challenger, leader = pairs(discordant, discordant, 100 - 2 * discordant)
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

    challenger, reference = pairs(15, 15, 70)
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

    assert RandomSearch(pruner="stratified").rung_ends(100) == looks(100, 20)
