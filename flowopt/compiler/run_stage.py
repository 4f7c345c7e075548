"""Running one stage of a compile: its context, its run, the score of what it returned, its report row.

:class:`CompileRun` is what every stage of one :func:`~flowopt.compiler.compile` call shares.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dspy

from flowopt.compiler.budget import BudgetStop, BudgetTracker, Usage
from flowopt.compiler.checkpoint import RunFolder, clone_program
from flowopt.compiler.context import StageContext, StageOutcome
from flowopt.compiler.evaluate import EvalResult, Evaluator
from flowopt.compiler.report import CompileReport, StageReport
from flowopt.compiler.stage import Stage
from flowopt.errors import BudgetExhausted, ConfigError, LMError
from flowopt.io import space_errors

logger = logging.getLogger("flowopt.compiler")


@dataclass
class CompileRun:
    """What the stages of one compile call share: the data, the metric, the budget's tracker, the
    evaluator (its memo), the run folder, the seed and the report being built.

    ``shared`` is the in-process dict stages hand artefacts through (``StageContext.shared``).
    """

    program: dspy.Module  # the user's program, as given (a resumed stage's program is rebuilt on it)
    train: list[Any]
    val: list[Any]
    metric: Callable[..., Any]
    tracker: BudgetTracker
    evaluator: Evaluator
    report: CompileReport
    folder: RunFolder | None = None
    seed: int = 0
    resume: bool = False
    quiet: bool = False
    num_threads: int = 8
    shared: dict[str, Any] = field(default_factory=dict)

    def context(self, index: int, name: str) -> StageContext:
        """The context of stage ``index`` (named ``name``): its own folder and rng, the shared rest."""
        return StageContext(
            trainset=list(self.train), valset=list(self.val), metric=self.metric, budget=self.tracker,
            seed=self.seed, rng=random.Random(f"flowopt:{self.seed}:{index}:{name}"),
            run_dir=self.folder.stage_dir(index, name) if self.folder is not None else None, resume=self.resume,
            logger=logging.getLogger(f"flowopt.compiler.{name}"), quiet=self.quiet, num_threads=self.num_threads,
            stage_name=name, shared=self.shared, evaluator=self.evaluator,
        )


def baseline_row(run: CompileRun, program: Any) -> StageReport:
    """The baseline's report row: ``program`` scored on the valset (or the row saved by an earlier run)."""
    saved = run.folder.baseline() if run.folder is not None else None
    if saved is not None:
        row = StageReport.from_dict(saved)
        row.resumed = True
        return row
    before = run.tracker.snapshot()
    start = time.monotonic()
    with run.tracker.guard():  # a budget too small even for the baseline is an error: nothing to compare to
        result = run.evaluator.evaluate(program, run.val, desc="baseline")
    row = StageReport("baseline", score=result.score, ci=result.ci, kept=True, info={"errors": result.errors})
    _fill_usage(row, run.tracker.snapshot().minus(before), time.monotonic() - start)
    if run.folder is not None:
        run.folder.save_baseline(row.to_dict())
    return row


def run_stage(run: CompileRun, index: int, name: str, stage: Stage, best: Any,
              score_before: Callable[[], float]) -> tuple[StageReport, Any]:
    """Run ``stage`` from a copy of ``best``, score what it returned; its report row and its program
    (``None`` when it returned nothing). ``score_before`` gives the best score so far."""
    row = StageReport(name, settings=stage.settings())
    limit = run.tracker.exhausted()
    if limit is not None:
        row.stop_reason = f"budget: {limit} (not run)"
        logger.warning("stage %s not run: budget %s exhausted", name, limit)
        return row, None
    ctx = run.context(index, name)
    before = run.tracker.snapshot()
    start = time.monotonic()
    out: Any = None
    try:
        with run.tracker.guard(), space_errors(ctx.run_dir, folder=True):
            out = stage.run(clone_program(best), ctx)
    except BudgetExhausted as err:  # a stage that did not catch it itself: it returned nothing
        row.stop_reason = f"budget: {err.limit}"
    except BudgetStop as stop:
        row.stop_reason = f"budget: {stop.error.limit}"
    except LMError as err:  # too many failed examples: stop this stage, keep the best so far
        row.stop_reason = f"error: {err.problem}"
        logger.error("stage %s stopped: %s", name, err)
    if out is not None:
        _score_output(run, row, stage, out, score_before)
    _take_outcome(row, ctx.outcome, ctx.info)
    _fill_usage(row, run.tracker.snapshot().minus(before), time.monotonic() - start)
    logger.info("stage %s: score %s (%s), %s", name, row.score, "kept" if row.kept else "not kept", row.stop_reason)
    return row, out


