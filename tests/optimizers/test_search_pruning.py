"""The search's pruning rules, tested directly: ties, the incumbent's slot, the first rung, the confidence and
whole-valset tests, and pruners as plug-ins. The anytime and stratified rules: ``test_search_pruning_sequential.py``."""

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
from tests.optimizers.paired_scores import pairs, scores


def test_issue_tie_case_prunes_no_challenger_under_halving():
    # The issue's example at the rung of 52 examples: incumbent 0.385, bootstrap-0 0.365, sampled 0.385.
    # The old rule ranked the incumbent among the rivals: it took the only keep slot and both challengers went.
    live = {0: scores(20 / 52, 52), 1: scores(19 / 52, 52), 2: scores(20 / 52, 52)}
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
def test_finite_population_test_prunes_what_cannot_catch_up_on_the_examples_left():
    # 3 losses, 0 wins after 97 of 100 examples: McNemar alone says p = 1/8, but even winning the 3
    # examples left only ties the whole valset, and 4 behind with 3 left cannot.
    assert not worse_than(*pairs(3, 0, 94))
    assert worse_than(*pairs(4, 0, 93), population=100)
    # A whole-valset tie is still possible at 3 behind with 3 left, but only if all 3 left are wins: no
    # discordant pair in 97 examples and 3 in the last 3 happens once in 160,000 orders (Berger-Boos
    # rules that count out); with 20 left it is plausible at 5% (p = 0.072), with 40 left at 10% (p =
    # 0.097 at 40, 0.104 at 50), and the challenger stays.
    assert worse_than(*pairs(3, 0, 94), population=100)
    assert not worse_than(*pairs(3, 0, 77), alpha=0.05, population=100)
    assert worse_than(*pairs(3, 0, 77), population=100)
    assert not worse_than(*pairs(3, 0, 47), population=100)
    assert worse_than(*pairs(1, 0, 99), population=100)  # everything scored: one behind is behind


@pytest.mark.parametrize("alpha, losses, wins, ties", [(0.05, 14, 6, 56),   # 76 seen: McNemar p = 0.058,
                                                       (ALPHA, 10, 5, 60)])  # 75 seen: McNemar p = 0.151
def test_finite_population_test_is_mcnemar_on_an_unbounded_valset_and_never_stricter(alpha, losses, wins, ties):
    challenger, leader = pairs(losses, wins, ties)
    assert not worse_than(challenger, leader, alpha)
    assert not worse_than(challenger, leader, alpha, population=10**6)
    assert worse_than(challenger, leader, alpha, population=100)  # 24, 25 left: the hypergeometric p is 0.016, 0.065
    for losses, wins in [(3, 0), (4, 0), (5, 0), (6, 2), (9, 3), (12, 5)]:
        for seen in (25, 50, 75):
            plain = worse_than(*pairs(losses, wins, seen - losses - wins), alpha)
            assert not plain or worse_than(*pairs(losses, wins, seen - losses - wins), alpha, population=100)


@pytest.mark.parametrize("alpha", [0.05, ALPHA])
def test_finite_population_test_keeps_its_level_when_the_whole_valset_is_tied(alpha):
    # A valset of 100 where the challenger and the leader tie overall (15 losses, 15 wins): over random
    # orders, a look at any prefix prunes the challenger in at most alpha of them.
    import random

    challenger, leader = pairs(15, 15, 70)
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

    challenger, leader = pairs(15, 15, 70)
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
