"""Supervised pairs: from teacher traces (one per predictor call of a passing run) or from gold labels.

The teacher program runs on each training example with DSPy tracing on. Runs whose prediction passes
the metric keep their trace; every predictor call in it becomes a pair rendered exactly as the student
will see it: the prompt through the student's DSPy adapter (demos included, as at inference) and the
completion as that adapter formats the call's outputs. :func:`label_pairs` renders the call that gives
the program's answer the same way, with the example's gold labels as the completion.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import dspy

from flowopt.concurrency import map_in_context
from flowopt.errors import ConfigError, MetricError

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


def _prompt_demos(predictor: Any, exclude_demos: bool) -> list[dict[str, Any]]:
    """The demos a training prompt carries: the predictor's own, as at inference, or none."""
    if exclude_demos:
        return []
    return [d.toDict() if hasattr(d, "toDict") else dict(d) for d in predictor.demos]


def teacher_pairs(teacher: dspy.Module, examples: Sequence[Any], metric: Callable[..., Any], adapter: Any, *,
                  metric_threshold: float | None = None, num_threads: int = 8,
                  exclude_demos: bool = False) -> tuple[list[TracePair], TraceStats]:
    """Run ``teacher`` on ``examples``; return the pairs of passing runs and counts of what happened.
    ``exclude_demos``: the teacher runs with its demos, the pairs' prompts carry none (DSPy's option).

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
            demos = _prompt_demos(predictor, exclude_demos)
            messages = adapter.format(predictor.signature, demos, dict(inputs))
            completion = _continuation(messages, adapter.format_assistant_message_content(predictor.signature, values))
            pairs.append(TracePair(names.get(id(predictor), "?"),
                                   [{"role": m["role"], "content": str(m["content"])} for m in messages],
                                   completion))
    stats.pairs = len(pairs)
    return pairs, stats


_CALC_RE = re.compile(r"<<[^>]*>>")
#: Output fields that a reasoning rationale fills, and the example fields that hold a gold rationale.
_REASONING_FIELDS = ("reasoning", "rationale")
_RATIONALE_KEYS = ("solution", "rationale", "gold_reasoning")


def gold_outputs(example: Any, output_names: Sequence[str]) -> dict[str, str] | None:
    """The gold value of every output field, or ``None`` when the example does not label one of them.

    A field of the same name is taken as it is; a ``reasoning`` field takes the example's gold
    rationale (GSM8K's ``solution``, without its ``<<calculator>>`` annotations).

    Example:
        >>> gold_outputs(dspy.Example(answer="3", solution="1+2=<<1+2=3>>3"), ["reasoning", "answer"])
        {'reasoning': '1+2=3', 'answer': '3'}
        >>> gold_outputs(dspy.Example(answer="Paris"), ["reasoning", "answer"]) is None
        True
    """
    values: dict[str, str] = {}
    for name in output_names:
        value = example.get(name) if hasattr(example, "get") else getattr(example, name, None)
        if value is None and name in _REASONING_FIELDS:
            value = next((example.get(k) for k in _RATIONALE_KEYS if example.get(k) is not None), None)
            value = None if value is None else _CALC_RE.sub("", str(value)).strip()
        if value is None or (isinstance(value, list | tuple) and not value):
            return None
        values[name] = value[0] if isinstance(value, list | tuple) else str(value)
    return values


def _labelled_calls(program: dspy.Module, example: Any) -> list[tuple[Any, dict[str, Any]]]:
    """``(predictor, inputs)`` for the calls that produce the program's outputs on ``example``.

    A Workflow's nodes upstream of an output node run as they are (e.g. retrieval); the output
    node's single predictor is the call the labels supervise. Any other module must have one predictor,
    called with the example's inputs.
    """
    import networkx as nx

    from flowopt.workflow import INPUT, OUTPUT, Workflow

    if not isinstance(program, Workflow):
        predictors = program.predictors()
        if len(predictors) != 1:
            raise ConfigError(f"labels need one predictor or a Workflow, this program has {len(predictors)}",
                              fix="distil from teacher traces (labels=None) or pass a Workflow")
        return [(predictors[0], dict(example.inputs()))]
    targets = sorted({src for src, _ in program.sources(OUTPUT).values()})
    values: dict[str, dict[str, Any]] = {INPUT: dict(example.inputs())}
    calls = []
    for node_id in program.topological_order():
        if node_id in targets:
            predictors = program.nodes[node_id].predictors()
            if len(predictors) != 1:
                raise ConfigError(f"labels supervise the node that gives the answer; {node_id!r} has "
                                  f"{len(predictors)} predictors", fix="distil from teacher traces (labels=None)")
            kwargs = {dst: values[src][field] for dst, (src, field) in program.sources(node_id).items()}
            calls.append((predictors[0], kwargs))
        elif any(nx.has_path(program.graph, node_id, t) for t in targets):
            values[node_id] = program.run_node(node_id, values)  # upstream of the answer: run it (retrieval)
    return calls


def label_pairs(program: dspy.Module, examples: Sequence[Any], adapter: Any, *,
                exclude_demos: bool = False) -> list[TracePair]:
    """Pairs whose completions are the gold labels: the call that gives the answer, on every example
    (prompts without the predictors' demos when ``exclude_demos``).

    Raises :class:`ConfigError` when an example does not label an output field of that call (e.g. a
    ``reasoning`` field and no gold rationale).

    Example:
        >>> pairs = label_pairs(program, trainset, adapter)  # doctest: +SKIP
        >>> pairs[0].completion  # doctest: +SKIP
        ' 72'
    """
    from flowopt.optimizers.weights.rollout import predictor_names

    names = predictor_names(program)
    adapter = adapter or dspy.settings.adapter or dspy.ChatAdapter()
    pairs: list[TracePair] = []
    for example in examples:
        for predictor, inputs in _labelled_calls(program, example):
            outputs = gold_outputs(example, list(predictor.signature.output_fields))
            if outputs is None:
                raise ConfigError(
                    f"the examples do not label every output of {names.get(id(predictor), '?')!r} "
                    f"({list(predictor.signature.output_fields)}): a reasoning field needs a gold rationale",
                    fix="use labels='mix' with a teacher, or a program whose answer node outputs only labelled "
                        "fields (e.g. Predict instead of ChainOfThought)")
            demos = _prompt_demos(predictor, exclude_demos)
            messages = adapter.format(predictor.signature, demos, inputs)
            completion = _continuation(messages, adapter.format_assistant_message_content(predictor.signature, outputs))
            pairs.append(TracePair(names.get(id(predictor), "?"),
                                   [{"role": m["role"], "content": str(m["content"])} for m in messages],
                                   completion))
    return pairs
