"""When to stop scoring a candidate: the minibatch schedule and the statistical tests of the pruners.

Every candidate is scored on the same shuffled valset, rung by rung (cumulative prefixes of it), so
at each rung all live candidates have scores on the same examples. The rules that decide, given those
scores, are the :class:`~flowopt.optimizers.search.pruners.Pruner` classes (one per rule, each
documented on its own); this module holds what they share: where the looks fall and the tests.

No decision rests on a handful of examples: the testing rules' first look is at 20 examples at least
(:func:`first_look`; the exact test needs no more), the ranking rules' first rung at ``max(20, 25% of
the valset)`` (:func:`first_rung`: a rank says nothing about significance, so it needs a sizeable
sample). The confidence rule then looks again every 5% of the valset (:func:`looks`), and the search
skips a look that would leave threads idle (:func:`next_look`).

The tests: :func:`worse_than` (McNemar's exact test, or its finite-population version, for 0/1
scores; a paired normal bound for graded ones), :func:`anytime_worse` (a betting test valid at every
look, :func:`evidence`) and :func:`stratified_worse` (an exact test against a fully scored reference,
:func:`stratified_p`). Each is a one-sided level-``alpha`` test (:data:`ALPHA`, 0.1 by default: on the
search benchmark's task the held-out score of the pick does not change measurably between 0.1 and 0.05,
while 0.1 stops trailing candidates sooner; the measured error rates are in
``benchmarks/results/search_generalisation.md``). A tie never prunes.

Example:
    >>> from flowopt.optimizers.search.pruning import first_look, first_rung, rungs, worse_than
    >>> first_look(100), first_rung(100), rungs(100, 25, growth=1.5)
    (20, 25, [25, 38, 56, 84, 100])
    >>> worse_than([0.0] * 10 + [1.0] * 15, [1.0] * 25)  # 10 discordant pairs, all against: p = 0.001
    True
    >>> worse_than([1.0, 0.0] * 15, [0.0, 1.0] * 15)      # a tie never prunes
    False
    >>> worse_than([0.0] * 10 + [1.0] * 5 + [1.0] * 60, [1.0] * 10 + [0.0] * 5 + [1.0] * 60)  # 10 v 5: p = 0.151
    False
    >>> worse_than([0.0] * 10 + [1.0] * 5 + [1.0] * 60, [1.0] * 10 + [0.0] * 5 + [1.0] * 60, population=100)
    True
    >>> worse_than([0.0] * 10 + [1.0] * 5 + [1.0] * 60, [1.0] * 10 + [0.0] * 5 + [1.0] * 60, alpha=0.05,
    ...            population=100)  # 25 left: p = 0.065, a prune at 10% but not at 5%
    False
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from flowopt.errors import ConfigError

MIN_FIRST_RUNG = 20
ALPHA = 0.1  # the default one-sided level of each prune decision (the search stage's ``alpha``); see above
FINITE_UP_TO = 2000  # examples left beyond which the finite-population test gains nothing over McNemar's
GAMMA = 0.001  # Berger-Boos: the discordant count is bounded at 1 - GAMMA confidence, GAMMA added to the p-value
BET = 0.6  # the anytime rule's bet: the share of its wealth it stakes on each example (chosen on the benchmark's task)


def first_rung(n: int, requested: int | None = None) -> int:
    """The first rung: ``requested`` or ``max(20, 25% of n)``, never below that floor, at most ``n``."""
    floor = max(MIN_FIRST_RUNG, math.ceil(0.25 * n))
    return min(n, max(floor, requested or 0))


def first_look(n: int, requested: int | None = None) -> int:
    """The confidence rule's first look: ``requested`` or 20 examples, never fewer, at most ``n``."""
    return min(n, max(MIN_FIRST_RUNG, requested or 0))


def rungs(n: int, first: int, growth: float = 2.0) -> list[int]:
    """Cumulative minibatch ends: first, first*growth, first*growth^2, ..., n."""
    out: list[int] = []
    size = float(max(1, first))
    while round(size) < n:
        if not out or round(size) > out[-1]:
            out.append(round(size))
        size *= growth
    return [*out, n] if n else [0]


def looks(n: int, first: int, every: int | None = None) -> list[int]:
    """Cumulative ends of a group-sequential race: ``first``, then every ``every`` examples (default
    5% of ``n``, at least 1) up to ``n``. Looks cost no LM calls, only a pause to judge, so a candidate
    that falls clearly behind stops within a few examples of it; but every look is another chance to
    prune a tie, so they are not finer.

    Example:
        >>> looks(100, 20)[:4], looks(100, 20)[-2:], looks(30, 20)
        ([20, 25, 30, 35], [95, 100], [20, 22, 24, 26, 28, 30])
    """
    step = max(1, every if every is not None else round(n / 20))
    return [*range(min(first, n), n, step), n] if n else [0]


