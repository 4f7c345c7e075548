"""Few-shot demonstration stages: ``LabeledFewShot`` and ``BootstrapFewShot``.

Bootstrapping follows DSPy's ``BootstrapFewShot`` step for step (a teacher with labeled demos runs
on training examples in order; the predictor calls of runs that pass the metric become demos; the
rest is topped up with labeled examples), and with the same random draws: with ``seed=0`` it picks
the very demos that ``dspy.BootstrapFewShot`` picks. What it adds for the compiler: examples run in
parallel (each round launches only as many examples as successes are still missing, so it pays for
the same calls as DSPy's one-at-a-time loop), every LM call is under the shared budget, and the pool
of traces is checkpointed and shared with later stages (the search builds its candidates from it).
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import random
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import dspy
from dspy.utils.exceptions import AdapterParseError

from flowopt.compiler import BudgetStop, Stage, StageContext, clone_program
from flowopt.compiler.evaluate import program_key, score_prediction
from flowopt.errors import BudgetExhausted, FlowoptError, LMError, WorkflowError
from flowopt.settings import at_least, check_stage


def _as_demo(data: dict[str, Any]) -> dspy.Example:
    return dspy.Example(**data)


def labeled_demos(examples: list[Any], k: int, seed: int, predictors: list[str]) -> dict[str, list[dict[str, Any]]]:
    """``k`` examples per predictor, drawn as DSPy's ``LabeledFewShot`` draws them (one
    ``random.Random(seed)`` for all predictors in turn; DSPy's fixed seed is 0)."""
    rng = random.Random(seed)
    k = min(k, len(examples))
    return {name: [ex.toDict() for ex in rng.sample(examples, k)] if k else [] for name in predictors}


def set_demos(program: dspy.Module, demos: dict[str, list[dict[str, Any]]]) -> dspy.Module:
    """Put ``demos[name]`` on each named predictor of ``program`` (in place); returns it."""
    for name, predictor in program.named_predictors():
        predictor.demos = [_as_demo(d) for d in demos.get(name, [])]
    return program


@dataclass(frozen=True)
class LabeledFewShot(Stage):
    """Put ``k`` training examples on every predictor, drawn as DSPy's ``LabeledFewShot`` does with
    the compile seed (so ``seed=0`` gives DSPy's demos).

    Example:
        >>> from flowopt.optimizers.demos import LabeledFewShot
        >>> LabeledFewShot(k=8).settings()
        {'k': 8}
    """

    name: ClassVar[str] = "labeled"
    k: int = 16

    def __post_init__(self) -> None:
        check_stage(self, {"k": at_least(1)})

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        demos = labeled_demos(ctx.trainset, self.k, ctx.seed, [n for n, _ in program.named_predictors()])
        set_demos(program, demos)
        ctx.record(candidates_tried=1, demos=min(self.k, len(ctx.trainset)))
        return program


# ---------------------------------------------------------------------------------------- pool
@dataclass
class DemoPool:
    """Bootstrapped traces, in trainset order: ``records[i]`` is one example's outcome."""

    key: str
    order: list[int]
    records: list[dict[str, Any]] = field(default_factory=list)
    exhausted_by: str | None = None

    @property
    def successes(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["success"]]

    @property
    def done(self) -> bool:
        return len(self.records) >= len(self.order)

    def demos_for(self, predictor: str, limit: int | None = None) -> list[dict[str, Any]]:
        out = []
        for record in self.successes:
            out.extend(record["demos"].get(predictor, []))
            if limit is not None and len(out) >= limit:
                return out[:limit]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "order": self.order, "records": self.records}


def build_teacher(program: dspy.Module, ctx: StageContext, max_labeled_demos: int,
                  order: list[int] | None = None) -> dspy.Module:
    """The program with ``max_labeled_demos`` labeled demos per predictor, as DSPy's bootstrap builds
    its teacher: ``LabeledFewShot`` over the trainset taken in ``order``, seeded by the compile seed.

    It depends on the compile seed and the order only, so the demos stage and the search build the
    same teacher, send the same prompts, and share one pool (and the LM cache).
    """
    examples = [ctx.trainset[i] for i in (order if order is not None else range(len(ctx.trainset)))]
    names = [n for n, _ in program.named_predictors()]
    return set_demos(clone_program(program), labeled_demos(examples, max_labeled_demos, ctx.seed, names))


