"""The settings of a structure search (:class:`SearchSettings`), shared by :class:`~.search.MCTS` and
the ``structure`` stage, which holds one.

Example:
    >>> from flowopt.optimizers.structure.search_settings import SearchSettings
    >>> SearchSettings(max_rounds=10, selection="uct").selection
    'uct'
"""

from __future__ import annotations

from dataclasses import dataclass

from flowopt.settings import above, at_least, between, check_stage, one_of

SELECTIONS = ("auto", "climb", "best_first", "mixed", "uct")
OBJECTIVES = ("score", "penalised", "pareto")


@dataclass(frozen=True)
class SearchSettings:
    """Settings of :class:`~flowopt.optimizers.structure.search.MCTS` (and of the ``structure`` stage,
    which holds one); bad values raise :class:`~flowopt.errors.ConfigError` with the fix.

    Settings:
        max_rounds: new candidates to score (a duplicate edit uses no round).
        selection: which node to expand: ``"auto"`` (``"climb"``, or ``"best_first"`` when
            ``confirm`` > 1), ``"climb"`` (iterated local search, first improvement), ``"best_first"``
            (the highest upper 95% bound), ``"mixed"`` (AFlow's) or ``"uct"``.
        explore: the chance of expanding a random open node instead (``climb``, ``best_first``).
        top_k: ``mixed`` selection's candidates, and the leaders whose mean convergence watches.
        alpha: ``mixed`` selection's softmax scale on scores.
        lambda_: ``mixed`` selection's share of uniform choice.
        uct_c: UCT's exploration constant.
        widen: UCT's progressive widening: a node may have up to ``max(1, widen * sqrt(visits))`` children.
        convergence_rounds: stop when the top-``top_k`` mean has not moved for this many rounds
            (``None``: never).
        convergence_eps: how little a move of that mean counts as none.
        repeats: measurements of each candidate (each an evaluator call).
        max_evaluations: a cap on evaluator calls, repeats and finals included (``None``: none).
        final_top: leaders re-measured on fresh examples at the end (0: no finals).
        final_repeats: each finalist's first measurements in the finals.
        objective: ``"score"``, ``"penalised"`` (score minus ``cost_weight`` x LM calls per example) or
            ``"pareto"`` (climb by score, restart from points of the score/cost front).
        cost_weight: the LM-call penalty of ``"penalised"``.
        confirm: measurements a node needs before it is expanded (re-measures lucky leaders under noise).

    Example:
        >>> SearchSettings(max_rounds=10, selection="uct").selection
        'uct'
    """

    max_rounds: int = 20
    selection: str = "auto"
    explore: float = 0.0
    top_k: int = 4
    alpha: float = 0.2
    lambda_: float = 0.3
    uct_c: float = 1.4
    widen: float = 1.0
    convergence_rounds: int | None = 8
    convergence_eps: float = 1e-4
    repeats: int = 1
    max_evaluations: int | None = None
    final_top: int = 0
    final_repeats: int = 1
    objective: str = "score"
    cost_weight: float = 0.0
    confirm: int = 1

    def __post_init__(self) -> None:
        check_stage(self, {
            "max_rounds": at_least(1), "selection": one_of(*SELECTIONS), "explore": between(0.0, 1.0),
            "top_k": at_least(1), "alpha": at_least(0.0), "lambda_": between(0.0, 1.0), "uct_c": at_least(0.0),
            "widen": above(0.0), "convergence_rounds": at_least(1), "convergence_eps": at_least(0.0),
            "repeats": at_least(1), "max_evaluations": at_least(1), "final_top": at_least(0),
            "final_repeats": at_least(1), "objective": one_of(*OBJECTIVES), "cost_weight": at_least(0.0),
            "confirm": at_least(1),
        })

    def resolved_selection(self) -> str:
        """The selection a search runs: ``selection``, with ``auto`` read as ``best_first`` when leaders
        are re-measured (``confirm`` > 1, i.e. under noise) and as ``climb`` otherwise.

        Example:
            >>> SearchSettings().resolved_selection(), SearchSettings(confirm=3).resolved_selection()
            ('climb', 'best_first')
        """
        if self.selection != "auto":
            return self.selection
        return "best_first" if self.confirm > 1 else "climb"
