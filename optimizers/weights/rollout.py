"""Whole-program rollouts on the policy, recording every LM call as a transition.

The program's predictors call the student through flowopt's one local engine
(:class:`flowopt.lm.engine.LocalEngine`), pinned to the trained adapter, with the lockstep batching
policy and a recorder: each call is recorded as a :class:`Transition` (prompt ids, completion ids,
their log-probs at sampling time) in the rollout that made it, found through a context variable, so
calls from a Workflow's parallel node threads land in the right rollout too. Each transition is tagged
with the predictor call that made it (a DSPy callback), and each rollout keeps those calls
(:class:`NodeCall`: node, inputs, outputs) and the tool calls its tool-using nodes made
(:class:`~flowopt.tools.ToolCall`, each naming the transition that chose it), so rewards can be credited
to the transitions that earned them (:mod:`.rewards`).

:func:`run_rollouts` runs B examples x G samples of a program at once, one thread each.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dspy
from dspy.utils.callback import BaseCallback

from flowopt.lm.engine import LocalEngine, Lockstep
from flowopt.lm.sampling import Sample, derive_seed
from flowopt.optimizers.weights.policy import Policy
from flowopt.tools import ToolCall, tool_log

if TYPE_CHECKING:
    from flowopt.optimizers.weights.served import ServedRollouts

logger = logging.getLogger(__name__)


@dataclass
class Transition:
    """One LM call of a rollout: what the policy saw and produced, with its sampling log-probs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    call: str | None = None  # the predictor call (NodeCall.call_id) that made it


@dataclass
class NodeCall:
    """One predictor call of a rollout: its node, inputs and outputs (``None`` when it raised)."""

    call_id: str
    node: str
    inputs: dict[str, Any]
    outputs: dict[str, Any] | None = None


@dataclass
class Rollout:
    """One run of the program on one example; ``error`` is set when it failed (e.g. unparseable output)."""

    example_index: int
    sample_index: int
    example: Any
    prediction: Any = None
    trace: list[tuple[str, dict[str, Any], dict[str, Any]]] = field(default_factory=list)  # (node, inputs, outputs)
    transitions: list[Transition] = field(default_factory=list)
    error: str | None = None
    format_failure: bool = False
    reward: float = 0.0
    score: float | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    node_calls: list[NodeCall] = field(default_factory=list)


class _Recorder:
    def __init__(self, key: tuple[int, int], names: dict[int, str] | None = None) -> None:
        self.key = key
        self.names = names or {}
        self.transitions: list[Transition] = []
        self.calls: dict[str, NodeCall] = {}  # predictor calls by call id, in the order they started
        self.lock = threading.Lock()

    def count(self) -> int:
        with self.lock:
            return len(self.transitions)


_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("flowopt_rollout", default=None)
_PREDICTOR_CALL: contextvars.ContextVar[str | None] = contextvars.ContextVar("flowopt_predictor_call", default=None)


class _CallTagger(BaseCallback):
    """Files every predictor call of a rollout as a :class:`NodeCall` and marks it as the current call
    while it runs, so the transitions it makes are tagged with it (callbacks run in the caller's context)."""

    def __init__(self) -> None:
        self.tokens: dict[str, contextvars.Token[str | None]] = {}

    def on_module_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        recorder = _RECORDER.get()
        if recorder is None or not isinstance(instance, dspy.Predict):
            return
        given = inputs.get("kwargs") or {}
        values = {k: given[k] for k in instance.signature.input_fields if k in given}
        with recorder.lock:
            recorder.calls[call_id] = NodeCall(call_id, recorder.names.get(id(instance), "?"), values)
        self.tokens[call_id] = _PREDICTOR_CALL.set(call_id)

    def on_module_end(self, call_id: str, outputs: Any | None, exception: Exception | None = None) -> None:
        token = self.tokens.pop(call_id, None)
        if token is None:
            return
        _PREDICTOR_CALL.reset(token)
        recorder = _RECORDER.get()
        call = recorder.calls.get(call_id) if recorder is not None else None
        if call is not None and exception is None and outputs is not None:
            call.outputs = outputs.toDict() if hasattr(outputs, "toDict") else dict(outputs)


def _rollout_key() -> tuple[int, int] | None:
    recorder = _RECORDER.get()
    return recorder.key if recorder is not None else None


def _record(sample: Sample) -> None:
    """The engine's recorder hook: file the call under the rollout that made it."""
    recorder = _RECORDER.get()
    if recorder is None:
        return
    logprobs = sample.logprobs.tolist() if sample.logprobs is not None else []
    with recorder.lock:
        recorder.transitions.append(Transition(sample.prompt_ids, sample.completion_ids, logprobs, sample.text,
                                               sample.finish_reason, call=_PREDICTOR_CALL.get()))


