"""A rollout's reward: the metric on the final prediction, plus per-node rewards, or a format penalty.

``node_rewards`` maps a node id (a Workflow node, else a DSPy predictor name) to
``fn(example, inputs, outputs) -> float``, called for every call of that node in the rollout; their sum
is added to the metric. A rollout whose program failed (an unparseable output) gets
``-format_penalty``; the transitions it did make still train, with that low reward.

Intermediate rewards (:func:`transition_rewards`) belong to single transitions instead: each tool call
earns ``tool_rewards[status]`` for the LM call that chose the tool, and with ``credit="transition"``
each node reward goes to the LM call that produced that node's outputs (its last one, when the adapter
asked again for a missing field) rather than into the rollout's reward. GRPO adds a transition's own
reward, times a weight, to its rollout's advantage.
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
    """Set and return ``rollout.reward`` (and ``rollout.score``, the metric alone); pass
    ``node_rewards=None`` when they are credited per transition instead."""
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


CREDITS: tuple[str, ...] = ("rollout", "transition")


def transition_rewards(rollout: Rollout, *, tool_rewards: Mapping[str, float] | None = None,
                       node_rewards: Mapping[str, NodeReward] | None = None) -> list[float]:
    """Each transition's own reward: ``tool_rewards[status]`` for every tool call it chose, plus the
    ``node_rewards`` of the predictor call it completed (pass them only when credited per transition).

    Example:
        >>> from flowopt.optimizers.weights.rollout import Rollout, Transition
        >>> from flowopt.tools import ToolCall
        >>> r = Rollout(0, 0, None, transitions=[Transition([1], [2], [-0.1], "", "stop")] * 2,
        ...             tool_calls=[ToolCall("calculator", "1/0", None, "division by zero", "error", transition=1)])
        >>> transition_rewards(r, tool_rewards={"ok": 0.1, "error": -0.2})
        [0.0, -0.2]
    """
    rewards = [0.0] * len(rollout.transitions)
    for tool_call in rollout.tool_calls if tool_rewards else ():
        index = tool_call.transition
        if index is not None and 0 <= index < len(rewards):
            rewards[index] += float(tool_rewards.get(tool_call.status, 0.0)) if tool_rewards else 0.0
    if not node_rewards:
        return rewards
    last: dict[str, int] = {}
    for index, transition in enumerate(rollout.transitions):
        if transition.call is not None:
            last[transition.call] = index
    for call in rollout.node_calls:
        fn = node_rewards.get(call.node)
        if fn is None or call.outputs is None or call.call_id not in last:  # raised, or made no LM call (cache)
            continue
        rewards[last[call.call_id]] += _number(fn(rollout.example, call.inputs, call.outputs),
                                               f"the reward of node {call.node!r}")
    return rewards