def _score_output(run: CompileRun, row: StageReport, stage: Stage, out: Any, score_before: Callable[[], float]) -> None:
    """Score the stage's program on the valset; it is kept when it beats the best so far."""
    if not isinstance(out, dspy.Module):
        raise ConfigError(f"stage {row.name!r} returned a {type(out).__name__}, not a dspy.Module",
                          fix=f"make {type(stage).__name__}.run return the program")
    try:
        scored: EvalResult | None = run.evaluator.evaluate(out, run.val, desc=f"{row.name}: validate")
    except BudgetStop as stop:
        scored = None
        row.stop_reason = f"budget: {stop.error.limit}"
        row.info["unscored"] = "the budget ran out before the stage's output was scored; it was not kept"
    if scored is not None:
        best_score = score_before()
        row.score, row.ci = scored.score, scored.ci
        row.change = scored.score - best_score if best_score != float("-inf") else None
        row.kept = scored.score > best_score
        row.info["errors"] = scored.errors


def _take_outcome(row: StageReport, outcome: StageOutcome, info: dict[str, Any]) -> None:
    """The stage's typed outcome into the row's columns (its stop reason unless the compiler set one),
    its other facts into ``row.info`` (``best_candidate`` too, where the report has always kept it)."""
    if outcome.candidates_tried is not None:
        row.candidates_tried = outcome.candidates_tried
    if outcome.stop_reason and row.stop_reason == "done":
        row.stop_reason = str(outcome.stop_reason)
    facts = dict(info)
    if outcome.best_candidate is not None:
        facts["best_candidate"] = outcome.best_candidate
    row.info.update(_jsonable(facts))


def _fill_usage(row: StageReport, usage: Usage, wall_s: float) -> None:
    row.lm_calls, row.cache_hits, row.tokens = usage.lm_calls, usage.cache_hits, usage.tokens
    row.cost_usd, row.wall_s = round(usage.cost_usd, 10), round(wall_s, 3)


def finish_report(report: CompileReport, tracker: BudgetTracker) -> None:
    """Totals over every stage (earlier runs' resumed ones included), the best stage and the stop reason."""
    usage = tracker.snapshot()
    prior = [s for s in report.stages if s.resumed]
    report.total = {
        "lm_calls": usage.lm_calls + sum(s.lm_calls for s in prior),
        "cache_hits": usage.cache_hits + sum(s.cache_hits for s in prior),
        "tokens": usage.tokens + sum(s.tokens for s in prior),
        "cost_usd": round(usage.cost_usd + sum(s.cost_usd for s in prior), 10),
        "wall_s": round(usage.wall_s, 3),
        "this_run": usage.to_dict(),
    }
    best_score, best_stage = float("-inf"), "baseline"
    for s in report.stages:
        if s.kept and s.score is not None and (s.name == "baseline" or s.score > best_score):
            best_score, best_stage = s.score, s.name
    report.best_stage = best_stage
    stops = [s.stop_reason for s in report.stages if s.stop_reason.startswith("budget")]
    report.stop_reason = stops[0] if stops else "done"


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(data, default=repr))
    except (TypeError, ValueError):
        return {k: repr(v) for k, v in data.items()}
