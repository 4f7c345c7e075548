"""Picking from the score/cost Pareto front of a structure search: its points as report data, and the
best point within a cost limit.

Example:
    >>> from flowopt.optimizers.structure.pareto import pick_point
    >>> pick_point([{"score": 0.6, "lm_calls": 1.0}, {"score": 0.8, "lm_calls": 5.0}], max_calls=3)["score"]
    0.6
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from flowopt.errors import ConfigError
from flowopt.optimizers.structure.tree import TreeNode


def pareto_point(node: TreeNode, *, with_workflow: bool = False) -> dict[str, Any]:
    """One point of the score/cost front, for reports: the node, its score, interval and cost (and its
    workflow's IR, so that a point can be picked later)."""
    point: dict[str, Any] = {"node": node.id, "score": node.score, "interval": list(node.interval), **node.cost,
                             "description": node.description}
    if with_workflow:
        point["workflow"] = node.workflow
    return point


def pick_point(front: Sequence[Mapping[str, Any]], *, max_calls: float | None = None,
               max_tokens: float | None = None) -> Mapping[str, Any]:
    """The highest-scoring point of ``front`` with ``lm_calls <= max_calls`` and ``tokens <= max_tokens``.

    Example:
        >>> front = [{"score": 0.6, "lm_calls": 1.0}, {"score": 0.8, "lm_calls": 5.0}]
        >>> pick_point(front, max_calls=3)["score"]
        0.6
    """
    if not front:
        raise ConfigError("there is no score/cost front to pick from (no candidate reported its cost)",
                          fix="run the search with an evaluator that reports cost={'lm_calls': ...}")
    limits = {"lm_calls": max_calls, "tokens": max_tokens}
    fits = [p for p in front if all(v is None or p.get(k, math.inf) <= v for k, v in limits.items())]
    if not fits:
        cheapest = min(front, key=lambda p: p.get("lm_calls", math.inf))
        raise ConfigError(f"no point of the front fits max_calls={max_calls}, max_tokens={max_tokens}; the "
                          f"cheapest takes {cheapest.get('lm_calls')} LM calls and {cheapest.get('tokens')} tokens "
                          "per example", fix="raise the limit")
    return max(fits, key=lambda p: (p["score"], -p.get("lm_calls", 0.0)))
