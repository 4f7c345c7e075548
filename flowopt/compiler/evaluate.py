"""Parallel evaluation of a program on examples: mean score with a 95% interval.

A program that raises on an example scores 0 for it and counts as a failed example. An LM output that
does not parse is a wrong answer (a small model's empty or rambling answer), never a reason to stop;
any other failure (an LM or connection error, a crash in the program) counts as an error, and more
than ``max_errors`` errors stop the evaluation with an :class:`~flowopt.errors.LMError`. A metric that
raises or returns a non-number is the user's bug and raises :class:`~flowopt.errors.MetricError` naming
the example.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import dspy
from dspy.utils.exceptions import AdapterParseError

from flowopt.compiler.budget import BudgetStop
from flowopt.errors import FlowoptError, LMError, MetricError, WorkflowError

logger = logging.getLogger(__name__)

Metric = Callable[..., Any]


@dataclass(frozen=True)
class EvalResult:
    """Scores of one program on some examples.

    ``score`` is the mean, ``ci`` its 95% interval (Wilson for 0/1 scores, normal otherwise),
    ``scores`` one value per example in order, ``errors`` how many examples raised in the program.

    Example:
        >>> from flowopt.compiler import EvalResult
        >>> r = EvalResult.from_scores([1.0, 0.0, 1.0, 1.0])
        >>> r.score, r.n
        (0.75, 4)
    """

    score: float
    ci: tuple[float, float]
    scores: list[float] = field(default_factory=list)
    n: int = 0
    errors: int = 0

    @classmethod
    def from_scores(cls, scores: Sequence[float], errors: int = 0) -> EvalResult:
        scores = [float(s) for s in scores]
        n = len(scores)
        if n == 0:
            return cls(0.0, (0.0, 0.0), [], 0, errors)
        mean = sum(scores) / n
        return cls(mean, confidence_interval(scores), scores, n, errors)

    def to_dict(self) -> dict[str, Any]:
        return {"score": round(self.score, 6), "ci": [round(self.ci[0], 6), round(self.ci[1], 6)],
                "n": self.n, "errors": self.errors}


def confidence_interval(scores: Sequence[float], z: float = 1.959964) -> tuple[float, float]:
    """95% interval of the mean: Wilson score interval for 0/1 scores, normal approximation else."""
    n = len(scores)
    if n == 0:
        return (0.0, 0.0)
    mean = sum(scores) / n
    if all(s in (0.0, 1.0) for s in scores):
        denom = 1 + z * z / n
        centre = (mean + z * z / (2 * n)) / denom
        half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / denom
        return (max(0.0, centre - half), min(1.0, centre + half))
    if n == 1:
        return (mean, mean)
    var = sum((s - mean) ** 2 for s in scores) / (n - 1)
    half = z * math.sqrt(var / n)
    return (mean - half, mean + half)


def example_key(example: Any) -> str:
    """A stable key for an example (its fields as sorted JSON), used to memoise scores."""
    data = example.toDict() if hasattr(example, "toDict") else dict(example)
    text = json.dumps(data, sort_keys=True, default=repr, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def program_key(program: Any, *, include_lms: bool = True) -> str:
    """A key that changes whenever the program's behaviour-relevant state changes.

    ``include_lms=False`` leaves out which LMs run it (a run folder's fingerprint: resuming with a new
    client for the same model is fine); the evaluation memo always includes them.
    """
    canonical = getattr(program, "canonical_json", None)
    if callable(canonical):
        text = canonical()
    else:
        try:
            state = program.dump_state(json_mode=True)
            for entry in state.values() if isinstance(state, dict) else ():
                if isinstance(entry, dict):
                    entry.pop("lm", None)  # LM clients are shared objects, not program state
            text = type(program).__qualname__ + json.dumps(state, sort_keys=True, default=repr)
        except Exception:  # a module whose state cannot be dumped is never memoised
            return f"id:{id(program)}"
        text += json.dumps({name: p.config for name, p in program.named_predictors()}, sort_keys=True, default=repr)
    if not include_lms:
        return hashlib.sha1(text.encode("utf-8")).hexdigest()
    # The LMs behind the program are part of its behaviour: the ambient one and any bound to a predictor.
    # A LocalLM's model name carries a tag that changes with its weights, so training invalidates the memo.
    lms = {"ambient": _lm_identity(dspy.settings.lm),
           **{name: _lm_identity(p.lm) for name, p in program.named_predictors() if p.lm is not None}}
    text += json.dumps(lms, sort_keys=True, default=repr)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def _lm_identity(lm: Any) -> str | None:
    """The LM's model name, plus its ``rollout_id`` when set: another rollout is another sample (DSPy
    caches by it), so repeated measurements of one program are not answered from the memo."""
    model = getattr(lm, "model", None)
    rollout = (getattr(lm, "kwargs", None) or {}).get("rollout_id")
    return model if rollout is None else f"{model}#rollout={rollout}"


def score_prediction(metric: Metric, example: Any, prediction: Any, index: int) -> float:
    """Run the user's metric; raise :class:`MetricError` naming the example if it misbehaves."""
    try:
        value = metric(example, prediction, None)
    except FlowoptError:
        raise
    except Exception as err:
        raise MetricError(
            f"the metric raised {type(err).__name__}: {err} on example #{index} ({_short(example)})",
            fix="make the metric handle this example (missing label field? unparsable prediction?)",
        ) from err
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise MetricError(
        f"the metric returned {value!r} ({type(value).__name__}) on example #{index} ({_short(example)}); "
        "it must return a bool or a finite number",
        fix="return a float in [0, 1] or a bool from metric(example, prediction, trace=None)",
    )


