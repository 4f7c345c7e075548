"""Few-shot demonstration stages: ``LabeledFewShot`` and ``BootstrapFewShot``.

Bootstrapping follows DSPy's ``BootstrapFewShot`` (a teacher with labeled demos runs on training
examples; the predictor calls of runs that pass the metric become demos), with three changes that
matter to the compiler: examples run in parallel threads, every LM call is under the shared
budget, and the pool of bootstrapped traces is checkpointed and shared with later stages (the
search draws its demo subsets from it).
"""

from __future__ import annotations

import contextvars
import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import dspy

from flowopt.compiler import BudgetStop, Stage, StageContext, clone_program
from flowopt.compiler.evaluate import program_key, score_prediction
from flowopt.errors import BudgetExhausted, ConfigError, FlowoptError, LMError, WorkflowError


def _check_count(owner: str, name: str, value: Any, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{owner} {name} must be an int >= {minimum}, got {value!r}", fix=f"pass {name}=4")


def _as_demo(data: dict[str, Any]) -> dspy.Example:
    return dspy.Example(**data)


def _labeled(trainset: list[Any], k: int, rng: random.Random) -> list[dict[str, Any]]:
    k = min(k, len(trainset))
    return [ex.toDict() for ex in rng.sample(trainset, k)] if k else []


@dataclass(frozen=True)
class LabeledFewShot(Stage):
    """Put ``k`` training examples (sampled with the stage's seed) as demos on every predictor.

    Example:
        >>> from flowopt.optimizers.demos import LabeledFewShot
        >>> LabeledFewShot(k=8).settings()
        {'k': 8}
    """

    name: ClassVar[str] = "labeled"
    k: int = 16

    def __post_init__(self) -> None:
        _check_count("LabeledFewShot", "k", self.k, 1)

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        demos = _labeled(ctx.trainset, self.k, ctx.rng)
        for _, predictor in program.named_predictors():
            predictor.demos = [_as_demo(d) for d in demos]
        ctx.record(candidates_tried=1, demos=len(demos))
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


def build_teacher(program: dspy.Module, ctx: StageContext, max_labeled_demos: int) -> dspy.Module:
    """The program with ``max_labeled_demos`` labeled demos per predictor, sampled with the compile seed.

    It depends on the compile seed only (not the stage), so the demos stage and the search build the
    same teacher, send the same prompts, and share one pool (and the LM cache).
    """
    teacher = clone_program(program)
    demos = _labeled(ctx.trainset, max_labeled_demos, random.Random(f"flowopt-teacher:{ctx.seed}"))
    for _, predictor in teacher.named_predictors():
        predictor.demos = [_as_demo(d) for d in demos]
    return teacher


def bootstrap_pool(program: dspy.Module, ctx: StageContext, *, successes: int, max_labeled_demos: int = 16,
                   metric_threshold: float | None = None, checkpoint: str = "pool") -> DemoPool:
    """Run the teacher on training examples until ``successes`` of them pass the metric.

    Examples run ``ctx.num_threads`` at a time; the pool is kept in ``ctx.shared`` (later stages
    extend it) and checkpointed after every batch. A budget refusal stops it with what it has
    (``pool.exhausted_by`` names the limit).
    """
    teacher = build_teacher(program, ctx, max_labeled_demos)
    key = f"{program_key(teacher)}:{metric_threshold}"
    pool: DemoPool | None = ctx.shared.get(f"demo_pool:{key}")
    if pool is None:
        saved = ctx.load_checkpoint(checkpoint)
        if saved is not None and saved.get("key") == key:
            pool = DemoPool(key, saved["order"], saved["records"])
    if pool is None:
        pool = DemoPool(key, list(range(len(ctx.trainset))))  # trainset order, as DSPy bootstraps
    ctx.shared[f"demo_pool:{key}"] = pool
    pool.exhausted_by = None
    names = {id(p): n for n, p in teacher.named_predictors()}
    bar = ctx.progress(total=successes, desc=f"{ctx.stage_name}: bootstrap",
                       initial=min(successes, len(pool.successes)))
    errors = sum(1 for r in pool.records if r.get("error"))
    try:
        while len(pool.successes) < successes and not pool.done:
            start = len(pool.records)
            batch = pool.order[start:start + max(1, ctx.num_threads)]
            outcomes = _run_batch(teacher, names, ctx, batch, metric_threshold)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    break  # keep the batch's prefix only: the pool stays a prefix of the order
                pool.records.append(outcome)
                errors += bool(outcome.get("error"))
                bar.update(int(outcome["success"]))
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
    finally:
        bar.close()
    return pool


def _run_batch(teacher: dspy.Module, names: dict[int, str], ctx: StageContext, batch: list[int],
               threshold: float | None) -> list[Any]:
    def one(index: int) -> dict[str, Any]:
        return _bootstrap_one(teacher, names, ctx, index, threshold)

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
        results: list[Any] = []
        for f in futures:
            try:
                results.append(f.result())
            except (BudgetStop, FlowoptError) as err:
                results.append(err)
        return results


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
    ``max_labeled_demos`` in all.

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
        _check_count("BootstrapFewShot", "max_bootstrapped_demos", self.max_bootstrapped_demos)
        _check_count("BootstrapFewShot", "max_labeled_demos", self.max_labeled_demos)
        if self.metric_threshold is not None and not isinstance(self.metric_threshold, int | float):
            raise ConfigError(f"metric_threshold must be a number or None, got {self.metric_threshold!r}",
                              fix="pass metric_threshold=1.0")

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        pool = bootstrap_pool(program, ctx, successes=self.max_bootstrapped_demos,
                              max_labeled_demos=self.max_labeled_demos, metric_threshold=self.metric_threshold)
        used = {r["index"] for r in pool.successes[: self.max_bootstrapped_demos]}
        raw = [ctx.trainset[i] for i in pool.order if i not in used]
        rng = random.Random(f"flowopt-labeled:{ctx.seed}")
        for name, predictor in program.named_predictors():
            augmented = pool.demos_for(name, self.max_bootstrapped_demos)
            k = max(0, min(self.max_labeled_demos - len(augmented), len(raw)))
            labeled = [ex.toDict() for ex in rng.sample(raw, k)] if k else []
            predictor.demos = [_as_demo(d) for d in [*augmented, *labeled]]
        ctx.record(candidates_tried=1, bootstrapped=len(pool.successes[: self.max_bootstrapped_demos]),
                   attempts=len(pool.records))
        if pool.exhausted_by:
            ctx.record(stop_reason=f"budget: {pool.exhausted_by}")
        return program