def next_look(ends: Sequence[int], done: int, live: int, threads: int) -> int:
    """The next of ``ends`` to score up to, from ``done`` examples, with ``live`` candidates racing on
    ``threads`` threads: the first end that gives every thread an example (``live * (end - done) >=
    threads``), or the last. Skipping a look costs a few examples of a candidate that could have
    stopped there (and is one chance fewer to prune wrongly); a look of 5 examples with one candidate
    left would leave three of eight threads idle.

    Example:
        >>> ends = looks(100, 20)
        >>> next_look(ends, 0, 11, 8), next_look(ends, 20, 11, 8), next_look(ends, 20, 1, 8), next_look(ends, 95, 1, 8)
        (20, 25, 30, 100)
    """
    step = math.ceil(threads / max(1, live))
    return next((end for end in ends if end > done and end - done >= step), ends[-1])


def _binary(values: Sequence[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def worse_than(challenger: Sequence[float], leader: Sequence[float], alpha: float = ALPHA,
               population: int | None = None) -> bool:
    """Is ``challenger`` worse than ``leader`` on these paired scores, at one-sided level ``alpha``?

    0/1 scores: McNemar's exact test (a one-sided binomial test on the discordant pairs). Other
    scores: the upper ``1 - alpha`` normal bound of the mean paired difference is below 0.

    ``population``: the scores are a random prefix of a finite set of that many examples (the
    valset, in one shuffled order) and the question is about the whole set. Then the discordant
    pairs seen are drawn without replacement from the set's ``K`` discordant pairs, of which at most
    ``K // 2`` go against the challenger under the null; ``K`` is unknown (between the ``d`` seen and
    ``d`` plus the examples left), so the p-value is the largest over the ``K`` that the ``d``
    discordant pairs among the examples seen leave plausible at ``1 - GAMMA``, plus ``GAMMA``
    (:func:`_mcnemar_p`). Graded scores: the normal bound with the finite-population correction.
    """
    n = min(len(challenger), len(leader))
    if n == 0:
        return False
    a, b = list(challenger[:n]), list(leader[:n])
    if sum(a) >= sum(b):  # not behind: a tie or better never prunes
        return False
    left = max(0, population - n) if population is not None else None
    if _binary(a) and _binary(b):
        losses = sum(1 for x, y in zip(a, b) if x < y)
        wins = sum(1 for x, y in zip(a, b) if x > y)
        return _mcnemar_p(losses, wins, left, n) < alpha
    from scipy.stats import norm

    diffs = [x - y for x, y in zip(a, b)]
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else 0.0
    if left is not None and population is not None and population > 1:
        sd *= math.sqrt(left / (population - 1))  # finite-population correction: nothing left, no doubt
    return bool(mean + norm.ppf(1 - alpha) * sd / math.sqrt(n) < 0)


def evidence(challenger: Sequence[float], leader: Sequence[float], population: int | None = None,
             bet: float = BET) -> list[float]:
    """The log wealth, after each example, of a bettor against "the challenger's whole-valset score is
    at least the leader's" (a test martingale: Waudby-Smith and Ramdas, 2020, *Confidence sequences for
    sampling without replacement*; 2023, *Estimating means of bounded random variables by betting*).

    The examples are drawn in a random order without replacement from a valset of ``population``
    (``None``: an endless stream, each example drawn independently). With ``x`` the leader's score minus
    the challenger's (in [-1, 1]) and ``S`` their sum so far, the null (the valset's total of ``x`` is
    at most 0) says the next ``x`` has mean at most ``m = -S / (examples left)`` (0 on an endless
    stream). The bettor stakes ``lam = bet / (1 + m)`` on ``x - m``: wealth ``*= 1 + lam * (x - m)``,
    never negative. Under the null its wealth is a nonnegative supermartingale from 1, so by Ville's
    inequality it *ever* reaches ``1 / alpha`` with probability at most ``alpha``: the test may be read
    after every example, and at any stopping time, at level ``alpha`` in all. A null ruled out by the
    arithmetic (the challenger is behind by more than the examples left) gives infinite wealth.

    Example:
        >>> [round(w, 2) for w in evidence([0.0] * 4, [1.0] * 4)]  # four losses on an endless stream
        [0.47, 0.94, 1.41, 1.88]
        >>> evidence([0.0, 0.0], [1.0, 1.0], population=3)[-1]  # 2 behind, 1 left: cannot catch up
        inf
    """
    n = min(len(challenger), len(leader))
    xs = [float(b) - float(a) for a, b in zip(challenger[:n], leader[:n])]
    if not all(0.0 <= float(v) <= 1.0 for v in [*challenger[:n], *leader[:n]]):  # else a loss could cost more than all
        raise ConfigError("the 'anytime' pruner needs metric scores in [0, 1]",
                          fix='scale the metric to [0, 1], or pass pruner="confidence"')
    out: list[float] = []
    log_wealth, total = 0.0, 0.0
    for t, x in enumerate(xs):
        left = population - t if population is not None else None
        if left is not None and total - left > 1e-9:  # even winning every example left cannot catch up
            log_wealth = math.inf
        elif not math.isinf(log_wealth):
            m = -total / left if left else 0.0
            if 1.0 + m > 1e-12:  # m = -1: the null leaves every example left a loss for the leader; nothing to bet
                log_wealth += math.log1p(bet / (1.0 + m) * (x - m))
        out.append(log_wealth)
        total += x
    if population is not None and n and total - (population - n) > 1e-9:
        out[-1] = math.inf
    return out


def anytime_worse(challenger: Sequence[float], leader: Sequence[float], alpha: float = ALPHA,
                  population: int | None = None, bet: float = BET) -> bool:
    """Is ``challenger`` worse than ``leader``, by a test valid at every look: has the betting evidence
    (:func:`evidence`) against "the challenger's whole-valset score is at least the leader's" reached
    ``1 / alpha`` at any example so far? Looking after every example, or at any data-dependent time,
    prunes a challenger that is in truth at least as good as this leader with probability at most
    ``alpha`` in all. A challenger not behind so far is never pruned.

    Example:
        >>> anytime_worse([0.0] * 8 + [1.0] * 12, [1.0] * 20)  # 8 losses, no wins: log wealth 3.76 >= log 10
        True
        >>> anytime_worse([0.0] * 4 + [1.0] * 16, [1.0] * 20)  # 4 losses: McNemar's p = 1/16, but 1.88 < log 10
        False
        >>> anytime_worse([1.0, 0.0] * 30, [0.0, 1.0] * 30)    # a tie never prunes
        False
    """
    n = min(len(challenger), len(leader))
    if n == 0 or sum(challenger[:n]) >= sum(leader[:n]):  # not behind: a tie or better never prunes
        return False
    return max(evidence(challenger, leader, population, bet)) >= math.log(1.0 / alpha)


def _mcnemar_p(losses: int, wins: int, left: int | None, seen: int = 0) -> float:
    """One-sided p-value of ``losses`` against ``wins`` among the discordant pairs of ``seen`` examples
    (null: the challenger loses at most half of the set's discordant pairs). ``left=None``: McNemar's
    exact binomial test (an infinite population); otherwise the hypergeometric version over a finite
    set with ``left`` examples still unscored, whose unknown discordant count ``K`` is bounded the
    Berger-Boos way: the largest p over the ``K`` under which seeing ``d`` or fewer discordant pairs
    has probability ``GAMMA`` at least, plus ``GAMMA`` (the chance that ``K`` is above that bound).

    Example:
        >>> round(_mcnemar_p(15, 6, None), 4), round(_mcnemar_p(15, 6, 40, 60), 4)  # K <= 48 of 61 possible
        (0.0392, 0.0105)
    """
    d = losses + wins
    if left is None or left > FINITE_UP_TO:  # McNemar's binomial p bounds every hypergeometric one above
        from scipy.stats import binomtest

        return float(binomtest(losses, d, 0.5, alternative="greater").pvalue)
    import numpy as np
    from scipy.stats import hypergeom

    totals = np.arange(d, d + left + 1)  # the set's discordant pairs: those seen, plus any of the rest
    worst = hypergeom.sf(losses - 1, totals, totals // 2, d)
    if left == 0:
        return float(worst[0])  # everything seen: K is known, the test is exact
    plausible = hypergeom.cdf(d, seen + left, totals, seen) >= GAMMA  # K that leave d or fewer seen likely enough
    return float(min(1.0, np.max(worst[plausible]) + GAMMA))


def stratified_p(challenger: Sequence[float], reference: Sequence[float]) -> float:
    """One-sided p-value of "the challenger's whole-valset total is at least the reference's", from the
    challenger's 0/1 scores on a random prefix of the valset and the reference's 0/1 scores on all of it
    (same order), stratified by the reference's score.

    Stratum ``s`` (the examples the reference got wrong, right) has ``N_s`` examples, ``n_s`` of them
    scored, ``k_s`` right; the statistic is the estimate ``sum N_s k_s / n_s`` of the challenger's total
    (strata with nothing scored left out). Under a split ``C_0 + C_1`` of the challenger's total, ``k_s``
    is hypergeometric (``N_s``, ``C_s``, ``n_s``), independent across strata given the ``n_s``. The
    null is ``C_0 + C_1 >= T`` (the reference's total); a lower ``C_s`` only makes a low estimate more
    likely, so the largest ``P(estimate <= observed)`` is on ``C_0 + C_1 = T``. Splits the scored
    examples rule out (``C_s < k_s``, or more wrong answers than stratum ``s`` has left) are left out:
    the true split is never among them, so the p-value stays valid, and it is 0 when no split reaching
    ``T`` is possible (the challenger cannot catch up).

    Example:
        >>> reference = [1.0, 0.0] * 50  # 50 right of 100, in the valset's (shuffled) order
        >>> stratified_p([1.0, 0.0] * 10, reference)  # right where the reference is: on course for 50
        1.0
        >>> round(stratified_p([1.0, 0.0] * 6 + [0.0, 0.0] * 4, reference), 3)  # 6 of its 10 right: 30 of 50
        0.04
        >>> stratified_p([0.0] * 20, [1.0] * 20 + [0.0] * 80)  # its 20 right ones may be among the 80 left
        1.0
    """
    import numpy as np
    from scipy.stats import hypergeom

    m = len(challenger)
    ref = np.asarray(reference, dtype=float)
    mine = np.asarray(challenger, dtype=float)
    total = round(float(ref.sum()))
    size = [int((ref == s).sum()) for s in (0, 1)]
    seen = [int((ref[:m] == s).sum()) for s in (0, 1)]
    right = [int(mine[ref[:m] == s].sum()) for s in (0, 1)]
    values, lows, highs = [], [], []
    for s in (0, 1):
        lows.append(right[s])
        highs.append(size[s] - (seen[s] - right[s]))
        ks = np.arange(seen[s] + 1)
        values.append(size[s] * ks / seen[s] if seen[s] else np.zeros(1))
    observed = sum(size[s] * right[s] / seen[s] for s in (0, 1) if seen[s])
    c0 = np.arange(max(lows[0], total - highs[1]), min(highs[0], total - lows[1]) + 1)
    if c0.size == 0:  # no split of a total >= T fits what is seen: behind for certain, or ahead for certain
        return 0.0 if sum(highs) < total else 1.0
    pmfs = [hypergeom.pmf(np.arange(seen[s] + 1)[None, :], size[s], c[:, None], seen[s]) if seen[s]
            else np.ones((c.size, 1)) for s, c in ((0, c0), (1, total - c0))]
    at_most = (values[0][:, None] + values[1][None, :]) <= observed + 1e-9
    return float(min(1.0, np.max(np.einsum("ci,ij,cj->c", pmfs[0], at_most, pmfs[1]))))


def stratified_worse(challenger: Sequence[float], reference: Sequence[float], alpha: float = ALPHA) -> bool:
    """Is ``challenger`` (scored on a random prefix of the valset) worse on the whole valset than
    ``reference`` (scored on all of it), at one-sided level ``alpha``? 0/1 scores: the stratified exact
    test (:func:`stratified_p`); graded ones: the paired bound of :func:`worse_than` against the
    reference's prefix. A challenger whose estimated total is not below the reference's never prunes.

    Example:
        >>> reference = [1.0, 0.0] * 50
        >>> stratified_worse([0.0, 1.0] * 10, reference)  # right exactly where the reference is wrong: a tie
        False
        >>> stratified_worse([1.0, 0.0] * 5 + [0.0, 0.0] * 5, reference)
        True
    """
    m, n = len(challenger), len(reference)
    if m == 0 or m > n:
        return False
    if not (_binary(challenger) and _binary(reference)):
        return worse_than(challenger, reference[:m], alpha, population=n)
    ref = list(reference)
    estimate = 0.0
    for s in (0.0, 1.0):
        size = sum(1 for r in ref if r == s)
        scored = [c for c, r in zip(challenger, ref[:m]) if r == s]
        estimate += size * sum(scored) / len(scored) if scored else size  # nothing scored there: could be all right
    if estimate >= sum(ref):  # not behind: a tie or better never prunes
        return False
    return stratified_p(challenger, ref) < alpha
