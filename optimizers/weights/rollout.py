"""Whole-program rollouts on the policy, recording every LM call as a transition.

:class:`PolicyEngine` is a DSPy engine (``complete(Request) -> Response``) over a :class:`Policy`.
Wrapped in ``dspy.LM(..., engine=...)`` it serves the program's predictors through DSPy's real adapters;
each call it answers is recorded as a :class:`Transition` (prompt ids, completion ids, their log-probs
at sampling time) in the rollout that made it, found through a context variable, so calls from a
Workflow's parallel node threads land in the right rollout too.

:func:`run_rollouts` runs B examples x G samples of a program at once, one thread each, and batches
their LM calls in lockstep (:mod:`.lockstep`).
"""

from __future__ import annotations

import contextvars
import copy
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import dspy

from flowopt.optimizers.weights.lockstep import LockstepBatcher
from flowopt.optimizers.weights.policy import Policy
from flowopt.optimizers.weights.sampling import Generated, sample_batch

logger = logging.getLogger(__name__)


@dataclass
class Transition:
    """One LM call of a rollout: what the policy saw and produced, with its sampling log-probs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


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


class _Recorder:
    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key
        self.transitions: list[Transition] = []
        self.lock = threading.Lock()


_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("flowopt_rollout", default=None)


class _QuietTruncation(logging.Filter):
    """Drop DSPy's "response was truncated" warning inside rollouts.

    A rollout that hits its token limit is an expected outcome (recorded as ``finish_reason="length"``
    and scored by the metric), and B x G of them a step would bury real warnings. Records from threads
    that are not running a rollout pass through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return _RECORDER.get() is None or "truncated" not in record.getMessage()


_DSPY_LM_LOGGER = logging.getLogger("dspy.clients.lm")


def _request_messages(request: Any) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    system = request.system
    if system:
        text = system if isinstance(system, str) else "".join(getattr(p, "text", "") or "" for p in system)
        if text:
            messages.append({"role": "system", "content": text})
    for message in request.messages:
        messages.append({"role": str(message.role), "content": message.text or ""})
    return messages


@dataclass(frozen=True)
class _Call:
    prompt_ids: list[int]
    stop: tuple[str, ...]
    max_new_tokens: int
    temperature: float


