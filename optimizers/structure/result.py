"""What a structure search measures and returns: one workflow's :class:`Evaluation`, the search's
:class:`SearchResult`, and the replay of its edits.

Example:
    >>> from flowopt.optimizers.structure.result import as_evaluation
    >>> as_evaluation(0.75).score
    0.75
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowopt.errors import ConfigError
from flowopt.optimizers.structure.edits import Edit, edit_from_dict
from flowopt.optimizers.structure.pareto import pareto_point, pick_point
from flowopt.optimizers.structure.tree import SearchTree
from flowopt.workflow import Workflow


@dataclass
class Evaluation:
    """A workflow's score on the search split, and a few examples it failed (shown to LM proposers).

    ``scores`` (one per example) give the node's confidence interval; ``cost`` is what one example cost
    on average (``{"lm_calls": ..., "tokens": ...}``).
    """

    score: float
    failures: list[dict[str, Any]] = field(default_factory=list)
    scores: list[float] | None = None
    cost: dict[str, float] = field(default_factory=dict)


Evaluator = Callable[[Workflow], "float | Evaluation | Any"]


@dataclass
class SearchResult:
    """The best workflow found, the edits that lead to it from the initial one, and the whole tree."""

    best: Workflow
    best_score: float  # as measured during the search (its mean)
    best_node: int
    edits: list[Edit]
    tree: SearchTree
    log: list[dict[str, Any]]
    rounds: int
    evaluations: int
    stop_reason: str
    best_interval: tuple[float, float] = (0.0, 0.0)  # 95% interval of the returned workflow's score
    remeasured: dict[str, Any] | None = None  # {"score", "interval", "n"} on fresh examples, if finals ran
    finalists: list[dict[str, Any]] = field(default_factory=list)

    def front(self) -> list[dict[str, Any]]:
        """The score/LM-calls Pareto front (fewest calls first), as report points (see :func:`pareto_point`)."""
        return [pareto_point(n, with_workflow=True) for n in self.tree.pareto_front()]

    def pick(self, *, max_calls: float | None = None, max_tokens: float | None = None) -> Workflow:
        """The best-scoring workflow of the front within a cost limit (LM calls and/or tokens per example).

        Example (a toy evaluator: each node adds 0.1 to the score and one LM call per example):
            >>> from flowopt import Workflow
            >>> from flowopt.modules import Predict
            >>> from flowopt.optimizers.structure import MCTS, Evaluation, RuleProposer, SearchSettings
            >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
            >>> toy = lambda w: Evaluation(0.5 + 0.1 * len(w.nodes), cost={"lm_calls": float(len(w.nodes))})
            >>> result = MCTS(RuleProposer(), toy, SearchSettings(max_rounds=6, objective="pareto")).run(wf)
            >>> len(result.pick(max_calls=2).nodes) <= 2
            True
        """
        point = pick_point(self.front(), max_calls=max_calls, max_tokens=max_tokens)
        return self._rebuild(point["workflow"])

    def _rebuild(self, ir: dict[str, Any]) -> Workflow:
        wf = Workflow.from_dict(ir)
        wf.lms.update({k: v for k, v in self.best.lms.items() if k in wf.lms})
        return wf

    def summary(self) -> dict[str, Any]:
        best = self.tree.nodes[self.best_node]
        return {"best_score": self.best_score, "best_interval": list(self.best_interval),
                "remeasured": self.remeasured, "best_cost": dict(best.cost), "best_node": self.best_node,
                "edits": [e.to_dict() for e in self.edits], "edit_descriptions": [e.describe() for e in self.edits],
                "rounds": self.rounds, "evaluations": self.evaluations, "stop_reason": self.stop_reason,
                "finalists": self.finalists,
                "pareto_front": [pareto_point(n) for n in self.tree.pareto_front()]}


def replay(program: Workflow, edits: Sequence[Edit | Mapping[str, Any]]) -> Workflow:
    """Apply a sequence of edits (objects or their dicts, e.g. from a search log) to ``program``.

    Example:
        >>> from flowopt import Workflow
        >>> from flowopt.modules import Predict
        >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
        >>> replay(wf, [{"kind": "wrap_ensemble", "node": "solve", "n": 3}]).nodes["solve"].op_name
        'ScEnsemble'
    """
    current = program
    for edit in edits:
        current = (edit if isinstance(edit, Edit) else edit_from_dict(edit)).apply(current)
    return current


def replay_log(program: Workflow, log: Sequence[Mapping[str, Any]]) -> dict[int, Workflow]:
    """Rebuild every tree node's workflow from a search log (node id -> workflow), checking each edit."""
    workflows = {0: program}
    for event in log:
        if event.get("event") == "expand":
            workflows[event["child"]] = replay(workflows[event["parent"]], [event["edit"]])
    return workflows


def as_evaluation(value: Any) -> Evaluation:
    """An evaluator's answer as an :class:`Evaluation`: a float, an :class:`Evaluation`, or any object
    with a numeric ``.score`` (and optionally ``.scores``, ``.failures`` and ``.cost``).

    Example:
        >>> as_evaluation(0.5)
        Evaluation(score=0.5, failures=[], scores=None, cost={})
    """
    if isinstance(value, Evaluation):
        return value
    if isinstance(value, int | float):
        return Evaluation(float(value))
    score = getattr(value, "score", None)
    if isinstance(score, int | float):
        scores = getattr(value, "scores", None)
        return Evaluation(float(score), list(getattr(value, "failures", []) or []),
                          [float(x) for x in scores] if scores else None, dict(getattr(value, "cost", {}) or {}))
    raise ConfigError(f"the evaluator returned {value!r}, not a score",
                      fix="return a float in 0..1, an Evaluation, or an object with .score")
