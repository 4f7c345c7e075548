"""The search's pruning rules: one :class:`Pruner` class per rule, found by name in a registry.

A rule sees one :class:`Look` (every live candidate's scores up to the same example of the shared,
shuffled valset order, and the scores of earlier candidates) and says which live candidates to stop,
with the reason for each (the report shows it). It also says where its looks fall
(:meth:`Pruner.rung_ends`). The statistical tests the rules use live in
:mod:`~flowopt.optimizers.search.pruning`.

Built-in rules: ``"confidence"`` (the default), ``"stratified"``, ``"anytime"``, ``"halving"``,
``"median"`` and ``"none"``. ``RandomSearch(pruner=...)`` takes the name of a registered rule; a
user's own rule plugs in with :func:`register_pruner` (or the ``flowopt.pruners`` entry-point group).
The incumbent (the program the search starts from) is never pruned, by any rule.

Example:
    >>> from flowopt.optimizers.search.pruners import Look, Pruner, get_pruner, register_pruner
    >>> @register_pruner
    ... class BelowHalf(Pruner):
    ...     '''Prune a challenger whose mean so far is below 0.5.'''
    ...     name = "below-half"
    ...     def prune(self, look):
    ...         means = look.means()
    ...         return {k: f"mean {means[k]:.2f} < 0.5" for k in look.challengers() if means[k] < 0.5}
    >>> get_pruner("below-half")().prune(Look({1: [1.0, 1.0], 2: [0.0, 1.0], 3: [0.0, 0.0]}, {}, 2, incumbent=1))
    {3: 'mean 0.00 < 0.5'}
"""

from __future__ import annotations

import abc
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from flowopt.errors import ConfigError
from flowopt.optimizers.search.pruning import (
    ALPHA,
    anytime_worse,
    first_look,
    first_rung,
    looks,
    rungs,
    stratified_worse,
    worse_than,
)
from flowopt.plugins import Registry

ENTRY_POINT_GROUP = "flowopt.pruners"


@dataclass(frozen=True)
class Look:
    """What a rule judges at one look: ``live`` maps candidate numbers to their scores so far (at least
    ``step`` of them, in valset order); ``others`` holds candidates of earlier waves (finished or
    pruned), compared on their first ``step`` scores when they have that many. ``incumbent`` is never
    pruned; ``population`` is the valset's size (``None``: unknown), for the finite-population tests.

    Example:
        >>> look = Look({0: [1.0, 0.0], 1: [1.0, 1.0]}, {7: [0.0]}, 2, incumbent=0)
        >>> look.challengers(), look.means()
        ([1], {0: 0.5, 1: 1.0})
    """

    live: Mapping[int, Sequence[float]]
    others: Mapping[int, Sequence[float]]
    step: int
    incumbent: int | None = None
    population: int | None = None

    def scored(self) -> dict[int, list[float]]:
        """Every candidate with ``step`` scores, cut to its first ``step``."""
        return {k: list(v[: self.step]) for k, v in {**self.others, **self.live}.items() if len(v) >= self.step}

    def challengers(self) -> list[int]:
        """The live candidates that may be pruned (all but the incumbent)."""
        return [k for k in self.live if k != self.incumbent]

    def means(self) -> dict[int, float]:
        """Each scored candidate's mean on the first ``step`` examples."""
        return {k: statistics.fmean(v) if v else 0.0 for k, v in self.scored().items()}


