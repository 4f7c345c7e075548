"""Teacher traces to supervised pairs: one (prompt, completion) per predictor call of a passing run.

The teacher program runs on each training example with DSPy tracing on. Runs whose prediction passes
the metric keep their trace; every predictor call in it becomes a pair rendered exactly as the student
will see it: the prompt through the student's DSPy adapter (demos included, as at inference) and the
completion as that adapter formats the call's outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import dspy

from flowopt.concurrency import map_in_context
from flowopt.errors import MetricError

logger = logging.getLogger(__name__)


@dataclass
class TracePair:
    """One supervised example: chat ``messages`` for the prompt and the ``completion`` text."""

    node: str
    messages: list[dict[str, str]]
    completion: str


@dataclass
class TraceStats:
    runs: int = 0
    passed: int = 0
    failed_runs: int = 0  # the teacher raised
    pairs: int = 0


def _passes(score: Any, threshold: float | None) -> bool:
    if threshold is None:
        return bool(score)
    try:
        return float(score) >= threshold
    except (TypeError, ValueError) as err:
        raise MetricError(f"the metric returned {score!r}, not a number", fix="return a float or a bool") from err


def _continuation(messages: list[dict[str, Any]], completion: str) -> str:
    """The completion as the model must write it after the prompt.

    A completion-style adapter ends the prompt with the first output label (``"Answer:"``) and its
    formatted outputs start with that same label; the model only writes what follows it.
    """
    last_line = str(messages[-1]["content"]).rstrip().rsplit("\n", 1)[-1].strip() if messages else ""
    if last_line and completion.startswith(last_line):
        return completion[len(last_line):]
    return completion


def teacher_pairs(teacher: dspy.Module, examples: Sequence[Any], metric: Callable[..., Any], adapter: Any, *,
                  metric_threshold: float | None = None, num_threads: int = 8) -> tuple[list[TracePair], TraceStats]:
    """Run ``teacher`` on ``examples``; return the pairs of passing runs and counts of what happened.

    Example:
        >>> pairs, stats = teacher_pairs(program, trainset, metric, dspy.ChatAdapter())  # doctest: +SKIP
        >>> pairs[0].messages[-1]["content"], pairs[0].completion  # doctest: +SKIP
    """
    from flowopt.optimizers.weights.rollout import predictor_names

    names = predictor_names(teacher)
    adapter = adapter or dspy.settings.adapter or dspy.ChatAdapter()

    def run(example: Any) -> tuple[Any, list[Any]] | None:
        with dspy.context(trace=[]):
            try:
                prediction = teacher(**example.inputs())
            except Exception as err:  # a failed teacher run is skipped, not fatal
                logger.debug("teacher failed on an example: %s", err)
                return None
            return prediction, list(dspy.settings.trace or [])

    results = map_in_context(run, [(ex,) for ex in examples], max_workers=num_threads)
    stats = TraceStats(runs=len(examples))
    pairs: list[TracePair] = []
    for example, result in zip(examples, results):
        if result is None:
            stats.failed_runs += 1
            continue
        prediction, trace = result
        try:
            score = metric(example, prediction, trace)
        except Exception as err:
            raise MetricError(f"the metric raised {type(err).__name__}: {err}",
                              fix="make the metric handle every prediction (return 0 for a wrong one)") from err
        if not _passes(score, metric_threshold):
            continue
        stats.passed += 1
        for predictor, inputs, outputs in trace:
            values = outputs.toDict() if hasattr(outputs, "toDict") else dict(outputs)
            demos = [d.toDict() if hasattr(d, "toDict") else dict(d) for d in predictor.demos]
            messages = adapter.format(predictor.signature, demos, dict(inputs))
            completion = _continuation(messages, adapter.format_assistant_message_content(predictor.signature, values))
            pairs.append(TracePair(names.get(id(predictor), "?"),
                                   [{"role": m["role"], "content": str(m["content"])} for m in messages],
                                   completion))
    stats.pairs = len(pairs)
    return pairs, stats
