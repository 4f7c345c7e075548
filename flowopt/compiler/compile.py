"""``flowopt.compile``: run stages one after another, each from the best program so far."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import dspy

from flowopt.compiler.budget import LIMITS, Budget, BudgetStop, BudgetTracker
from flowopt.compiler.checkpoint import RunFolder, clone_program, program_from_data
from flowopt.compiler.context import StageContext
from flowopt.compiler.data import check_examples, split_trainset
from flowopt.compiler.evaluate import EvalResult, Evaluator, example_key, program_key
from flowopt.compiler.integrity import check_run_dir
from flowopt.compiler.processes import launched_processes
from flowopt.compiler.report import CompileReport, StageReport
from flowopt.compiler.stage import Stage
from flowopt.compiler.stages import StageSpec, resolve_stages
from flowopt.errors import BudgetExhausted, ConfigError, DataError, LMError
from flowopt.io import space_errors

logger = logging.getLogger("flowopt.compiler")


def compile(
    program: dspy.Module,
    trainset: Sequence[dspy.Example],
    metric: Callable[..., Any],
    *,
    valset: Sequence[dspy.Example] | None = None,
    stages: Sequence[StageSpec] | None = None,
    budget: Budget | Mapping[str, Any] | None = None,
    seed: int = 0,
    run_dir: str | Path | None = None,
    resume: bool = False,
    num_threads: int = 8,
    max_errors: int | None = None,
    quiet: bool = False,
) -> dspy.Module:
    """Compile ``program``: run ``stages`` (default ``["search"]``) and return the best program.

    Each stage starts from the best program so far; the baseline and every stage's output are scored
    on ``valset`` (or a seeded 30% split of ``trainset``) and a stage's output is kept only if it
    scores higher. The input is never modified. The result carries ``.report`` (a
    :class:`CompileReport`); a ``Workflow`` also carries it in ``meta["report"]``.

    ``budget`` limits LM calls, tokens, dollars and wall time across all stages of this call.
    With ``run_dir`` every finished stage, the report and the best program are written there, and
    ``resume=True`` continues an interrupted run: finished stages are skipped and the search
    continues from its last trial.

    Example:
        >>> import dspy, flowopt
        >>> from flowopt.testing import scripted_lm
        >>> lm = scripted_lm(lambda req: {"answer": "4"})
        >>> train = [dspy.Example(question=f"{i}+{4-i}?", answer="4").with_inputs("question") for i in range(6)]
        >>> with dspy.context(lm=lm):
        ...     best = flowopt.compile(dspy.Predict("question -> answer"), train,
        ...                            lambda ex, pred, trace=None: ex.answer == pred.answer,
        ...                            stages=["labeled"], quiet=True)
        >>> best.report.best_score
        1.0
    """
    stage_objs = resolve_stages(stages)
    if not isinstance(program, dspy.Module):
        raise ConfigError(f"program is a {type(program).__name__}, not a dspy.Module",
                          fix="pass a flowopt.Workflow or any dspy.Module")
    if not callable(metric):
        raise ConfigError("metric is not callable", fix="pass metric(example, prediction, trace=None) -> float")
    if isinstance(budget, Mapping):
        unknown = sorted(str(k) for k in budget if k not in LIMITS)
        if unknown:
            raise ConfigError(f"budget has unknown limits {unknown}", fix=f"use only {list(LIMITS)}")
        budget = Budget(**budget)
    budget = budget or Budget()
    if not isinstance(budget, Budget):
        raise ConfigError(f"budget is a {type(budget).__name__}", fix="pass flowopt.Budget(max_lm_calls=...)")
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ConfigError(f"num_threads must be an int >= 1, got {num_threads!r}", fix="pass num_threads=8")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, got {seed!r}", fix="pass seed=0")
    if run_dir is not None:
        run_dir = check_run_dir(run_dir)
    if not isinstance(resume, bool):
        raise ConfigError(f"resume must be True or False, got {resume!r}", fix="pass resume=True to continue a run")

    train = check_examples(program, trainset, "trainset")
    if not train:
        raise DataError("the trainset is empty", fix="pass at least a few dspy.Example objects as trainset")
    if valset is None:
        train, val, val_source = split_trainset(train, seed)
    else:
        val = check_examples(program, valset, "valset")
        if not val:
            raise DataError("the valset is empty", fix="pass a non-empty valset, or leave it out to split the trainset")
        val_source = "given"

    stage_names = [s.name or type(s).__name__ for s in stage_objs]
    rank, processes = launched_processes()
    alone = [n for n, s in zip(stage_names, stage_objs) if not s.multi_process]
    if processes > 1 and alone:
        raise ConfigError(f"compile was launched on {processes} processes, but stages {alone} run in one process "
                          "(every process would repeat them and write the same run folder)",
                          fix="compile those stages in one process first, then launch only the weights stages "
                              "(finetune, grpo) on the program it returns")
    fingerprint = {
        "program": program_key(program, include_lms=False),
        "trainset": _digest(example_key(e) for e in train),
        "valset": _digest(example_key(e) for e in val),
        "metric": getattr(metric, "__qualname__", type(metric).__name__),
        "stages": [{"name": n, "settings": _resumable_settings(s)} for n, s in zip(stage_names, stage_objs)],
        "seed": seed,
    }
    folder = (RunFolder(run_dir, resume=resume, fingerprint=fingerprint, writer=rank == 0)
              if run_dir is not None else None)
    if folder is not None:
        folder.write_manifest()

    tracker = BudgetTracker(budget)
    evaluator = Evaluator(metric, num_threads=num_threads, max_errors=max_errors, quiet=quiet)
    report = CompileReport(seed=seed, n_train=len(train), n_val=len(val), valset_source=val_source,
                           budget=budget.limits())
    shared: dict[str, Any] = {}
    if val_source != "given":
        logger.info("valset: %s", val_source)

    from tqdm.auto import tqdm

    with tracker.activate():
        best = clone_program(program)
        start = best
        baseline_score: list[float] = []

        def score_baseline() -> float:
            if not baseline_score:  # scored once, whoever asks first
                baseline = _baseline_row(start, val, evaluator, tracker, folder)
                report.stages.insert(0, baseline)
                baseline_score.append(baseline.score if baseline.score is not None else float("-inf"))
            return baseline_score[0]

        # A first stage that scores its start itself (a shared search) is run before the baseline,
        # which then comes from the scores it left: no second scoring of the same program.
        deferred = bool(stage_objs) and stage_objs[0].scores_its_start() and (folder is None or (
            folder.baseline() is None and folder.finished(0, stage_names[0]) is None))
        best_score = float("-inf") if deferred else score_baseline()
        bar = tqdm(total=len(stage_objs), desc="compile", disable=quiet)
        try:
            for index, (name, stage) in enumerate(zip(stage_names, stage_objs)):
                bar.set_postfix_str(name)
                done = folder.finished(index, name) if folder is not None else None
                if done is not None:
                    row = StageReport.from_dict(done["row"])
                    row.resumed = True
                    if row.kept and done.get("program") is not None:
                        best = program_from_data(done["program"], program)
                        best_score = row.score if row.score is not None else best_score
                    logger.info("stage %s: finished in an earlier run (score %s), skipped", name, row.score)
                else:
                    before = score_baseline if deferred and index == 0 else (lambda score=best_score: score)
                    row, out = _run_stage(index, name, stage, best, before, train, val, metric, tracker,
                                          evaluator, folder, seed, resume, quiet, num_threads, shared)
                    best_score = before()  # the deferred baseline is scored by now, whatever the stage did
                    if row.kept and out is not None:
                        best, best_score = out, row.score if row.score is not None else best_score
                    if folder is not None and not row.stop_reason.startswith("budget"):
                        # Saved kept or not: a rejected output can still be scored on its own (saved_output).
                        folder.save_finished(index, name, out, row.to_dict())
                report.stages.append(row)
                _finish_report(report, tracker)
                if folder is not None:
                    folder.save_report(report.to_dict())
                bar.update(1)
        finally:
            bar.close()

    _finish_report(report, tracker)
    result = clone_program(best)
    result.report = report
    meta = getattr(result, "meta", None)
    if isinstance(meta, dict):
        meta["report"] = report.to_dict()
    if folder is not None:
        folder.save_report(report.to_dict())
        folder.save_program(result)
    logger.info("compile finished:\n%s", report.table())
    return result


def _digest(parts: Any) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p.encode("utf-8"))
    return h.hexdigest()


def _baseline_row(program: Any, val: list[Any], evaluator: Evaluator, tracker: BudgetTracker,
                  folder: RunFolder | None) -> StageReport:
    saved = folder.baseline() if folder is not None else None
    if saved is not None:
        row = StageReport.from_dict(saved)
        row.resumed = True
        return row
    before = tracker.snapshot()
    start = time.monotonic()
    with tracker.guard():  # a budget too small even for the baseline is an error: nothing to compare to
        result = evaluator.evaluate(program, val, desc="baseline")
    row = StageReport("baseline", score=result.score, ci=result.ci, kept=True, info={"errors": result.errors})
    _fill_usage(row, tracker.snapshot().minus(before), time.monotonic() - start)
    if folder is not None:
        folder.save_baseline(row.to_dict())
    return row


def _resumable_settings(stage: Stage) -> dict[str, Any]:
    """The settings a resumed run must repeat: all but those that only trade time for memory."""
    return {k: v for k, v in stage.settings().items() if k not in stage.memory_settings}


def _run_stage(index: int, name: str, stage: Stage, best: Any, score_before: Callable[[], float], train: list[Any],
               val: list[Any], metric: Callable[..., Any], tracker: BudgetTracker, evaluator: Evaluator,
               folder: RunFolder | None, seed: int, resume: bool, quiet: bool, num_threads: int,
               shared: dict[str, Any]) -> tuple[StageReport, Any]:
    row = StageReport(name, settings=stage.settings())
    limit = tracker.exhausted()
    if limit is not None:
        row.stop_reason = f"budget: {limit} (not run)"
        logger.warning("stage %s not run: budget %s exhausted", name, limit)
        return row, None
    ctx = StageContext(
        trainset=list(train), valset=list(val), metric=metric, budget=tracker, seed=seed,
        rng=random.Random(f"flowopt:{seed}:{index}:{name}"),
        run_dir=folder.stage_dir(index, name) if folder is not None else None, resume=resume,
        logger=logging.getLogger(f"flowopt.compiler.{name}"), quiet=quiet, num_threads=num_threads,
        stage_name=name, shared=shared, evaluator=evaluator,
    )
    before = tracker.snapshot()
    start = time.monotonic()
    out: Any = None
    try:
        with tracker.guard(), space_errors(ctx.run_dir, folder=True):
            out = stage.run(clone_program(best), ctx)
    except BudgetExhausted as err:  # a stage that did not catch it itself: it returned nothing
        row.stop_reason = f"budget: {err.limit}"
    except BudgetStop as stop:
        row.stop_reason = f"budget: {stop.error.limit}"
    except LMError as err:  # too many failed examples: stop this stage, keep the best so far
        row.stop_reason = f"error: {err.problem}"
        logger.error("stage %s stopped: %s", name, err)
    if out is not None:
        if not isinstance(out, dspy.Module):
            raise ConfigError(f"stage {name!r} returned a {type(out).__name__}, not a dspy.Module",
                              fix=f"make {type(stage).__name__}.run return the program")
        try:
            scored: EvalResult | None = evaluator.evaluate(out, val, desc=f"{name}: validate")
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
    info = dict(ctx.info)
    if "candidates_tried" in info:
        row.candidates_tried = info.pop("candidates_tried")
    reason = info.pop("stop_reason", None)
    if reason and row.stop_reason == "done":
        row.stop_reason = str(reason)
    row.info.update(_jsonable(info))
    _fill_usage(row, tracker.snapshot().minus(before), time.monotonic() - start)
    logger.info("stage %s: score %s (%s), %s", name, row.score, "kept" if row.kept else "not kept", row.stop_reason)
    return row, out


def _fill_usage(row: StageReport, usage: Any, wall_s: float) -> None:
    row.lm_calls, row.cache_hits, row.tokens = usage.lm_calls, usage.cache_hits, usage.tokens
    row.cost_usd, row.wall_s = round(usage.cost_usd, 10), round(wall_s, 3)


def _finish_report(report: CompileReport, tracker: BudgetTracker) -> None:
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