class Pruner(abc.ABC):
    """A pruning rule: which live candidates to stop at a look, and where the looks fall.

    ``alpha`` is the one-sided level of each prune decision of the testing rules; ``reduction_factor``
    successive halving's eta. Subclasses set ``name`` and implement :meth:`prune`; the default looks
    are rungs growing 2x from ``max(20, 25% of the valset)`` (a rank says nothing about significance,
    so it needs a sizeable sample).

    Example:
        >>> from flowopt.optimizers.search.pruners import get_pruner
        >>> get_pruner("halving")().rung_ends(100, None)
        [25, 50, 100]
    """

    name: ClassVar[str] = ""
    #: Whether the search scores each look's leader on the whole valset before judging (``stratified``).
    scores_leader_ahead: ClassVar[bool] = False

    def __init__(self, *, alpha: float = ALPHA, reduction_factor: int = 3) -> None:
        self.alpha = alpha
        self.reduction_factor = reduction_factor

    @abc.abstractmethod
    def prune(self, look: Look) -> dict[int, str]:
        """The live candidates to stop at this look, each with the reason, in words."""

    def rung_ends(self, n: int, minibatch_size: int | None) -> list[int]:
        """Where the looks end on a valset of ``n`` examples (cumulative counts; the last is ``n``)."""
        return rungs(n, first_rung(n, minibatch_size), 2.0)


class ConfidencePruner(Pruner):
    """``"confidence"``, the default: prune a challenger only when a paired test shows it worse than the
    leader (the best mean so far) on the *whole valset*, at one-sided level ``alpha`` per look.

    With 0/1 scores: McNemar's exact test on the examples where exactly one of the two is right; otherwise
    a one-sided paired normal bound on the mean difference. The scored prefix is a sample drawn without
    replacement from the finite valset (one shuffled order), so the test carries the finite-population
    correction: McNemar becomes its hypergeometric version (the unknown discordant count bounded the
    Berger-Boos way), the normal bound shrinks by ``sqrt((N - m) / (N - 1))``. Once every example is
    scored the verdict is exact; a challenger that cannot catch up is pruned with certainty. A tie
    never prunes. The first look is at 20 examples at least (:func:`~.pruning.first_look`), then one
    every 5% of the valset (:func:`~.pruning.looks`). Each look is a level-``alpha`` decision; over all
    of a candidate's looks the chance of pruning a whole-valset tie is above ``alpha`` and grows with
    the looks, which is why they are not finer (``benchmarks/results/search_generalisation.md`` gives
    the measured rates).

    Example:
        >>> ConfidencePruner().prune(Look({1: [1.0] * 25, 2: [1.0] * 19 + [0.0] * 6}, {}, 25))
        {2: 'worse than candidate 1 at one-sided 10%: 0.760 vs 1.000 on the first 25 examples (6 losses, 0 wins)'}
    """

    name = "confidence"

    def rung_ends(self, n: int, minibatch_size: int | None) -> list[int]:
        return looks(n, first_look(n, minibatch_size))

    def worse(self, challenger: Sequence[float], leader: Sequence[float], population: int | None) -> bool:
        """The rule's test: is ``challenger`` worse than ``leader`` on these paired scores?"""
        return worse_than(challenger, leader, self.alpha, population=population)

    def level(self) -> str:
        """The level of each prune, in words (for the reasons)."""
        return f"one-sided {self.alpha:.0%}"

    def prune(self, look: Look) -> dict[int, str]:
        scored, means = look.scored(), look.means()
        leader = max(scored, key=lambda k: (sum(scored[k]), -k))
        lead = scored[leader]
        out = {}
        for k in look.challengers():
            if k != leader and self.worse(scored[k], lead, look.population):
                losses = sum(1 for x, y in zip(scored[k], lead) if x < y)
                wins = sum(1 for x, y in zip(scored[k], lead) if x > y)
                out[k] = (f"worse than candidate {leader} at {self.level()}: {means[k]:.3f} vs "
                          f"{means[leader]:.3f} on the first {look.step} examples ({losses} losses, {wins} wins)")
        return out


