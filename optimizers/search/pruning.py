"""When to stop scoring a candidate: the minibatch schedule and the pruning rules.

Every candidate is scored on the same shuffled valset, rung by rung (cumulative prefixes of it), so
at each rung all live candidates have scores on the same examples. The rules, given those scores:

* ``"confidence"`` (the default, honest one): compare each challenger with the leader (the best mean
  so far) example by example. With 0/1 scores: McNemar's exact test on the examples where exactly
  one of the two is right; otherwise a one-sided paired normal bound on the mean difference. Prune
  only when the challenger is worse at one-sided level ``alpha`` (0.05). A tie never prunes.
* ``"halving"``: successive halving. Keep the best ``1/reduction_factor`` of the challengers scored
  that far and everyone tied with the last kept; the incumbent is ranked with nobody (it never takes
  a keep slot).
* ``"median"``: prune a challenger strictly below the median of all candidates scored that far.

The incumbent (the program the stage starts from) is never pruned. The first rung is at least
``max(20, 25% of the valset)`` examples, so no decision rests on a handful of examples.

Example:
    >>> from flowopt.optimizers.search.pruning import first_rung, rungs, worse_than
    >>> first_rung(100), rungs(100, 25, growth=1.5)
    (25, [25, 38, 56, 84, 100])
    >>> worse_than([0.0] * 10 + [1.0] * 15, [1.0] * 25)  # 10 discordant pairs, all against: p = 0.001
    True
    >>> worse_than([1.0, 0.0] * 15, [0.0, 1.0] * 15)      # a tie never prunes
    False
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

PRUNE_RULES = ("confidence", "halving", "median", "none")
MIN_FIRST_RUNG = 20
ALPHA = 0.05


def first_rung(n: int, requested: int | None = None) -> int:
    """The first rung: ``requested`` or ``max(20, 25% of n)``, never below that floor, at most ``n``."""
    floor = max(MIN_FIRST_RUNG, math.ceil(0.25 * n))
    return min(n, max(floor, requested or 0))


def rungs(n: int, first: int, growth: float = 2.0) -> list[int]:
    """Cumulative minibatch ends: first, first*growth, first*growth^2, ..., n."""
    out: list[int] = []
    size = float(max(1, first))
    while round(size) < n:
        if not out or round(size) > out[-1]:
            out.append(round(size))
        size *= growth
    return [*out, n] if n else [0]


def _binary(values: Sequence[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def worse_than(challenger: Sequence[float], leader: Sequence[float], alpha: float = ALPHA) -> bool:
    """Is ``challenger`` worse than ``leader`` on these paired scores, at one-sided level ``alpha``?

    0/1 scores: McNemar's exact test (a one-sided binomial test on the discordant pairs). Other
    scores: the upper ``1 - alpha`` normal bound of the mean paired difference is below 0.
    """
    n = min(len(challenger), len(leader))
    if n == 0:
        return False
    a, b = list(challenger[:n]), list(leader[:n])
    if sum(a) >= sum(b):  # not behind: a tie or better never prunes
        return False
    if _binary(a) and _binary(b):
        from scipy.stats import binomtest

        losses = sum(1 for x, y in zip(a, b) if x < y)
        wins = sum(1 for x, y in zip(a, b) if x > y)
        return bool(binomtest(losses, losses + wins, 0.5, alternative="greater").pvalue < alpha)
    from scipy.stats import norm

    diffs = [x - y for x, y in zip(a, b)]
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else 0.0
    return mean + norm.ppf(1 - alpha) * sd / math.sqrt(n) < 0


def to_prune(rule: str, live: Mapping[int, Sequence[float]], others: Mapping[int, Sequence[float]], step: int,
             incumbent: int | None, *, reduction_factor: int = 3, alpha: float = ALPHA) -> set[int]:
    """Which ``live`` candidates to prune at the rung ending at example ``step``.

    ``live`` maps candidate numbers to their scores so far (at least ``step`` of them, in valset
    order); ``others`` holds candidates of earlier waves (finished or pruned), compared on their first
    ``step`` scores when they have that many. ``incumbent`` is never pruned and takes no keep slot.
    """
    if rule == "none":
        return set()
    scored = {k: list(v[:step]) for k, v in {**others, **live}.items() if len(v) >= step}
    challengers = [k for k in live if k != incumbent]
    if rule == "confidence":
        leader = max(scored, key=lambda k: (sum(scored[k]), -k))
        return {k for k in challengers if k != leader and worse_than(scored[k], scored[leader], alpha)}
    means = {k: statistics.fmean(v) if v else 0.0 for k, v in scored.items()}
    if len(means) < 3:
        return set()
    if rule == "median":
        middle = statistics.median(means.values())
        return {k for k in challengers if means[k] < middle}
    if rule == "halving":
        ranked = sorted((k for k in means if k != incumbent), key=lambda k: (-means[k], k))
        kept = ranked[: math.ceil(len(ranked) / reduction_factor)]
        bar = min(means[k] for k in kept) if kept else float("-inf")
        return {k for k in challengers if means[k] < bar}  # everyone tied with the last kept stays
    raise ValueError(f"unknown pruning rule {rule!r}")