def bootstrap_pool(program: dspy.Module, ctx: StageContext, *, successes: int, max_labeled_demos: int = 16,
                   metric_threshold: float | None = None, checkpoint: str = "pool", order: list[int] | None = None,
                   executor: Executor | None = None) -> DemoPool:
    """Run the teacher on training examples, in ``order``, until ``successes`` of them pass the metric.

    Each round launches as many examples (at most ``ctx.num_threads``) as successes are still missing,
    so the examples tried are exactly the prefix of ``order`` that DSPy's one-at-a-time loop tries.
    LM calls run on ``executor`` when given (to share a thread limit with other work). The pool is
    kept in ``ctx.shared`` (later stages extend it) and checkpointed after every round. A budget
    refusal stops it with what it has (``pool.exhausted_by`` names the limit).
    """
    order = list(range(len(ctx.trainset))) if order is None else list(order)
    teacher = build_teacher(program, ctx, max_labeled_demos, order)
    order_key = hashlib.sha1(json.dumps(order).encode()).hexdigest()[:12]
    key = f"{program_key(teacher, include_lms=False)}:{metric_threshold}:{order_key}"
    pool: DemoPool | None = ctx.shared.get(f"demo_pool:{key}")
    if pool is None:
        saved = ctx.load_checkpoint(checkpoint)
        if saved is not None and saved.get("key") == key:
            pool = DemoPool(key, saved["order"], saved["records"])
    if pool is None:
        pool = DemoPool(key, order)
    ctx.shared[f"demo_pool:{key}"] = pool
    pool.exhausted_by = None
    names = {id(p): n for n, p in teacher.named_predictors()}
    errors = sum(1 for r in pool.records if r.get("error"))
    while len(pool.successes) < successes and not pool.done:
        start = len(pool.records)
        needed = min(successes - len(pool.successes), max(1, ctx.num_threads))
        outcomes = _run_batch(teacher, names, ctx, pool.order[start:start + needed], metric_threshold, executor)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                break  # keep the batch's prefix only: the pool stays a prefix of the order
            pool.records.append(outcome)
            errors += bool(outcome.get("error"))
        ctx.save_checkpoint(checkpoint, pool.to_dict())
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if isinstance(failure, BudgetStop):
            pool.exhausted_by = failure.error.limit
            break
        if isinstance(failure, BudgetExhausted):
            pool.exhausted_by = failure.limit
            break
        if failure is not None:
            raise failure
        if errors > max(10, len(ctx.trainset) // 2):
            raise LMError(f"bootstrapping stopped: {errors} training examples failed in the program",
                          fix="check the LM and the program on one example")
    return pool


def compose_demos(ctx: StageContext, pool: DemoPool, predictors: list[str], max_bootstrapped: int,
                  max_labeled: int) -> dict[str, list[dict[str, Any]]]:
    """DSPy's ``BootstrapFewShot._train``: per predictor the first ``max_bootstrapped`` traces, then
    labeled examples (not bootstrapped, shuffled and sampled with the compile seed) up to ``max_labeled``."""
    used = {r["index"] for r in pool.successes[:max_bootstrapped]}
    raw = [i for i in pool.order if i not in used]
    random.Random(ctx.seed).shuffle(raw)
    rng = random.Random(ctx.seed)
    out = {}
    for name in predictors:
        augmented = pool.demos_for(name, max_bootstrapped)
        k = max(0, min(max_labeled - len(augmented), len(raw)))
        out[name] = [*augmented, *(ctx.trainset[i].toDict() for i in rng.sample(raw, k))]
    return out


def shuffled_bootstrap(program: dspy.Module, ctx: StageContext, candidate: int, *, max_bootstrapped: int,
                       max_labeled: int, metric_threshold: float | None = None,
                       executor: Executor | None = None) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
    """Candidate ``candidate`` of DSPy's ``BootstrapFewShotWithRandomSearch`` (its seeds 0, 1, ...).

    The trainset is shuffled with ``random.Random(s)``, ``random.Random(s).randint(1, max_bootstrapped)``
    traces are bootstrapped by a teacher whose labeled demos come from the shuffled trainset, and
    labeled examples fill up to ``max_labeled``; ``s`` is ``candidate`` for compile seed 0 (DSPy's
    own seeds) and ``candidate + 100003 * seed`` otherwise. Returns the demos per predictor and the
    budget limit that cut the bootstrap short, if any.
    """
    s = candidate + 100003 * ctx.seed
    order = list(range(len(ctx.trainset)))
    random.Random(s).shuffle(order)
    size = random.Random(s).randint(1, max(1, max_bootstrapped))
    pool = bootstrap_pool(program, ctx, successes=size, max_labeled_demos=max_labeled,
                          metric_threshold=metric_threshold, checkpoint=f"pool-{candidate}", order=order,
                          executor=executor)
    names = [n for n, _ in program.named_predictors()]
    return compose_demos(ctx, pool, names, size, max_labeled), pool.exhausted_by


def _run_batch(teacher: dspy.Module, names: dict[int, str], ctx: StageContext, batch: list[int],
               threshold: float | None, executor: Executor | None = None) -> list[Any]:
    def one(index: int) -> dict[str, Any]:
        return _bootstrap_one(teacher, names, ctx, index, threshold)

    if executor is not None:
        futures = [executor.submit(contextvars.copy_context().run, one, i) for i in batch]
        return [_outcome(f) for f in futures]
    if len(batch) == 1 or ctx.num_threads <= 1:
        out: list[Any] = []
        for i in batch:
            try:
                out.append(one(i))
            except (BudgetStop, FlowoptError) as err:
                out.append(err)
                break
        return out
    with ThreadPoolExecutor(max_workers=len(batch), thread_name_prefix="flowopt-bootstrap") as pool:
        futures = [pool.submit(contextvars.copy_context().run, one, i) for i in batch]
        return [_outcome(f) for f in futures]


def _outcome(future: Future) -> Any:
    try:
        return future.result()
    except (BudgetStop, FlowoptError) as err:
        return err


def _bootstrap_one(teacher: dspy.Module, names: dict[int, str], ctx: StageContext, index: int,
                   threshold: float | None) -> dict[str, Any]:
    example = ctx.trainset[index]
    # A private copy per example: demos are edited below and runs are concurrent.
    local = clone_program(teacher)
    local_names = {id(p): names.get(id(q), n) for (n, p), (_, q) in
                   zip(local.named_predictors(), teacher.named_predictors())}
    for _, predictor in local.named_predictors():
        predictor.demos = [d for d in predictor.demos if d != example]  # never show the answer itself
    try:
        with dspy.context(trace=[]):
            prediction = local(**example.inputs())
            trace = list(dspy.settings.trace)
    except (BudgetStop, WorkflowError):
        raise
    except AdapterParseError as err:  # an unparseable answer is a wrong answer (score 0), not a broken program
        return {"index": index, "success": False, "score": 0.0, "parse_failed": True,
                "detail": f"{type(err).__name__}: {str(err)[:200]}", "demos": {}}
    except Exception as err:  # the program failed on this example: not a success
        return {"index": index, "success": False, "error": f"{type(err).__name__}: {err}", "demos": {}}
    value = score_prediction(lambda ex, pred, _trace: ctx.metric(ex, pred, trace), example, prediction, index)
    success = value >= threshold if threshold is not None else value > 0
    demos: dict[str, list[dict[str, Any]]] = {}
    if success:
        for predictor, inputs, outputs in trace:
            name = local_names.get(id(predictor))
            if name is None:
                continue
            demo = {**dict(inputs), **dict(outputs.items()), "augmented": True}
            demos[name] = [_jsonable(demo)]  # the last call of a predictor wins, as a deterministic choice
    return {"index": index, "success": bool(success), "score": value, "demos": demos}


def _jsonable(demo: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in demo.items():
        try:
            json.dumps(v)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = str(v)
    return out


# ---------------------------------------------------------------------------------------- stage
@dataclass(frozen=True)
class BootstrapFewShot(Stage):
    """Bootstrapped demos (DSPy's recipe, parallel and budgeted), topped up with labeled examples.

    Each predictor gets up to ``max_bootstrapped_demos`` demos from teacher runs that passed the
    metric (``>= metric_threshold``, or truthy when it is ``None``), then labeled examples up to
    ``max_labeled_demos`` in all. With ``seed=0`` these are the demos ``dspy.BootstrapFewShot`` picks.

    Example:
        >>> from flowopt.optimizers.demos import BootstrapFewShot
        >>> BootstrapFewShot(max_bootstrapped_demos=2, max_labeled_demos=4).settings()["max_labeled_demos"]
        4
    """

    name: ClassVar[str] = "demos"
    max_bootstrapped_demos: int = 4
    max_labeled_demos: int = 16
    metric_threshold: float | None = None

    def __post_init__(self) -> None:
        check_stage(self, {"max_bootstrapped_demos": at_least(0), "max_labeled_demos": at_least(0)})

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        pool = bootstrap_pool(program, ctx, successes=self.max_bootstrapped_demos,
                              max_labeled_demos=self.max_labeled_demos, metric_threshold=self.metric_threshold)
        names = [n for n, _ in program.named_predictors()]
        set_demos(program, compose_demos(ctx, pool, names, self.max_bootstrapped_demos, self.max_labeled_demos))
        ctx.record(candidates_tried=1, bootstrapped=len(pool.successes[: self.max_bootstrapped_demos]),
                   attempts=len(pool.records), parse_failures=sum(1 for r in pool.records if r.get("parse_failed")))
        if pool.exhausted_by:
            ctx.record(stop_reason=f"budget: {pool.exhausted_by}")
        return program
