"""``flowopt.compile``: run stages one after another, each from the best program so far."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import dspy

from flowopt.compiler.budget import LIMITS, Budget, BudgetTracker
from flowopt.compiler.checkpoint import RunFolder, clone_program, program_from_data
from flowopt.compiler.data import check_examples, split_trainset
from flowopt.compiler.evaluate import Evaluator, example_key, program_key
from flowopt.compiler.integrity import check_run_dir
from flowopt.compiler.interrupt import StopRequest, stop_on_signals
from flowopt.compiler.processes import launched_processes
from flowopt.compiler.report import CompileReport, StageReport
from flowopt.compiler.run_stage import CompileRun, baseline_row, finish_report, run_stage
from flowopt.compiler.stage import Stage
from flowopt.compiler.stages import StageSpec, resolve_stages
from flowopt.errors import BudgetExhausted, ConfigError, DataError, Interrupted
from flowopt.settings import at_least, check_settings

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
    budget = _checked_arguments(program, metric, budget, seed=seed, resume=resume, num_threads=num_threads,
                                max_errors=max_errors, quiet=quiet)
    run_path = check_run_dir(run_dir) if run_dir is not None else None
    train, val, val_source = _splits(program, trainset, valset, seed)
    stage_names = [s.name or type(s).__name__ for s in stage_objs]
    rank = _check_processes(stage_names, stage_objs)
    folder = None
    if run_path is not None:
        fingerprint = _fingerprint(program, train, val, metric, stage_names, stage_objs, seed)
        folder = RunFolder(run_path, resume=resume, fingerprint=fingerprint, writer=rank == 0)
        folder.write_manifest()
    if val_source != "given":
        logger.info("valset: %s", val_source)
    run = CompileRun(
        program=program, train=train, val=val, metric=metric, tracker=BudgetTracker(budget),
        evaluator=Evaluator(metric, num_threads=num_threads, max_errors=max_errors, quiet=quiet),
        folder=folder, seed=seed, resume=resume, quiet=quiet, num_threads=num_threads,
        report=CompileReport(seed=seed, n_train=len(train), n_val=len(val), valset_source=val_source,
                             budget=budget.limits()),
    )
    with run.tracker.activate(), stop_on_signals(run.tracker.request_stop) as stop:
        try:
            best = _run_stages(run, stage_names, stage_objs)
        except BudgetExhausted:  # the baseline's scoring was interrupted
            if stop.signal is None:
                raise
    if stop.signal is not None:
        raise _interrupted(run, stop)
    return _result(run, best)


def _interrupted(run: CompileRun, stop: StopRequest) -> Interrupted:
    """The error for a compile a signal stopped: what the run folder keeps and how to continue."""
    if run.folder is None:
        return Interrupted(f"compile stopped by {stop.signal}; without a run_dir nothing was kept",
                           signal=str(stop.signal), number=stop.number,
                           fix="pass run_dir=... so that an interrupted compile can be resumed")
    return Interrupted(f"compile stopped by {stop.signal} at a safe point; {run.folder.path} keeps every finished "
                       "stage and the interrupted stage's checkpoints", signal=str(stop.signal), number=stop.number,
                       fix="rerun the same compile with resume=True (flowopt bench: --resume) to continue")


def _checked_arguments(program: Any, metric: Any, budget: Any, **settings: Any) -> Budget:
    """Check compile's own arguments (the types its signature declares); the budget as a :class:`Budget`."""
    if not isinstance(program, dspy.Module):
        raise ConfigError(f"program is a {type(program).__name__}, not a dspy.Module",
                          fix="pass a flowopt.Workflow or any dspy.Module")
    if not callable(metric):
        raise ConfigError("metric is not callable", fix="pass metric(example, prediction, trace=None) -> float")
    check_settings("compile", settings, hints=compile,
                   bounds={"num_threads": at_least(1), "max_errors": at_least(0)})
    if isinstance(budget, Mapping):
        unknown = sorted(str(k) for k in budget if k not in LIMITS)
        if unknown:
            raise ConfigError(f"budget has unknown limits {unknown}", fix=f"use only {list(LIMITS)}")
        budget = Budget(**budget)
    budget = budget or Budget()
    if not isinstance(budget, Budget):
        raise ConfigError(f"budget is a {type(budget).__name__}", fix="pass flowopt.Budget(max_lm_calls=...)")
    return budget


def _splits(program: Any, trainset: Sequence[Any], valset: Sequence[Any] | None,
            seed: int) -> tuple[list[Any], list[Any], str]:
    """The checked trainset and valset (a seeded split of the trainset when none is given), and where
    the valset came from."""
    train = check_examples(program, trainset, "trainset")
    if not train:
        raise DataError("the trainset is empty", fix="pass at least a few dspy.Example objects as trainset")
    if valset is None:
        return split_trainset(train, seed)
    val = check_examples(program, valset, "valset")
    if not val:
        raise DataError("the valset is empty", fix="pass a non-empty valset, or leave it out to split the trainset")
    return train, val, "given"


