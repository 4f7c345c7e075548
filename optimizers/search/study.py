"""The search's optuna study: storage, per-candidate samplers, waves of candidates, interrupted trials.

Only optuna's public API is used. A trial cut short (by a budget stop, or by a kill of the process
that ran it) is a FAIL trial carrying a ``candidate`` number; the next run asks that candidate again
with the parameters it had, so a resumed search repeats an uninterrupted one exactly.

Example:
    >>> from flowopt.optimizers.search.study import candidate_sampler
    >>> type(candidate_sampler("random", seed=0, number=3, n_candidates=8)).__name__
    'RandomSampler'
"""

from __future__ import annotations

import hashlib
import re
import statistics
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowopt.compiler.integrity import check_sqlite
from flowopt.errors import ConfigError

if TYPE_CHECKING:
    import dspy

    from flowopt.compiler import StageContext

STUDY_NAME = "flowopt-search"
INTERRUPTED = "interrupted"
WHY_PRUNED = "why_pruned"  # user attr: the pruner's reason, in words
SCORES = "scores"  # user attr: the trial's per-example scores, in the search's valset order
FAILED = "failed"  # user attr: positions (in SCORES) of the examples that raised in the program


def open_study(storage: str | None, study_name: str, pruner: Any, run_dir: Path | None, resume: bool) -> Any:
    """The optuna study of a search run by one process (a shared one: :mod:`.shared`).

    ``storage``: ``None``/``"sqlite"`` (``run_dir/search.db``; in memory without a run_dir) or
    ``"journal"`` (``run_dir/search.journal``).
    """
    import optuna

    store: Any = storage
    if storage in (None, "sqlite", "journal") and run_dir is None:
        if storage is not None:
            raise ConfigError(f'RandomSearch storage="{storage}" needs a run_dir',
                              fix="pass run_dir= to compile, or leave storage unset")
    elif storage == "journal":
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        path = str(Path(run_dir or ".") / "search.journal")
        # A process killed while it holds the lock leaves the lock file: break it after 3 s, not 30.
        lock = JournalFileOpenLock(path, grace_period=3)
        store = optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=lock))
    else:
        check_sqlite(Path(run_dir or ".") / "search.db")  # a damaged file is refused by name, not as a raw error
        store = f"sqlite:///{Path(run_dir or '.') / 'search.db'}"
    study = optuna.create_study(storage=store, study_name=study_name, direction="maximize",
                                pruner=pruner, load_if_exists=True)
    if run_dir is not None and not resume and study.get_trials(deepcopy=False):
        # A leftover study from an earlier, not resumed, run in the same folder: start afresh.
        optuna.delete_study(study_name=study_name, storage=store)
        study = optuna.create_study(storage=store, study_name=study_name, direction="maximize", pruner=pruner)
    # Trials left RUNNING belong to a process that was killed (we are the only worker).
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    return study


def candidate_sampler(kind: str, seed: int, number: int, n_candidates: int) -> Any:
    """A fresh sampler seeded by the candidate number: what candidate k is depends on (seed, k) and
    the finished trials only, so a resumed search repeats an uninterrupted one exactly."""
    import optuna

    s = int(hashlib.sha1(f"flowopt-search:{seed}:{number}".encode()).hexdigest()[:8], 16)
    if kind == "tpe":
        return optuna.samplers.TPESampler(seed=s, n_startup_trials=min(5, max(1, n_candidates // 3)))
    return optuna.samplers.RandomSampler(seed=s)


def ask(study: Any) -> Any:
    """``study.ask()``, quiet about heartbeats (we ask/tell; heartbeats still run)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        return study.ask()


def stop_running(study: Any, trials: list[Any], reason: str) -> None:
    """Fail the ``trials`` still RUNNING, marked ``interrupted=reason``, so a later run asks them again."""
    from optuna.trial import TrialState

    running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    for trial in trials:
        if trial.number in running:
            trial.set_user_attr(INTERRUPTED, reason)
            study.tell(trial, state=TrialState.FAIL)


def finished_count(study: Any) -> int:
    """Trials scored to the end or pruned."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED))


def next_wave(study: Any, n: int, width: int, *, start: int = 0) -> list[tuple[int, Any]]:
    """The candidates of the first wave (numbers ``[start + k*width, start + (k+1)*width)`` below ``n``)
    with unfinished members,
    each with the latest trial a kill or budget stop cut short (or ``None``)."""
    from optuna.trial import TrialState

    finished, cut = set(), {}
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        number = t.user_attrs.get("candidate")
        if number is None:
            continue
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            finished.add(number)
        elif t.state == TrialState.FAIL:
            cut[number] = t
    for first in range(start, n, max(1, width)):
        members = [k for k in range(first, min(n, first + width))
                   if k not in finished]
        if members:
            return [(k, cut.get(k)) for k in members]
    return []


def record_scores(trial: Any, program: dspy.Module, examples: list[Any], scores: list[float],
                  ctx: StageContext) -> None:
    """Store a trial's per-example scores (on the first ``len(scores)`` of ``examples``) and which of
    those examples failed in the program, so another worker can take them as its own."""
    trial.set_user_attr(SCORES, scores)
    assert ctx.evaluator is not None
    outcomes = ctx.evaluator.recall(program, examples[: len(scores)])
    failed = [i for i, outcome in enumerate(outcomes) if outcome is not None and outcome[1]]
    if failed:
        trial.set_user_attr(FAILED, failed)


def stored_outcomes(trial: Any) -> list[tuple[float, bool]]:
    """``(score, failed)`` per example of a trial that :func:`record_scores` stored."""
    failed = set(trial.user_attrs.get(FAILED, ()))
    return [(float(s), i in failed) for i, s in enumerate(trial.user_attrs[SCORES])]


def earlier_scores(trials: list[Any], exclude: set[int]) -> dict[int, list[float]]:
    """Per-example scores of finished (complete or pruned) trials of earlier waves."""
    return {t.number: list(t.user_attrs[SCORES]) for t in trials if SCORES in t.user_attrs and t.number not in exclude}


def candidate_number(trial: Any) -> int:
    """The candidate number the report names a trial by (its optuna number unless it says otherwise)."""
    return int(trial.user_attrs.get("candidate", trial.number))


def candidate_summary(trial: Any) -> dict[str, Any]:
    """One candidate's line in the report: what it was, how far it was scored, and why it stopped."""
    values = trial.user_attrs.get(SCORES, [])
    row = {"candidate": candidate_number(trial), "kind": trial.user_attrs.get("kind"), "scored": len(values),
           "mean": round(statistics.fmean(values), 4) if values else 0.0}
    if WHY_PRUNED in trial.user_attrs:
        row["pruned"] = trial.user_attrs[WHY_PRUNED]
    return row


def candidate_words(study: Any, reason: str) -> str:
    """The pruner names trials by their optuna number; the report names candidates."""
    numbers = {t.number: candidate_number(t) for t in study.get_trials(deepcopy=False)}
    return re.sub(r"candidate (\d+)", lambda m: f"candidate {numbers.get(int(m.group(1)), m.group(1))}", reason)