class AnytimePruner(ConfidencePruner):
    """``"anytime"``: the confidence rule's question, by a test valid at every look at once.

    A bettor stakes a fixed share (:data:`~.pruning.BET`) of its wealth on each example against "the
    challenger's whole-valset score is at least the leader's", centred by what sampling without
    replacement leaves for the rest of the valset (:func:`~.pruning.evidence`; Waudby-Smith and
    Ramdas). Under that null the wealth is a nonnegative supermartingale, so it ever reaches
    ``1 / alpha`` with probability at most ``alpha`` (Ville's inequality): the rule looks after every
    example and still prunes a challenger that ties or beats its leader in at most ``alpha`` of orders,
    over all looks. It needs scores in [0, 1], and more evidence than one look of ``"confidence"``, so
    it stops a trailing candidate later.

    Example:
        >>> AnytimePruner().rung_ends(30, None)[:3]
        [20, 21, 22]
    """

    name = "anytime"

    def rung_ends(self, n: int, minibatch_size: int | None) -> list[int]:
        return looks(n, first_look(n, minibatch_size), every=1)  # valid at every look: look after every example

    def worse(self, challenger: Sequence[float], leader: Sequence[float], population: int | None) -> bool:
        return anytime_worse(challenger, leader, self.alpha, population=population)

    def level(self) -> str:
        return f"{self.alpha:.0%} over every look"


class StratifiedPruner(ConfidencePruner):
    """``"stratified"``: the confidence rule's looks and level, against a *fully scored* reference.

    The search scores the leader of each look on the whole valset at once (it is the likely pick, whose
    whole-valset scores the compiler's final check pays for anyway), and a challenger is tested against
    the best fully scored candidate, whose whole-valset total ``T`` is then known, not estimated. The
    valset splits into two strata by the reference's own 0/1 score on each example; the challenger's
    scored examples of a stratum are a uniform without-replacement sample of it, so the stratified
    estimate of its whole-valset total has an exact distribution for every split of its total
    (:func:`~.pruning.stratified_p`). Stratifying removes the part of the variance the examples'
    difficulty explains, and knowing ``T`` removes the leader's own sampling error. Scores must be 0/1
    (graded scores: the paired bound of ``"confidence"`` against the reference). Each look is an exact
    level-``alpha`` test, but over all looks it prunes a whole-valset tie more often than
    ``"confidence"`` does. With no fully scored candidate yet (or no known valset size) it is the
    confidence rule.

    Example:
        >>> StratifiedPruner().prune(Look({1: [1.0] * 20, 2: [0.0] * 20}, {}, 20, population=100))
        {2: 'worse than candidate 1 at one-sided 10%: 0.000 vs 1.000 on the first 20 examples (20 losses, 0 wins)'}
    """

    name = "stratified"
    scores_leader_ahead = True

    def prune(self, look: Look) -> dict[int, str]:
        population = look.population
        everyone = {**look.others, **look.live}
        full = {k: v for k, v in everyone.items() if len(v) == population} if population is not None else {}
        if not full:
            return super().prune(look)
        reference = max(full, key=lambda k: (sum(full[k]), -k))
        ref = list(full[reference])
        scored, means = look.scored(), look.means()
        out = {}
        for k in look.challengers():
            if k != reference and len(look.live[k]) < len(ref) and stratified_worse(scored[k], ref, self.alpha):
                out[k] = (f"worse than candidate {reference} (whole valset {statistics.fmean(ref):.3f}) at "
                          f"one-sided {self.alpha:.0%}, stratified by its scores: {means[k]:.3f} on the first "
                          f"{look.step} examples")
        return out


class HalvingPruner(Pruner):
    """``"halving"``: successive halving. Keep the best ``1/reduction_factor`` of the challengers scored
    that far and everyone tied with the last kept; the incumbent is ranked with nobody (it never takes a
    keep slot). Needs three scored candidates to rank.

    Example:
        >>> live = {0: [0.0] * 30, 1: [1.0] * 30, 2: [1.0] * 20 + [0.0] * 10, 3: [0.0] * 30}
        >>> sorted(HalvingPruner().prune(Look(live, {}, 30, incumbent=0)))
        [2, 3]
    """

    name = "halving"

    def prune(self, look: Look) -> dict[int, str]:
        means = look.means()
        if len(means) < 3:
            return {}
        ranked = sorted((k for k in means if k != look.incumbent), key=lambda k: (-means[k], k))
        kept = ranked[: math.ceil(len(ranked) / self.reduction_factor)]
        bar = min(means[k] for k in kept) if kept else float("-inf")
        # everyone tied with the last kept stays
        return {k: f"below the best 1/{self.reduction_factor} of the challengers (bar {bar:.3f}): {means[k]:.3f} "
                   f"on the first {look.step} examples" for k in look.challengers() if means[k] < bar}