def _check_processes(stage_names: list[str], stage_objs: list[Stage]) -> int:
    """This process's rank; refuses one-process stages when compile was launched on several processes."""
    rank, processes = launched_processes()
    alone = [n for n, s in zip(stage_names, stage_objs) if not s.multi_process]
    if processes > 1 and alone:
        raise ConfigError(f"compile was launched on {processes} processes, but stages {alone} run in one process "
                          "(every process would repeat them and write the same run folder)",
                          fix="compile those stages in one process first, then launch only the weights stages "
                              "(finetune, grpo) on the program it returns")
    return rank


def _fingerprint(program: Any, train: list[Any], val: list[Any], metric: Any, stage_names: list[str],
                 stage_objs: list[Stage], seed: int) -> dict[str, Any]:
    """What a resumed run must share with the one it continues."""
    return {
        "program": program_key(program, include_lms=False),
        "trainset": _digest(example_key(e) for e in train),
        "valset": _digest(example_key(e) for e in val),
        "metric": getattr(metric, "__qualname__", type(metric).__name__),
        "stages": [{"name": n, "settings": _resumable_settings(s)} for n, s in zip(stage_names, stage_objs)],
        "seed": seed,
    }


def _run_stages(run: CompileRun, stage_names: list[str], stage_objs: list[Stage]) -> Any:
    """Run (or skip, when finished in an earlier run) every stage; the best program."""
    from tqdm.auto import tqdm

    folder, report = run.folder, run.report
    best = clone_program(run.program)
    start = best
    baseline_score: list[float] = []

    def score_baseline() -> float:
        if not baseline_score:  # scored once, whoever asks first
            baseline = baseline_row(run, start)
            report.stages.insert(0, baseline)
            baseline_score.append(baseline.score if baseline.score is not None else float("-inf"))
        return baseline_score[0]

    # A first stage that scores its start itself (a shared search) is run before the baseline,
    # which then comes from the scores it left: no second scoring of the same program.
    deferred = bool(stage_objs) and stage_objs[0].scores_its_start() and (folder is None or (
        folder.baseline() is None and folder.finished(0, stage_names[0]) is None))
    best_score = float("-inf") if deferred else score_baseline()
    bar = tqdm(total=len(stage_objs), desc="compile", disable=run.quiet)
    try:
        for index, (name, stage) in enumerate(zip(stage_names, stage_objs)):
            bar.set_postfix_str(name)
            done = folder.finished(index, name) if folder is not None else None
            if done is not None:
                row = StageReport.from_dict(done["row"])
                row.resumed = True
                if row.kept and done.get("program") is not None:
                    best = program_from_data(done["program"], run.program)
                    best_score = row.score if row.score is not None else best_score
                logger.info("stage %s: finished in an earlier run (score %s), skipped", name, row.score)
            else:
                before = score_baseline if deferred and index == 0 else (lambda score=best_score: score)
                row, out = run_stage(run, index, name, stage, best, before)
                best_score = before()  # the deferred baseline is scored by now, whatever the stage did
                if row.kept and out is not None:
                    best, best_score = out, row.score if row.score is not None else best_score
                if run.tracker.stop_reason is not None:  # a signal: nothing of this stage counts as finished
                    break
                if folder is not None:
                    # Saved kept or not: a rejected output can still be scored on its own (saved_output). One
                    # the budget stopped is saved as unfinished, so that --resume runs the stage again.
                    folder.save_finished(index, name, out, row.to_dict(),
                                         finished=not row.stop_reason.startswith("budget"))
            report.stages.append(row)
            finish_report(report, run.tracker)
            if folder is not None:
                folder.save_report(report.to_dict())
            bar.update(1)
    finally:
        bar.close()
    return best


def _result(run: CompileRun, best: Any) -> Any:
    """The compiled program: a copy of the best one, carrying the report (saved in the run folder)."""
    report = run.report
    finish_report(report, run.tracker)
    result = clone_program(best)
    result.report = report
    meta = getattr(result, "meta", None)
    if isinstance(meta, dict):
        meta["report"] = report.to_dict()
    if run.folder is not None:
        run.folder.save_report(report.to_dict())
        run.folder.save_program(result)
    logger.info("compile finished:\n%s", report.table())
    return result


def _digest(parts: Any) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p.encode("utf-8"))
    return h.hexdigest()


def _resumable_settings(stage: Stage) -> dict[str, Any]:
    """The settings a resumed run must repeat: all but those that only trade time for memory."""
    return {k: v for k, v in stage.settings().items() if k not in stage.memory_settings}
