"""Baselines for structure search: a random walk of uniform random edits, and greedy hill climbing.

Both count evaluations the way :class:`~flowopt.optimizers.structure.search.MCTS` does (a workflow
with the same canonical JSON is scored once per run) and return the trace
``[(evaluation index, score), ...]`` so the methods can be compared on evaluations-to-best.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from flowopt.optimizers.structure.proposers import ProposalContext, RuleProposer
from flowopt.optimizers.structure.search import _as_evaluation
from flowopt.optimizers.structure.tree import workflow_key
from flowopt.workflow import Workflow

Trace = list[tuple[int, float]]


class _Scorer:
    def __init__(self, evaluate: Callable[[Workflow], object]) -> None:
        self.evaluate = evaluate
        self.scores: dict[str, float] = {}
        self.trace: Trace = []

    def __call__(self, workflow: Workflow) -> float:
        key = workflow_key(workflow.canonical_json())
        if key not in self.scores:
            self.scores[key] = _as_evaluation(self.evaluate(workflow)).score
            self.trace.append((len(self.trace) + 1, self.scores[key]))
        return self.scores[key]


def random_walk(program: Workflow, proposer: RuleProposer, evaluate: Callable[[Workflow], object], *,
                seed: int = 0, max_evaluations: int = 100, target: float | None = None,
                max_steps: int | None = None) -> Trace:
    """Apply uniformly random valid edits one after another, scoring every new workflow.

    Example:
        >>> from flowopt import Workflow
        >>> from flowopt.modules import Predict
        >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
        >>> trace = random_walk(wf, RuleProposer(), lambda w: len(w.nodes) / 10, max_evaluations=3)
        >>> [i for i, _ in trace]
        [1, 2, 3]
    """
    rng = random.Random(seed)
    score = _Scorer(evaluate)
    current = program
    score(current)
    steps = 0
    while len(score.trace) < max_evaluations and (max_steps is None or steps < max_steps):
        if target is not None and max(s for _, s in score.trace) >= target - 1e-9:
            break
        proposal = proposer.propose(current, ProposalContext(score=0.0), rng)
        current = proposal.workflow
        score(current)
        steps += 1
        if max_steps is None and steps > 100 * max_evaluations:  # a space with nothing new left
            break
    return score.trace


def hill_climb(program: Workflow, proposer: RuleProposer, evaluate: Callable[[Workflow], object], *,
               seed: int = 0, max_evaluations: int = 100, target: float | None = None) -> Trace:
    """Steepest ascent: score every valid edit of the current workflow (in a seeded random order),
    move to the best if it beats the current score, stop at a local optimum."""
    rng = random.Random(seed)
    score = _Scorer(evaluate)
    current, current_score = program, score(program)
    while len(score.trace) < max_evaluations:
        neighbours = proposer.valid_edits(current)
        rng.shuffle(neighbours)
        best, best_score = None, current_score
        for _edit, new in neighbours:
            if len(score.trace) >= max_evaluations:
                break
            s = score(new)
            if target is not None and s >= target - 1e-9:
                return score.trace
            if s > best_score:
                best, best_score = new, s
        if best is None:
            break
        current, current_score = best, best_score
    return score.trace
