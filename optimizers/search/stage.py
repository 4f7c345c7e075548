"""``RandomSearch``: optuna search over demo sets, instructions and node settings.

Candidates, in this order (candidate numbers 0, 1, ...):

* the incumbent (the program the stage starts from);
* DSPy's ``BootstrapFewShotWithRandomSearch`` set (``seeded`` of them): zero-shot, labeled demos only,
  then per-candidate bootstraps of a shuffled trainset, each with its own teacher and a random number
  of traces topped up with labeled demos (see :func:`~flowopt.optimizers.demos.shuffled_bootstrap`;
  with seed 0 these are DSPy's very candidates);
* candidates sampled by optuna (random, or TPE): per predictor a demo subset drawn from the union of
  every demo above and a bootstrapped pool, an instruction (the original, given ones, or ones written
  by a proposer LM), and per node the temperature and the ``ScEnsemble`` sample count.

Candidates are raced in waves (``parallel`` at a time; all at once for the random sampler): the
examples of every live candidate share one pool of ``num_threads`` threads, on a doubling schedule of
minibatches of the valset; after each minibatch optuna prunes a candidate whose mean trails the
median of all candidates scored that far. Scores are memoised, so the incumbent, the zero-shot
program and the compiler's final check cost nothing again. Bootstraps run concurrently on the same
thread limit.

Storage and resume: with a ``run_dir`` the study is an sqlite file, ``search.db`` in the stage's folder
(``run_dir/stages/NN-search/``), used by one process at a time; a killed
search resumes from it and repeats an uninterrupted run exactly (candidates are numbered, sampled
from a sampler seeded by (seed, number), and a wave cut short is rerun with the parameters it had).
``storage="journal"`` uses optuna's journal file instead (cheaper to open: no schema set-up and no
transaction per write). Any other optuna RDB URL (``postgresql+psycopg://...``) is a study shared by
several processes or machines: see :mod:`~flowopt.optimizers.search.shared`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import dspy

from flowopt.compiler import Stage, StageContext
from flowopt.errors import BudgetExhausted, ConfigError
from flowopt.optimizers.search.pruning import rung_pruner, rungs
from flowopt.optimizers.search.shared import run_shared
from flowopt.optimizers.search.shared_storage import exclusive_run_dir, is_shared
from flowopt.optimizers.search.space import SearchSpace
from flowopt.optimizers.search.study import (
    INTERRUPTED,
    STUDY_NAME,
    ask,
    candidate_sampler,
    finished_count,
    next_wave,
    open_study,
    stop_running,
)

SAMPLERS = ("random", "tpe")
PRUNERS = ("halving", "median", "none")


@dataclass(frozen=True)
class RandomSearch(Stage):
    """Search demo sets, instructions and node settings with optuna (random sampler by default).

    Settings:
        n_candidates: candidates to try, counting the incumbent (tried first), the seeded ones and
            pruned ones.
        seeded: how many DSPy-style shuffled bootstraps to try (after the incumbent, zero-shot and
            labeled-only candidates); ``None``: half of the candidates left after those three.
        max_demos: bootstrapped demos per seeded candidate (1..max_demos, drawn per candidate) and
            demo slots of a sampled candidate.
        search_k: for sampled candidates, also search how many demos to show (0..max_demos).
        pool_size: successful bootstraps to collect for the pool of sampled candidates (only
            bootstrapped when some candidates are sampled).
        max_labeled_demos: labeled demos in each teacher, and the demo count seeded candidates are
            topped up to with labeled examples (DSPy's ``max_labeled_demos``).
        sampler: ``"random"`` or ``"tpe"``.
        pruner: ``"halving"`` (successive halving: after each minibatch keep the best
            ``1/reduction_factor`` of all candidates scored that far), ``"median"`` (prune below
            their median) or ``"none"``.
        reduction_factor: successive halving's eta (3, as in Hyperband; optuna's default is 4).
        minibatch_size: valset examples in the first minibatch; later ones double (default:
            ``num_threads``, at least an eighth of the valset).
        parallel: candidates raced at once (default: all for ``"random"``, 4 for ``"tpe"``, so TPE
            learns between waves).
        instructions: extra candidate instructions per predictor name (``"*"``: every predictor).
        proposer_lm: an LM that writes ``n_proposals`` more instructions per predictor.
        temperatures: temperatures to try per node (the current one is always a candidate).
        ensemble_n: sample counts to try for ``ScEnsemble`` nodes of a Workflow.
        storage: ``None`` (sqlite file ``run_dir/search.db``; in memory without a run_dir),
            ``"journal"`` (optuna journal file in run_dir) or an optuna RDB URL shared by workers.
        study_name: the study's name in ``storage``.
        study_max_lm_calls: a shared study's LM-call budget, counted over all workers (each worker's
            own ``Budget`` still applies to it).
        heartbeat_s, stale_after_s: a shared study's worker records a heartbeat for its trials every
            ``heartbeat_s``; a trial without one for ``stale_after_s`` is failed and its candidate requeued.
        wait_timeout_s: how long a worker of a shared study waits without progress (for the plan, or
            for other workers' trials) before it stops with an error.

    Example:
        >>> from flowopt.optimizers.search import RandomSearch
        >>> RandomSearch(n_candidates=8, sampler="tpe").settings()["sampler"]
        'tpe'
        >>> RandomSearch(n_candidates=11, seeded=8).seeded_count()  # BFRS with 8 candidate programs
        8
    """

    name: ClassVar[str] = "search"
    n_candidates: int = 16
    seeded: int | None = None
    max_demos: int = 4
    search_k: bool = False
    pool_size: int = 16
    max_labeled_demos: int = 16
    metric_threshold: float | None = None
    sampler: str = "random"
    pruner: str = "halving"
    reduction_factor: int = 3
    minibatch_size: int | None = None
    parallel: int | None = None
    instructions: Mapping[str, Sequence[str]] | None = None
    proposer_lm: Any = None
    n_proposals: int = 3
    temperatures: Sequence[float] = ()
    ensemble_n: Sequence[int] = ()
    storage: str | None = None
    study_name: str = STUDY_NAME
    study_max_lm_calls: int | None = None
    heartbeat_s: int = 10
    stale_after_s: int = 60
    wait_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        for name, minimum in (("n_candidates", 1), ("max_demos", 0), ("pool_size", 0), ("max_labeled_demos", 0),
                              ("n_proposals", 0)):
            _check_int(name, getattr(self, name), minimum)
        _check_int("reduction_factor", self.reduction_factor, 2)
        _check_int("heartbeat_s", self.heartbeat_s, 1)
        _check_int("stale_after_s", self.stale_after_s, 2 * self.heartbeat_s)
        if isinstance(self.wait_timeout_s, bool) or not isinstance(self.wait_timeout_s, int | float) \
                or self.wait_timeout_s <= 0:
            raise ConfigError(f"RandomSearch wait_timeout_s must be seconds > 0, got {self.wait_timeout_s!r}",
                              fix="pass wait_timeout_s=900")
        for name in ("seeded", "minibatch_size", "parallel", "study_max_lm_calls"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0 if name == "seeded" else 1, none_ok=True)
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"RandomSearch sampler must be one of {SAMPLERS}, got {self.sampler!r}",
                              fix='pass sampler="random" or sampler="tpe"')
        if self.pruner not in PRUNERS:
            raise ConfigError(f"RandomSearch pruner must be one of {PRUNERS}, got {self.pruner!r}",
                              fix='pass pruner="halving", "median" or "none"')
        for t in self.temperatures:
            if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= 2:
                raise ConfigError(f"RandomSearch temperatures must be numbers in [0, 2], got {t!r}",
                                  fix="pass temperatures=(0.0, 0.7)")
        for n in self.ensemble_n:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"RandomSearch ensemble_n must be ints >= 1, got {n!r}", fix="pass ensemble_n=(3, 5)")
        if self.instructions is not None and not isinstance(self.instructions, Mapping):
            raise ConfigError("RandomSearch instructions must map predictor names to lists of strings",
                              fix='pass instructions={"*": ["Answer briefly."]}')
        if self.storage is not None and (not isinstance(self.storage, str)
                                         or not (self.storage in ("sqlite", "journal") or "://" in self.storage)):
            raise ConfigError(f"RandomSearch storage must be None, 'journal' or an optuna RDB URL, "
                              f"got {self.storage!r}",
                              fix='leave storage unset (sqlite in run_dir), or pass "postgresql://user@host/db"')

    def seeded_count(self) -> int:
        """How many shuffled-bootstrap candidates this search tries."""
        left = max(0, self.n_candidates - 3)
        return min(left, self.seeded if self.seeded is not None else (left + 1) // 2)

    # ------------------------------------------------------------------ run
    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        if is_shared(self.storage):
            return run_shared(self, program, ctx)
        with exclusive_run_dir(ctx.run_dir):
            return self._run_alone(program, ctx)

    def _run_alone(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with ThreadPoolExecutor(max_workers=max(1, ctx.num_threads), thread_name_prefix="flowopt-search") as lm_pool:
            space = SearchSpace.build(self, program, ctx, lm_pool)
        study, shared = open_study(self.storage, self.study_name, self._pruner(), ctx.run_dir, ctx.resume)
        order = list(ctx.valset)
        ctx.rng.shuffle(order)  # one fixed order: minibatch scores of candidates are comparable
        first = self.minibatch_size or max(ctx.num_threads, math.ceil(len(order) / 8))
        ends = rungs(len(order), first if self.pruner != "none" else len(order))
        width = self.parallel or (self.n_candidates if self.sampler == "random" else 4)
        stop_reason = "done"
        bar = ctx.progress(total=self.n_candidates, desc=f"{ctx.stage_name}: candidates",
                           initial=min(self.n_candidates, finished_count(study)))
        try:
            while wave := next_wave(study, self.n_candidates, width, skip_running=shared):
                ctx.budget.check()
                asked = [self._ask(study, space, program, ctx, number, previous) for number, previous in wave]
                self._race(study, asked, order, ends, ctx)
                bar.update(len(asked))
        except BudgetExhausted as err:
            stop_reason = f"budget: {err.limit}"
        finally:
            bar.close()
        if space.pool_exhausted_by:
            stop_reason = f"budget: {space.pool_exhausted_by}"
        return self._best(study, space, program, ctx, stop_reason)

    def _ask(self, study: Any, space: SearchSpace, program: dspy.Module, ctx: StageContext, number: int,
             previous: Any) -> tuple[Any, dspy.Module]:
        if previous is not None:  # rerun a candidate cut short by a kill with the parameters it had
            attrs = {k: v for k, v in previous.user_attrs.items() if k != INTERRUPTED}
            study.enqueue_trial(dict(previous.params), user_attrs=attrs)
        elif number < len(space.seeded):
            kind, demos = space.seeded[number]
            study.enqueue_trial(space.fixed_params(), user_attrs={"candidate": number, "kind": kind, "demos": demos})
        else:
            study.sampler = candidate_sampler(self.sampler, ctx.seed, number, self.n_candidates)
        trial = ask(study)
        if "candidate" not in trial.user_attrs:
            trial.set_user_attr("candidate", number)
            trial.set_user_attr("kind", "sampled")
        return trial, space.apply(program, trial)

    def _race(self, study: Any, asked: list[tuple[Any, dspy.Module]], order: list[Any], rungs: list[int],
              ctx: StageContext) -> None:
        """Score a wave of candidates together, minibatch by minibatch, pruning the trailing ones."""
        from optuna.trial import TrialState

        alive = list(asked)
        scores: dict[int, list[float]] = {t.number: [] for t, _ in alive}
        prev = 0
        try:
            for cum in rungs:
                ctx.budget.check()
                results = ctx.evaluate_many([(c, order[prev:cum]) for _, c in alive],
                                            desc=f"{len(alive)} candidates, {cum}/{len(order)}")
                for (trial, _), result in zip(alive, results):
                    scores[trial.number].extend(result.scores)
                    if cum < len(order):
                        trial.report(_mean(scores[trial.number]), step=cum)
                prev = cum
                if cum < len(order):
                    # All candidates report before any is judged, so the verdicts don't depend on order.
                    verdicts = [t.user_attrs.get("kind") != "incumbent" and t.should_prune() for t, _ in alive]
                    for (trial, _), prune in zip(alive, verdicts):
                        if prune:
                            study.tell(trial, state=TrialState.PRUNED)
                    alive = [a for a, prune in zip(alive, verdicts) if not prune]
            for trial, _ in alive:
                study.tell(trial, _mean(scores[trial.number]))
        except BudgetExhausted:
            stop_running(study, [trial for trial, _ in alive], "budget")
            raise

    def _best(self, study: Any, space: SearchSpace, program: dspy.Module, ctx: StageContext,
              stop_reason: str) -> dspy.Module:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        pruned = sum(1 for t in trials if t.state == TrialState.PRUNED)
        ctx.record(candidates_tried=len(complete) + pruned, pruned=pruned, stop_reason=stop_reason,
                   seeded=sum(1 for t in complete + [t for t in trials if t.state == TrialState.PRUNED]
                              if t.user_attrs.get("kind") not in (None, "sampled", "incumbent")),
                   pool_demos={n: len(p) for n, p in space.pools.items()},
                   instruction_candidates={n: len(c) for n, c in space.instructions.items()})
        if not complete:
            return program
        best = max(complete, key=lambda t: (t.value, -t.user_attrs.get("candidate", t.number)))
        ctx.record(best_candidate=best.user_attrs.get("candidate", best.number), best_kind=best.user_attrs.get("kind"),
                   best_value=round(best.value, 6))
        return space.apply(program, best)

    def _pruner(self) -> Any:
        import optuna

        if self.pruner == "none":
            return optuna.pruners.NopPruner()
        return rung_pruner(self.pruner, self.reduction_factor)


def _check_int(name: str, value: Any, minimum: int, none_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"RandomSearch {name} must be an int >= {minimum}{' or None' if none_ok else ''}, "
                          f"got {value!r}", fix=f"pass {name}={max(minimum, 4)}")


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))