class _QuietTruncation(logging.Filter):
    """Drop DSPy's "response was truncated" warning inside rollouts.

    A rollout that hits its token limit is an expected outcome (recorded as ``finish_reason="length"``
    and scored by the metric), and B x G of them a step would bury real warnings. Records from threads
    that are not running a rollout pass through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return _RECORDER.get() is None or "truncated" not in record.getMessage()


_DSPY_LM_LOGGER = logging.getLogger("dspy.clients.lm")


def policy_engine(policy: Policy, *, temperature: float, max_new_tokens: int, batching: Any = None) -> LocalEngine:
    """The engine rollouts sample through: the policy's adapter pinned, every call recorded, sampling at
    ``temperature`` whatever the request asks (the training forward assumes it), ``max_new_tokens`` at most."""
    return LocalEngine(policy.local, adapter=policy.adapter, batching=batching, recorder=_record,
                       temperature=temperature, max_new_tokens=max_new_tokens)


def policy_lm(engine: LocalEngine, **kwargs: Any) -> dspy.LM:
    """A ``dspy.LM`` over ``engine``; never cached, since rollouts must sample afresh."""
    return dspy.LM("local/flowopt-policy", engine=engine, cache=False, num_retries=0, **kwargs)


def with_lm(program: dspy.Module, lm: Any) -> dspy.Module:
    """A copy of ``program`` whose every predictor calls ``lm`` (a predictor's own LM wins over contexts)."""
    student = copy.deepcopy(program)
    for _, predictor in student.named_predictors():
        predictor.lm = lm
    return student


def predictor_names(program: dspy.Module) -> dict[int, str]:
    """``id(predictor) -> name``: the node id for a Workflow's predictors, else DSPy's predictor name."""
    from flowopt.workflow import Workflow

    names = {id(p): name for name, p in program.named_predictors()}
    if isinstance(program, Workflow):
        for node_id, op in program.nodes.items():
            for _, p in op.named_predictors():
                names[id(p)] = node_id
    return names


def _named_trace(trace: Sequence[Any], names: dict[int, str]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    out = []
    for predictor, inputs, outputs in trace:
        values = outputs.toDict() if hasattr(outputs, "toDict") else dict(outputs or {})
        out.append((names.get(id(predictor), "?"), dict(inputs), values))
    return out


def is_format_failure(err: BaseException) -> bool:
    from dspy.utils.exceptions import AdapterParseError

    return isinstance(err, AdapterParseError) or "parse" in type(err).__name__.lower()


def _call_seed(base: int) -> Callable[[], int | None]:
    """Per-call seeds for a server: one per (rollout, call number), so a seeded step repeats."""
    def seed() -> int | None:
        recorder = _RECORDER.get()
        if recorder is None:
            return None
        with recorder.lock:
            calls = len(recorder.transitions)
        return derive_seed(base, hash((*recorder.key, calls)) & (2**62 - 1))
    return seed


def run_rollouts(program: dspy.Module, examples: Sequence[Any], group_size: int, policy: Policy, *,
                 temperature: float, max_new_tokens: int, generator: Any = None, adapter: Any = None,
                 max_batch_size: int = 1024, pool: ThreadPoolExecutor | None = None,
                 served: ServedRollouts | None = None, seed: int = 0) -> list[Rollout]:
    """Run every example ``group_size`` times on the policy, all at once; rollouts come back in order
    (example 0 samples 0..G-1, then example 1, ...).

    Errors in the program (unparseable output) end that rollout with ``error`` set; errors of the
    model itself are raised. ``pool`` (at least ``len(examples) * group_size`` workers, since every
    rollout must be waiting at once for a lockstep batch) is reused across calls instead of starting
    that many threads each step. ``served``: sample on an inference server with the adapter pushed
    there (calls seeded from ``seed``) instead of in lockstep batches here.
    """
    n = len(examples) * group_size
    if n == 0:
        return []
    lockstep: Lockstep | None = None
    engine: Any
    if served is None:
        lockstep = Lockstep(policy.local, live=n, key=_rollout_key, generator=generator,
                            max_batch_size=max_batch_size)
        engine = policy_engine(policy, temperature=temperature, max_new_tokens=max_new_tokens, batching=lockstep)
    else:  # the server batches the concurrent calls itself
        engine = served.engine(recorder=_record, temperature=temperature, max_new_tokens=max_new_tokens,
                               seed=_call_seed(seed))
    student = with_lm(program, policy_lm(engine))
    names = predictor_names(student)
    rollouts = [Rollout(i, j, ex) for i, ex in enumerate(examples) for j in range(group_size)]
    parent = contextvars.copy_context()
    tagger = _CallTagger()

    def one(rollout: Rollout) -> None:
        recorder = _Recorder((rollout.example_index, rollout.sample_index), names)
        _RECORDER.set(recorder)
        try:
            settings: dict[str, Any] = {"trace": [], "callbacks": [*(dspy.settings.get("callbacks") or []), tagger]}
            if adapter is not None:
                settings["adapter"] = adapter
            with dspy.context(**settings), tool_log(lm_calls=recorder.count) as tools:
                try:
                    rollout.prediction = student(**rollout.example.inputs())
                except Exception as err:
                    rollout.error = f"{type(err).__name__}: {err}"
                    rollout.format_failure = is_format_failure(err)
                rollout.trace = _named_trace(dspy.settings.trace or [], names)
            rollout.tool_calls = list(tools.calls)
        finally:
            if lockstep is not None:
                lockstep.finished()
            rollout.transitions = recorder.transitions
            rollout.node_calls = list(recorder.calls.values())

    quiet = _QuietTruncation()
    _DSPY_LM_LOGGER.addFilter(quiet)
    own_pool = pool is None or pool._max_workers < n  # a private attribute, but stable since Python 3.2
    workers = pool if pool is not None and not own_pool else ThreadPoolExecutor(max_workers=n,
                                                                                 thread_name_prefix="flowopt-rollout")
    try:
        futures = [workers.submit(parent.copy().run, one, r) for r in rollouts]
        if lockstep is not None:
            lockstep.serve()  # all generation runs here, on the caller's thread
        for future in futures:
            future.result()
    finally:
        _DSPY_LM_LOGGER.removeFilter(quiet)
        if own_pool:
            workers.shutdown(wait=True)
    errors = lockstep.batcher.errors if lockstep is not None else engine.errors
    if errors:  # the model or its server failed (not the program): no rollout of this step counts
        raise errors[0]
    if lockstep is not None:
        logger.debug("rollouts: %d, LM batches %s", n, lockstep.batcher.batch_sizes)
    return rollouts
