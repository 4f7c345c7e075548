"""DSPy's strongest prompt optimizers as compile stages: ``mipro`` (``dspy.MIPROv2``) and ``gepa`` (``dspy.GEPA``).

They run inside ``compile()`` like any stage, so they share the pipeline's budget: every LM call they
make (task, proposer and reflection models alike) goes through flowopt's DSPy hooks, is counted in
the report and is refused once a ``Budget`` limit is reached. A run the budget cuts short returns the
program it started from (DSPy's optimizers hand back nothing partial) with ``stop_reason``
``"budget: ..."``; GEPA can also be bounded by its own ``max_metric_calls``, which by default is
sized to fit what a ``max_lm_calls`` budget leaves (three quarters of it).

Checkpoints: a finished stage is saved by the compile run folder like any stage. GEPA also keeps its
own state in ``run_dir/gepa`` (DSPy's ``log_dir``), so a killed GEPA run resumes where it stopped;
MIPROv2 cannot resume inside a run and starts that stage again.

Example:
    >>> from flowopt.optimizers.dspy_optimizers import GEPAStage, MIPROStage
    >>> MIPROStage().settings()["auto"], GEPAStage(max_metric_calls=200).settings()["max_metric_calls"]
    ('light', 200)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import dspy

from flowopt.compiler import Stage, StageContext
from flowopt.errors import BudgetExhausted, ConfigError
from flowopt.settings import at_least, check_stage, one_of

AUTO = ("light", "medium", "heavy")


def _calls(ctx: StageContext) -> int:
    return ctx.budget.snapshot().lm_calls


def _task_lm(program: dspy.Module) -> Any:
    """The configured LM, else the first LM the program's own predictors or nodes use.

    DSPy's optimizers look for ``dspy.settings.lm``; a program whose LMs are bound to its predictors
    (or to a Workflow's nodes) runs without one, so the stage hands them the program's own LM.
    """
    if dspy.settings.lm is not None:
        return dspy.settings.lm
    from flowopt.optimizers.weights.student import program_lms

    lms = program_lms(program)
    if not lms:
        raise ConfigError("the program has no LM for DSPy's optimizer to use",
                          fix="configure dspy with dspy.configure(lm=...) or bind an LM to the program")
    return lms[0]


@dataclass(frozen=True)
class MIPROStage(Stage):
    """``dspy.MIPROv2`` as a stage: instructions and demo sets chosen by Bayesian optimisation.

    Settings: ``auto`` (``"light"``, ``"medium"``, ``"heavy"``; or ``None`` with ``num_trials``),
    ``num_trials``, ``num_candidates`` (instruction and demo-set candidates; with ``auto=None``
    default ``max(2, num_trials // 2)``), ``max_bootstrapped_demos``, ``max_labeled_demos``, ``minibatch_size`` and
    ``prompt_model`` (the LM that writes instructions; default: the task LM). The seed is the
    compile seed.

    Example:
        >>> from flowopt.optimizers.dspy_optimizers import MIPROStage
        >>> MIPROStage(auto=None, num_trials=6).num_trials
        6
    """

    name: ClassVar[str] = "mipro"
    auto: str | None = "light"
    num_trials: int | None = None
    num_candidates: int | None = None
    max_bootstrapped_demos: int = 4
    max_labeled_demos: int = 4
    minibatch_size: int = 35
    prompt_model: Any = None

    def __post_init__(self) -> None:
        check_stage(self, {"auto": one_of(*AUTO), "num_trials": at_least(1), "num_candidates": at_least(1),
                           "max_bootstrapped_demos": at_least(0), "max_labeled_demos": at_least(0),
                           "minibatch_size": at_least(1)})
        if self.auto is None and self.num_trials is None:
            raise ConfigError("MIPROStage needs auto or num_trials", fix='pass auto="light" or num_trials=10')

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        candidates = self.num_candidates
        if candidates is None and self.auto is None:
            candidates = max(2, (self.num_trials or 4) // 2)
        task_lm = _task_lm(program)
        optimizer = dspy.MIPROv2(metric=ctx.metric, prompt_model=self.prompt_model or task_lm, task_model=task_lm,
                                 auto=self.auto,
                                 num_candidates=candidates,
                                 max_bootstrapped_demos=self.max_bootstrapped_demos,
                                 max_labeled_demos=self.max_labeled_demos, num_threads=ctx.num_threads,
                                 seed=ctx.seed, verbose=False)
        before = _calls(ctx)
        try:
            ctx.budget.check()
            with ctx.budget.guard(), dspy.context(lm=task_lm):
                out = optimizer.compile(program, trainset=ctx.trainset, valset=ctx.valset, num_trials=self.num_trials,
                                        minibatch=len(ctx.valset) > self.minibatch_size,
                                        minibatch_size=self.minibatch_size, seed=ctx.seed)
        except BudgetExhausted as err:
            ctx.record(stop_reason=f"budget: {err.limit}", dspy_lm_calls=_calls(ctx) - before)
            return program
        logs = getattr(out, "trial_logs", None) or {}
        full = [v.get("full_eval_score") for v in logs.values() if v.get("full_eval_score") is not None]
        ctx.record(candidates_tried=len(logs), dspy_lm_calls=_calls(ctx) - before,
                   best_value=round(float(getattr(out, "score", max(full, default=0.0)) or 0.0), 6),
                   full_evals=len(full), why="MIPROv2's best full-valset score among its trials")
        return out


@dataclass(frozen=True)
class GEPAStage(Stage):
    """``dspy.GEPA`` as a stage: instructions evolved by LM reflection on the program's traces.

    Settings: exactly one of ``auto``, ``max_full_evals``, ``max_metric_calls`` (GEPA's own budget;
    when none is given: three quarters of what a ``max_lm_calls`` budget leaves, else ``auto="light"``),
    ``reflection_lm`` (default: the task LM), ``reflection_minibatch_size`` and ``use_merge``. The
    user's metric is wrapped into GEPA's five-argument form (its score is GEPA's feedback).

    Example:
        >>> from flowopt.optimizers.dspy_optimizers import GEPAStage
        >>> GEPAStage(auto="light").auto
        'light'
    """

    name: ClassVar[str] = "gepa"
    auto: str | None = None
    max_full_evals: int | None = None
    max_metric_calls: int | None = None
    reflection_lm: Any = None
    reflection_minibatch_size: int = 3
    use_merge: bool = True

    def __post_init__(self) -> None:
        check_stage(self, {"auto": one_of(*AUTO), "max_full_evals": at_least(1), "max_metric_calls": at_least(1),
                           "reflection_minibatch_size": at_least(1)})
        given = [n for n in ("auto", "max_full_evals", "max_metric_calls") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ConfigError(f"GEPAStage takes one of auto, max_full_evals, max_metric_calls; got {given}",
                              fix="pass only one of them")

    def _limits(self, ctx: StageContext) -> dict[str, Any]:
        if self.auto is not None:
            return {"auto": self.auto}
        if self.max_full_evals is not None:
            return {"max_full_evals": self.max_full_evals}
        if self.max_metric_calls is not None:
            return {"max_metric_calls": self.max_metric_calls}
        remaining = ctx.budget.remaining_calls()
        if remaining is not None:
            # One metric call is one program run; reflection calls and GEPA's final full-valset pass come
            # on top, and a run the budget cuts short returns nothing: leave a quarter for them.
            return {"max_metric_calls": max(1, int(remaining * 0.75))}
        return {"auto": "light"}

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        metric = ctx.metric

        def feedback(gold: Any, pred: Any, trace: Any = None, pred_name: Any = None, pred_trace: Any = None) -> float:
            return float(metric(gold, pred, trace))

        task_lm = _task_lm(program)
        reflection = self.reflection_lm or task_lm
        limits = self._limits(ctx)
        log_dir = str(ctx.run_dir / "gepa") if ctx.run_dir is not None else None
        optimizer = dspy.GEPA(metric=feedback, reflection_lm=reflection, num_threads=ctx.num_threads,
                              reflection_minibatch_size=self.reflection_minibatch_size, use_merge=self.use_merge,
                              track_stats=True, seed=ctx.seed, log_dir=log_dir, **limits)
        before = _calls(ctx)
        try:
            ctx.budget.check()
            with ctx.budget.guard(), dspy.context(lm=task_lm):
                out = optimizer.compile(program, trainset=ctx.trainset, valset=ctx.valset)
        except BudgetExhausted as err:
            ctx.record(stop_reason=f"budget: {err.limit}", dspy_lm_calls=_calls(ctx) - before, gepa_limits=limits)
            return program
        results = getattr(out, "detailed_results", None)
        scores = list(getattr(results, "val_aggregate_scores", []) or [])
        ctx.record(candidates_tried=len(scores), dspy_lm_calls=_calls(ctx) - before, gepa_limits=limits,
                   metric_calls=getattr(results, "total_metric_calls", None),
                   best_value=round(max(scores), 6) if scores else None,
                   why="GEPA's best aggregate valset score among its candidates")
        return out