class MedianPruner(Pruner):
    """``"median"``: prune a challenger strictly below the median of all candidates scored that far
    (three at least).

    Example:
        >>> MedianPruner().prune(Look({1: [1.0] * 20, 2: [0.5] * 20, 3: [0.0] * 20}, {}, 20))
        {3: 'below the median 0.500 of 3 candidates: 0.000 on the first 20 examples'}
    """

    name = "median"

    def prune(self, look: Look) -> dict[int, str]:
        means = look.means()
        if len(means) < 3:
            return {}
        middle = statistics.median(means.values())
        return {k: f"below the median {middle:.3f} of {len(means)} candidates: {means[k]:.3f} on the first "
                   f"{look.step} examples" for k in look.challengers() if means[k] < middle}


class NoPruner(Pruner):
    """``"none"``: score every candidate on the whole valset, in one look.

    Example:
        >>> NoPruner().rung_ends(100, None)
        [100]
    """

    name = "none"

    def prune(self, look: Look) -> dict[int, str]:
        return {}

    def rung_ends(self, n: int, minibatch_size: int | None) -> list[int]:
        return [n]


# ---------------------------------------------------------------------------------------------- registry
PrunerT = TypeVar("PrunerT", bound=type[Pruner])


def _pruner_name(cls: object) -> str:
    if not (isinstance(cls, type) and issubclass(cls, Pruner)):
        raise ConfigError(f"{cls!r} is not a Pruner subclass",
                          fix="subclass flowopt.optimizers.search.pruners.Pruner")
    if not cls.name:
        raise ConfigError(f"pruner class {cls.__name__} has no name", fix='set name = "mine" on the class')
    return cls.name


PRUNERS: Registry[type[Pruner]] = Registry("pruner", ENTRY_POINT_GROUP, _pruner_name,
                                           how_to_add="register yours with register_pruner")


def register_pruner(cls: PrunerT) -> PrunerT:
    """Register a :class:`Pruner` class under its ``name`` (usable as a decorator); ``RandomSearch``
    then takes ``pruner=<name>``."""
    PRUNERS.register(cls)
    return cls


def get_pruner(name: str) -> type[Pruner]:
    """The pruner class registered as ``name``; raises :class:`ConfigError` listing the known names."""
    return PRUNERS.get(name)


def pruner_names() -> list[str]:
    """The registered pruner names (built-in ones first)."""
    return PRUNERS.names()


for _builtin in (ConfidencePruner, StratifiedPruner, AnytimePruner, HalvingPruner, MedianPruner, NoPruner):
    register_pruner(_builtin)

#: The built-in rules' names.
PRUNE_RULES = ("confidence", "stratified", "anytime", "halving", "median", "none")


def verdicts(rule: str, live: Mapping[int, Sequence[float]], others: Mapping[int, Sequence[float]], step: int,
             incumbent: int | None, *, reduction_factor: int = 3, alpha: float = ALPHA,
             population: int | None = None) -> dict[int, str]:
    """The candidates rule ``rule`` prunes at the look ending at example ``step``, with the reason for each.

    Example:
        >>> verdicts("confidence", {1: [1.0] * 25, 2: [1.0] * 19 + [0.0] * 6}, {}, 25, None)
        {2: 'worse than candidate 1 at one-sided 10%: 0.760 vs 1.000 on the first 25 examples (6 losses, 0 wins)'}
    """
    pruner = get_pruner(rule)(alpha=alpha, reduction_factor=reduction_factor)
    return pruner.prune(Look(live, others, step, incumbent, population))


def to_prune(rule: str, live: Mapping[int, Sequence[float]], others: Mapping[int, Sequence[float]], step: int,
             incumbent: int | None, *, reduction_factor: int = 3, alpha: float = ALPHA,
             population: int | None = None) -> set[int]:
    """:func:`verdicts` without the reasons."""
    return set(verdicts(rule, live, others, step, incumbent, reduction_factor=reduction_factor, alpha=alpha,
                        population=population))