class Evaluator:
    """Evaluates programs in parallel threads, memoising per-example scores by program state.

    The memo makes re-scoring free: the compiler scores each stage's output on the valset, and a
    search stage that already scored that program there pays nothing again.
    """

    def __init__(self, metric: Metric, *, num_threads: int = 8, max_errors: int | None = None,
                 quiet: bool = True) -> None:
        self.metric = metric
        self.num_threads = max(1, int(num_threads))
        self.max_errors = max_errors
        self.quiet = quiet
        self._memo: dict[tuple[str, str], tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def evaluate(self, program: Any, examples: Sequence[Any], *, desc: str | None = None,
                 max_errors: int | None = None) -> EvalResult:
        """Score ``program`` on ``examples``: memoised per example, ``num_threads`` at a time."""
        return self.evaluate_many([(program, examples)], desc=desc, max_errors=max_errors)[0]

    def evaluate_many(self, jobs: Sequence[tuple[Any, Sequence[Any]]], *, desc: str | None = None,
                      max_errors: int | None = None) -> list[EvalResult]:
        """Score several programs at once, sharing one pool of ``num_threads`` threads.

        Candidates of a search are raced this way: the examples of all of them fill the threads, so
        a small minibatch per candidate still keeps every thread busy. ``max_errors`` applies to each
        program on its own.

        Example:
            >>> import dspy
            >>> from flowopt.compiler import Evaluator
            >>> from flowopt.testing import scripted_lm
            >>> ev = Evaluator(lambda ex, pred, trace=None: ex.answer == pred.answer, quiet=True)
            >>> data = [dspy.Example(question="q", answer="a").with_inputs("question")]
            >>> with dspy.context(lm=scripted_lm(lambda req: {"answer": "a"})):
            ...     [r.score for r in ev.evaluate_many([(dspy.Predict("question -> answer"), data)] * 2)]
            [1.0, 1.0]
        """
        from tqdm.auto import tqdm

        runs = [_Run(program, list(examples), self._limit(max_errors, len(examples))) for program, examples in jobs]
        todo: list[tuple[_Run, int]] = []
        queued: set[tuple[str, str]] = set()  # the same program twice runs each example once
        with self._lock:
            for run in runs:
                run.pkey = program_key(run.program)
                run.keys = [example_key(ex) for ex in run.examples]
                run.results = [self._memo.get((run.pkey, k)) for k in run.keys]
                run.errors = sum(1 for r in run.results if r is not None and r[1])
                for i, r in enumerate(run.results):
                    if r is None and (run.pkey, run.keys[i]) not in queued:
                        queued.add((run.pkey, run.keys[i]))
                        todo.append((run, i))
        total = sum(len(r.examples) for r in runs)
        bar = tqdm(total=total, initial=total - len(todo), desc=desc or "evaluate", disable=self.quiet, leave=False)
        stop = threading.Event()

        def one(run: _Run, i: int) -> None:
            if stop.is_set():
                raise _Stopped()
            outcome = self._score_one(run, i, stop)
            run.results[i] = outcome
            with self._lock:
                self._memo[(run.pkey, run.keys[i])] = outcome
            bar.update(1)

        try:
            if self.num_threads <= 1 or len(todo) <= 1:
                for run, i in todo:
                    one(run, i)
            else:
                with ThreadPoolExecutor(max_workers=min(self.num_threads, len(todo)),
                                        thread_name_prefix="flowopt-eval") as pool:
                    futures = [pool.submit(contextvars.copy_context().run, one, run, i) for run, i in todo]
                    failures: list[BaseException] = []
                    for f in futures:
                        try:
                            f.result()
                        except _Stopped:
                            continue
                        except BaseException as err:
                            stop.set()  # the first failure cancels the examples not yet started
                            failures.append(err)
                    if failures:
                        # A real error (metric, too many failures) says more than a budget refusal.
                        real = [e for e in failures if not isinstance(e, BudgetStop)]
                        raise (real or failures)[0]
        finally:
            bar.close()
        out = []
        for run in runs:
            with self._lock:
                run.results = [r if r is not None else self._memo.get((run.pkey, k))
                               for r, k in zip(run.results, run.keys)]
            done = [r for r in run.results if r is not None]
            out.append(EvalResult.from_scores([s for s, _ in done], errors=sum(1 for _, e in done if e)))
        return out

    def _limit(self, max_errors: int | None, n: int) -> int:
        limit = max_errors if max_errors is not None else self.max_errors
        return max(10, n // 2) if limit is None else limit

    def _score_one(self, run: _Run, i: int, stop: threading.Event) -> tuple[float, bool]:
        ex = run.examples[i]
        try:
            pred = run.program(**ex.inputs())
        except (BudgetStop, WorkflowError):
            raise
        except AdapterParseError as err:  # a wrong answer: one candidate a small model cannot answer with
            logger.debug("example #%d: unparseable answer: %s", i, err)  # must not stop the search around it
            return (0.0, True)
        except Exception as err:  # an LM error or a crash in the program scores as a failure
            logger.debug("example #%d failed: %s: %s", i, type(err).__name__, err)
            with self._lock:
                run.errors += 1
                too_many = run.errors > run.limit
            if too_many:
                stop.set()
                raise LMError(
                    f"evaluation stopped: {run.errors} examples failed (max_errors={run.limit}); "
                    f"last error on example #{i}: {type(err).__name__}: {err}",
                    fix="check the LM and the program on one example, or raise max_errors",
                ) from err
            return (0.0, True)
        return (score_prediction(self.metric, ex, pred, i), False)

    def recall(self, program: Any, examples: Sequence[Any]) -> list[tuple[float, bool] | None]:
        """The memoised ``(score, failed)`` of ``program`` on each of ``examples`` (``None``: not scored)."""
        pkey = program_key(program)
        with self._lock:
            return [self._memo.get((pkey, example_key(ex))) for ex in examples]

    def remember(self, program: Any, examples: Sequence[Any], outcomes: Sequence[tuple[float, bool]]) -> None:
        """Take ``(score, failed)`` per example, scored elsewhere (another worker of a shared search),
        as if scored here: evaluating ``program`` on ``examples`` then costs no LM call.

        Example:
            >>> import dspy
            >>> from flowopt.compiler import Evaluator
            >>> ev = Evaluator(lambda ex, pred, trace=None: 1.0)
            >>> data = [dspy.Example(question="q", answer="a").with_inputs("question")]
            >>> ev.remember(dspy.Predict("question -> answer"), data, [(0.5, False)])
            >>> ev.evaluate(dspy.Predict("question -> answer"), data).score  # no LM configured, none needed
            0.5
        """
        if len(outcomes) != len(examples):
            raise ValueError(f"{len(outcomes)} outcomes for {len(examples)} examples")
        pkey = program_key(program)
        with self._lock:
            for ex, (score, failed) in zip(examples, outcomes):
                self._memo[(pkey, example_key(ex))] = (float(score), bool(failed))

    def forget(self) -> None:
        with self._lock:
            self._memo.clear()


class _Stopped(Exception):
    pass


@dataclass
class _Run:
    """One program's share of an :meth:`Evaluator.evaluate_many` call."""

    program: Any
    examples: list[Any]
    limit: int
    pkey: str = ""
    keys: list[str] = field(default_factory=list)
    results: list[tuple[float, bool] | None] = field(default_factory=list)
    errors: int = 0


def _short(example: Any, limit: int = 80) -> str:
    try:
        text = json.dumps(dict(example.inputs()), ensure_ascii=False, default=repr)
    except Exception:
        text = repr(example)
    return text if len(text) <= limit else text[: limit - 3] + "..."