class PolicyEngine:
    """DSPy engine over a :class:`Policy`: renders requests to ids, samples, records transitions.

    ``temperature=None`` uses each request's temperature (0 when unset): greedy serving for evaluation.
    Without a ``batcher`` calls are served one at a time.

    Example:
        >>> lm = dspy.LM("local/student", engine=PolicyEngine(policy), cache=False)  # doctest: +SKIP
        >>> with dspy.context(lm=lm):  # doctest: +SKIP
        ...     dspy.Predict("cue -> word")(cue="red")
    """

    def __init__(self, policy: Policy, *, temperature: float | None = None, max_new_tokens: int = 256,
                 generator: Any = None, batcher: LockstepBatcher | None = None) -> None:
        self.policy = policy
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.generator = generator
        self.batcher = batcher
        self._lock = threading.Lock()
        self.engine_errors: list[BaseException] = []

    def complete(self, request: Any) -> Any:
        from dspy.lm15 import Message, Response, TextPart, Usage

        config = request.config
        temperature = self.temperature if self.temperature is not None else (config.temperature or 0.0)
        max_new = min(self.max_new_tokens, config.max_tokens) if config.max_tokens else self.max_new_tokens
        call = _Call(self.policy.render(_request_messages(request)), tuple(config.stop or ()), max_new, temperature)
        recorder = _RECORDER.get()
        try:
            if self.batcher is not None:
                generated = self.batcher.submit(recorder.key if recorder else None, call)
            else:
                with self._lock:
                    generated = self.generate([call])[0]
        except Exception as err:
            self.engine_errors.append(err)
            raise
        text = self.policy.decode(generated.completion_ids)
        cut = min((k for k in (text.find(s) for s in call.stop) if k >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        if recorder is not None:
            with recorder.lock:
                recorder.transitions.append(Transition(call.prompt_ids, generated.completion_ids,
                                                       generated.logprobs, text, generated.finish_reason))
        n_in, n_out = len(call.prompt_ids), len(generated.completion_ids)
        return Response(id=None, model="flowopt-policy", message=Message.assistant([TextPart(text)]),
                        finish_reason="stop" if generated.finish_reason == "stop" else "length",
                        usage=Usage(input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out))

    def generate(self, calls: Sequence[_Call]) -> list[Generated]:
        """Sample all ``calls``; calls with different settings go in separate batches."""
        results: list[Generated | None] = [None] * len(calls)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault((call.stop, call.max_new_tokens, call.temperature), []).append(i)
        policy = self.policy
        for (stop, max_new, temperature), indices in groups.items():
            with policy.lock:
                out = sample_batch(policy.model, [calls[i].prompt_ids for i in indices], max_new_tokens=max_new,
                                   temperature=temperature, eos_ids=policy.eos_ids, pad_id=policy.pad_id,
                                   generator=self.generator, stop=stop, tokenizer=policy.tokenizer)
            for i, generated in zip(indices, out):
                results[i] = generated
        return [r for r in results if r is not None]

    def stream(self, request: Any) -> Any:
        from dspy.lm15 import response_to_events

        return response_to_events(self.complete(request))

    def close(self) -> None:
        pass


def policy_lm(engine: PolicyEngine, **kwargs: Any) -> dspy.LM:
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


def run_rollouts(program: dspy.Module, examples: Sequence[Any], group_size: int, policy: Policy, *,
                 temperature: float, max_new_tokens: int, generator: Any = None, adapter: Any = None,
                 max_batch_size: int = 1024, pool: ThreadPoolExecutor | None = None) -> list[Rollout]:
    """Run every example ``group_size`` times on the policy, all at once; rollouts come back in order
    (example 0 samples 0..G-1, then example 1, ...).

    Errors in the program (unparseable output) end that rollout with ``error`` set; errors of the
    model itself are raised. ``pool`` (at least ``len(examples) * group_size`` workers, since every
    rollout must be waiting at once for a lockstep batch) is reused across calls instead of starting
    that many threads each step.
    """
    n = len(examples) * group_size
    if n == 0:
        return []
    engine = PolicyEngine(policy, temperature=temperature, max_new_tokens=max_new_tokens, generator=generator)
    batcher: LockstepBatcher = LockstepBatcher(engine.generate, live=n, max_batch_size=max_batch_size)
    engine.batcher = batcher
    student = with_lm(program, policy_lm(engine))
    names = predictor_names(student)
    rollouts = [Rollout(i, j, ex) for i, ex in enumerate(examples) for j in range(group_size)]
    parent = contextvars.copy_context()

    def one(rollout: Rollout) -> None:
        recorder = _Recorder((rollout.example_index, rollout.sample_index))
        _RECORDER.set(recorder)
        try:
            settings: dict[str, Any] = {"trace": []}
            if adapter is not None:
                settings["adapter"] = adapter
            with dspy.context(**settings):
                try:
                    rollout.prediction = student(**rollout.example.inputs())
                except Exception as err:
                    rollout.error = f"{type(err).__name__}: {err}"
                    rollout.format_failure = is_format_failure(err)
                rollout.trace = _named_trace(dspy.settings.trace or [], names)
        finally:
            batcher.finished()
            rollout.transitions = recorder.transitions

    quiet = _QuietTruncation()
    _DSPY_LM_LOGGER.addFilter(quiet)
    own_pool = pool is None or pool._max_workers < n  # a private attribute, but stable since Python 3.2
    workers = pool if pool is not None and not own_pool else ThreadPoolExecutor(max_workers=n,
                                                                                 thread_name_prefix="flowopt-rollout")
    try:
        futures = [workers.submit(parent.copy().run, one, r) for r in rollouts]
        batcher.serve()  # all generation runs here, on the caller's thread
        for future in futures:
            future.result()
    finally:
        _DSPY_LM_LOGGER.removeFilter(quiet)
        if own_pool:
            workers.shutdown(wait=True)
    if engine.engine_errors:
        raise engine.engine_errors[0]
    logger.debug("rollouts: %d, LM batches %s", n, batcher.batch_sizes)
    return rollouts
