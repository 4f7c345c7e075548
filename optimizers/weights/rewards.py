"""A rollout's reward: the metric on the final prediction, plus per-node rewards, or a format penalty.

``node_rewards`` maps a node id (a Workflow node, else a DSPy predictor name) to
``fn(example, inputs, outputs) -> float``, called for every call of that node in the rollout; their sum
is added to the metric. A rollout whose program failed (an unparseable output) gets
``-format_penalty``; the transitions it did make still train, with that low reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from flowopt.errors import MetricError
from flowopt.optimizers.weights.rollout import Rollout

NodeReward = Callable[[Any, dict[str, Any], dict[str, Any]], float]


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value)
    except (TypeError, ValueError) as err:
        raise MetricError(f"{what} returned {value!r}, not a number", fix="return a float or a bool") from err
    if math.isnan(number):
        raise MetricError(f"{what} returned NaN", fix="return a finite float")
    return number


def score_rollout(rollout: Rollout, metric: Callable[..., Any], *, node_rewards: Mapping[str, NodeReward] | None = None,
                  format_penalty: float = 1.0) -> float:
    """Set and return ``rollout.reward`` (and ``rollout.score``, the metric alone)."""
    if rollout.error is not None:
        rollout.score = None
        rollout.reward = -format_penalty
        return rollout.reward
    try:
        value = metric(rollout.example, rollout.prediction, None)
    except Exception as err:
        raise MetricError(f"the metric raised {type(err).__name__}: {err}",
                          fix="make the metric handle this prediction (return 0 for a wrong one)") from err
    rollout.score = _number(value, "the metric")
    reward = rollout.score
    for node, inputs, outputs in rollout.trace if node_rewards else ():
        fn = node_rewards.get(node) if node_rewards else None
        if fn is not None:
            reward += _number(fn(rollout.example, inputs, outputs), f"the reward of node {node!r}")
    rollout.reward = reward
    return reward
