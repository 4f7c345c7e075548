"""Baselines for structure search: a random walk of uniform random edits, and greedy hill climbing.

Both count evaluations the way :class:`~flowopt.optimizers.structure.search.MCTS` does (evaluator calls;
a workflow with the same canonical JSON is scored once per run) and return a :class:`BaselineResult`:
the best workflow found, its score, and the trace ``[(evaluation index, score), ...]`` so the methods
can be compared on evaluations-to-best.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from flowopt.optimizers.structure.proposers import NoProposal, ProposalContext, RuleProposer
from flowopt.optimizers.structure.result import as_evaluation
from flowopt.optimizers.structure.tree import workflow_key
from flowopt.workflow import Workflow

Trace = list[tuple[int, float]]


@dataclass
class BaselineResult:
    """What a baseline found: the best workflow, its score, and every evaluation in order."""

    best: Workflow
    best_score: float
    trace: Trace = field(default_factory=list)
    restarts: int = 0

    @property
    def evaluations(self) -> int:
        return len(self.trace)


class _Scorer:
    def __init__(self, evaluate: Callable[[Workflow], object]) -> None:
        self.evaluate = evaluate
        self.scores: dict[str, float] = {}
        self.trace: Trace = []
        self.best: tuple[float, Workflow] | None = None

    def __call__(self, workflow: Workflow) -> float:
        key = workflow_key(workflow.canonical_json())
        if key not in self.scores:
            self.scores[key] = as_evaluation(self.evaluate(workflow)).score
            self.trace.append((len(self.trace) + 1, self.scores[key]))
            if self.best is None or self.scores[key] > self.best[0]:
                self.best = (self.scores[key], workflow)
        return self.scores[key]

    def result(self, restarts: int = 0) -> BaselineResult:
        assert self.best is not None
        return BaselineResult(self.best[1], self.best[0], self.trace, restarts)


def random_walk(program: Workflow, proposer: RuleProposer, evaluate: Callable[[Workflow], object], *,
                seed: int = 0, max_evaluations: int = 100, target: float | None = None,
                max_steps: int | None = None) -> BaselineResult:
    """Apply uniformly random valid edits one after another, scoring every new workflow.

    Example:
        >>> from flowopt import Workflow
        >>> from flowopt.modules import Predict
        >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
        >>> walk = random_walk(wf, RuleProposer(), lambda w: len(w.nodes) / 10, max_evaluations=3)
        >>> [i for i, _ in walk.trace], len(walk.best.nodes) / 10 == walk.best_score
        ([1, 2, 3], True)
    """
    rng = random.Random(seed)
    score = _Scorer(evaluate)
    current = program
    score(current)
    steps = 0
    while len(score.trace) < max_evaluations and (max_steps is None or steps < max_steps):
        if target is not None and score.best is not None and score.best[0] >= target - 1e-9:
            break
        proposal = proposer.propose(current, ProposalContext(score=0.0), rng)
        current = proposal.workflow
        score(current)
        steps += 1
        if max_steps is None and steps > 100 * max_evaluations:  # a space with nothing new left
            break
    return score.result()


MAX_FRUITLESS_RESTARTS = 20


def hill_climb(program: Workflow, proposer: RuleProposer, evaluate: Callable[[Workflow], object], *,
               seed: int = 0, max_evaluations: int = 100, target: float | None = None,
               restarts: bool = True, restart_steps: int = 3) -> BaselineResult:
    """Steepest ascent: score every valid edit of the current workflow (in a seeded random order), move to
    the best if it beats the current score. At a local optimum, restart (``restarts=True``) from
    ``restart_steps`` random edits away from the initial workflow, until the evaluations are spent.

    Example:
        >>> from flowopt import Workflow
        >>> from flowopt.modules import Predict
        >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
        >>> climb = hill_climb(wf, RuleProposer(), lambda w: -len(w.nodes), max_evaluations=5)
        >>> climb.best_score, climb.evaluations
        (-1.0, 5)
    """
    rng = random.Random(seed)
    score = _Scorer(evaluate)
    current, current_score = program, score(program)
    n_restarts = fruitless = 0
    seen = len(score.trace)
    while len(score.trace) < max_evaluations:
        neighbours = proposer.valid_edits(current)
        rng.shuffle(neighbours)
        best, best_score = None, current_score
        for _edit, new in neighbours:
            if len(score.trace) >= max_evaluations:
                break
            s = score(new)
            if target is not None and s >= target - 1e-9:
                return score.result(n_restarts)
            if s > best_score:
                best, best_score = new, s
        if best is not None:
            current, current_score = best, best_score
            continue
        if not restarts:
            break
        # A climb that scored nothing new: after enough of them in a row, what is reachable is scored.
        fruitless = fruitless + 1 if len(score.trace) == seen else 0
        seen = len(score.trace)
        if fruitless >= MAX_FRUITLESS_RESTARTS or len(score.trace) >= max_evaluations:
            break
        current = program
        for _ in range(restart_steps):
            try:
                current = proposer.propose(current, ProposalContext(score=0.0), rng).workflow
            except NoProposal:
                break
        current_score = score(current)
        n_restarts += 1
    return score.result(n_restarts)
