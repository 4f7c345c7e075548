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

Storage and resume: with a ``run_dir`` the study is an sqlite file, ``run_dir/search.db``; a killed
search resumes from it and repeats an uninterrupted run exactly (candidates are numbered, sampled
from a sampler seeded by (seed, number), and a wave cut short is rerun with the parameters it had).
``storage="journal"`` uses optuna's journal file instead (cheaper to open: no schema set-up and no
transaction per write). Any other optuna RDB URL (``postgresql://...``; ``sqlite:///...`` works the
same) is a shared study: several processes or machines work on it at once, each taking candidates
nobody is running (trials of a dead worker are failed by optuna's heartbeat).
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import math
import statistics
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import dspy

from flowopt.compiler import Stage, StageContext, clone_program
from flowopt.compiler.integrity import check_sqlite
from flowopt.errors import BudgetExhausted, ConfigError
from flowopt.optimizers.demos import bootstrap_pool, labeled_demos, shuffled_bootstrap
from flowopt.settings import at_least, between, check_stage, one_of

logger = logging.getLogger(__name__)

SAMPLERS = ("random", "tpe")
PRUNERS = ("halving", "median", "none")
STUDY_NAME = "flowopt-search"
INTERRUPTED = "interrupted"


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

    def __post_init__(self) -> None:
        check_stage(self, {
            "n_candidates": at_least(1), "max_demos": at_least(0), "pool_size": at_least(0),
            "max_labeled_demos": at_least(0), "n_proposals": at_least(0), "reduction_factor": at_least(2),
            "seeded": at_least(0), "minibatch_size": at_least(1), "parallel": at_least(1),
            "sampler": one_of(*SAMPLERS), "pruner": one_of(*PRUNERS), "temperatures": between(0.0, 2.0),
            "ensemble_n": at_least(1),
        })
        if self.storage is not None and not (self.storage in ("sqlite", "journal") or "://" in self.storage):
            raise ConfigError(f"RandomSearch storage must be None, 'journal' or an optuna RDB URL, "
                              f"got {self.storage!r}",
                              fix='leave storage unset (sqlite in run_dir), or pass "postgresql://user@host/db"')

    def seeded_count(self) -> int:
        """How many shuffled-bootstrap candidates this search tries."""
        left = max(0, self.n_candidates - 3)
        return min(left, self.seeded if self.seeded is not None else (left + 1) // 2)

    # ------------------------------------------------------------------ run
    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with ThreadPoolExecutor(max_workers=max(1, ctx.num_threads), thread_name_prefix="flowopt-search") as lm_pool:
            space = _Space.build(self, program, ctx, lm_pool)
        study, shared = self._study(ctx)
        order = list(ctx.valset)
        ctx.rng.shuffle(order)  # one fixed order: minibatch scores of candidates are comparable
        first = self.minibatch_size or max(ctx.num_threads, math.ceil(len(order) / 8))
        rungs = _rungs(len(order), first if self.pruner != "none" else len(order))
        width = self.parallel or (self.n_candidates if self.sampler == "random" else 4)
        stop_reason = "done"
        bar = ctx.progress(total=self.n_candidates, desc=f"{ctx.stage_name}: candidates",
                           initial=min(self.n_candidates, _finished(study)))
        try:
            while wave := _next_wave(study, self.n_candidates, width, skip_running=shared):
                ctx.budget.check()
                asked = [self._ask(study, space, program, ctx, number, previous) for number, previous in wave]
                self._race(study, asked, order, rungs, ctx)
                bar.update(len(asked))
        except BudgetExhausted as err:
            stop_reason = f"budget: {err.limit}"
        finally:
            bar.close()
        if space.pool_exhausted_by:
            stop_reason = f"budget: {space.pool_exhausted_by}"
        return self._best(study, space, program, ctx, stop_reason)

    def _ask(self, study: Any, space: _Space, program: dspy.Module, ctx: StageContext, number: int,
             previous: Any) -> tuple[Any, dspy.Module]:
        if previous is not None:  # rerun a candidate cut short by a kill with the parameters it had
            attrs = {k: v for k, v in previous.user_attrs.items() if k != INTERRUPTED}
            study.enqueue_trial(dict(previous.params), user_attrs=attrs)
        elif number < len(space.seeded):
            kind, demos = space.seeded[number]
            study.enqueue_trial(space.fixed_params(), user_attrs={"candidate": number, "kind": kind, "demos": demos})
        else:
            study.sampler = self._sampler(ctx.seed, number)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Heartbeat of storage")  # we ask/tell, heartbeats still run
            trial = study.ask()
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
            for trial, _ in alive:
                if study._storage.get_trial(trial._trial_id).state == TrialState.RUNNING:
                    trial.set_user_attr(INTERRUPTED, "budget")
                    study.tell(trial, state=TrialState.FAIL)
            raise

    def _best(self, study: Any, space: _Space, program: dspy.Module, ctx: StageContext,
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

    # ------------------------------------------------------------------ optuna plumbing
    def _sampler(self, seed: int, number: int) -> Any:
        import optuna

        # A fresh sampler seeded by the candidate number: what candidate k is depends on (seed, k)
        # and the finished trials only, so a resumed search repeats an uninterrupted one exactly.
        s = int(hashlib.sha1(f"flowopt-search:{seed}:{number}".encode()).hexdigest()[:8], 16)
        if self.sampler == "tpe":
            return optuna.samplers.TPESampler(seed=s, n_startup_trials=min(5, max(1, self.n_candidates // 3)))
        return optuna.samplers.RandomSampler(seed=s)

    def _pruner(self) -> Any:
        import optuna

        if self.pruner == "none":
            return optuna.pruners.NopPruner()
        return _rung_pruner(self.pruner, self.reduction_factor)

    def _study(self, ctx: StageContext) -> tuple[Any, bool]:
        """The optuna study and whether it is shared with other workers."""
        import optuna

        storage: Any = self.storage
        shared = isinstance(storage, str) and "://" in storage
        run_dir = ctx.run_dir
        if storage in (None, "sqlite", "journal") and run_dir is None:
            if storage is not None:
                raise ConfigError(f'RandomSearch storage="{storage}" needs a run_dir',
                                  fix="pass run_dir= to compile, or leave storage unset")
        elif storage == "journal" and run_dir is not None:
            from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

            path = str(run_dir / "search.journal")
            # A process killed while it holds the lock leaves the lock file: break it after 3 s, not 30.
            lock = JournalFileOpenLock(path, grace_period=3)
            storage = optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=lock))
        elif storage in (None, "sqlite") and run_dir is not None:
            check_sqlite(run_dir / "search.db")  # a damaged file is refused by name, not as a raw error
            storage = f"sqlite:///{run_dir / 'search.db'}"
        else:
            # Heartbeats let a shared study notice a worker that died and fail its trial.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(storage, heartbeat_interval=60, grace_period=180)
        study = optuna.create_study(storage=storage, study_name=self.study_name, direction="maximize",
                                    pruner=self._pruner(), load_if_exists=True)
        if not shared and ctx.run_dir is not None and not ctx.resume and study.get_trials(deepcopy=False):
            # A leftover study from an earlier, not resumed, run in the same folder: start afresh.
            optuna.delete_study(study_name=self.study_name, storage=storage)
            study = optuna.create_study(storage=storage, study_name=self.study_name, direction="maximize",
                                        pruner=self._pruner())
        if shared:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "experimental", "heartbeat meant for Study.optimize"
                optuna.storages.fail_stale_trials(study)
        else:
            # Trials left RUNNING belong to a process that was killed (we are the only worker).
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                study._storage.set_trial_user_attr(t._trial_id, INTERRUPTED, "killed")
                study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        return study, shared


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def _rungs(n: int, first: int) -> list[int]:
    """Cumulative minibatch ends: first, 2*first, 4*first, ..., n."""
    out, size = [], max(1, first)
    while size < n:
        out.append(size)
        size *= 2
    return [*out, n] if n else [0]


def _rung_pruner(rule: str, reduction_factor: int = 3) -> Any:
    import optuna

    class RungPruner(optuna.pruners.BasePruner):
        """Judge a trial against every trial scored on the same examples so far (running, pruned or
        complete; trials cut short by a kill are left out), once at least 3 have been.

        ``"halving"`` keeps the best ``1/reduction_factor`` (ties go to the lower candidate number, so the verdict
        does not depend on timing); ``"median"`` prunes a trial strictly below the median.
        """

        def prune(self, study: Any, trial: Any) -> bool:
            step = trial.last_step
            if step is None:
                return False
            rivals = [t for t in study.get_trials(deepcopy=False)
                      if step in t.intermediate_values and INTERRUPTED not in t.user_attrs
                      and t.state != optuna.trial.TrialState.WAITING]
            if len(rivals) < 3:
                return False
            value = trial.intermediate_values[step]
            if rule == "median":
                return value < statistics.median(t.intermediate_values[step] for t in rivals)
            ranked = sorted(rivals, key=lambda t: (-t.intermediate_values[step],
                                                   t.user_attrs.get("candidate", t.number)))
            keep = {t.number for t in ranked[: math.ceil(len(ranked) / reduction_factor)]}
            return trial.number not in keep

    return RungPruner()


def _finished(study: Any) -> int:
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED))


def _next_wave(study: Any, n: int, width: int, *, skip_running: bool) -> list[tuple[int, Any]]:
    """The candidates of the first wave (numbers ``[k*width, (k+1)*width)``) with unfinished members,
    each with the trial a kill or budget stop cut short (or ``None``). A shared study skips
    candidates that another worker is running."""
    from optuna.trial import TrialState

    finished, cut, running = set(), {}, set()
    for t in study.get_trials(deepcopy=False):
        number = t.user_attrs.get("candidate")
        if number is None:
            continue
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            finished.add(number)
        elif INTERRUPTED in t.user_attrs and t.user_attrs[INTERRUPTED] == "killed":
            cut[number] = t
        elif t.state == TrialState.RUNNING:
            running.add(number)
        elif t.state == TrialState.FAIL and INTERRUPTED in t.user_attrs:
            cut.setdefault(number, t)
    for start in range(0, n, max(1, width)):
        members = [k for k in range(start, min(n, start + width))
                   if k not in finished and not (skip_running and k in running)]
        if members:
            return [(k, cut.get(k)) for k in members]
    return []


# ---------------------------------------------------------------------------------------- space
class _Space:
    """The candidates of one search: seeded demo sets, the pool sampled ones draw from, and how to
    apply a trial (live or finished) to a copy of the program."""

    def __init__(self) -> None:
        self.predictors: list[str] = []
        self.pools: dict[str, list[dict[str, Any]]] = {}
        self.seeded: list[tuple[str, list[list[int]]]] = []  # (kind, demo indices per predictor)
        self.instructions: dict[str, list[str]] = {}
        self.max_demos = 0
        self.search_k = False
        self.temps: dict[str, list[float | None]] = {}
        self.ensemble: dict[str, list[int]] = {}
        self.pool_exhausted_by: str | None = None

    @classmethod
    def build(cls, stage: RandomSearch, program: dspy.Module, ctx: StageContext, lm_pool: Executor) -> _Space:
        space = cls()
        space.max_demos = stage.max_demos
        space.search_k = stage.search_k
        named = program.named_predictors()
        space.predictors = [n for n, _ in named]
        current = {n: [d.toDict() if hasattr(d, "toDict") else dict(d) for d in p.demos] for n, p in named}
        sets: list[tuple[str, dict[str, list[dict[str, Any]]]]] = [("incumbent", current)]
        if stage.n_candidates > 1:
            sets.append(("zero-shot", {n: [] for n in space.predictors}))
        if stage.n_candidates > 2:
            sets.append(("labeled", labeled_demos(ctx.trainset, stage.max_labeled_demos, ctx.seed, space.predictors)))
        sets.extend(space._bootstraps(stage, program, ctx, lm_pool))
        pool = None
        if stage.pool_size and stage.n_candidates > len(sets) and stage.max_demos:
            pool = bootstrap_pool(program, ctx, successes=stage.pool_size, max_labeled_demos=stage.max_labeled_demos,
                                  metric_threshold=stage.metric_threshold, executor=lm_pool)
            space.pool_exhausted_by = space.pool_exhausted_by or pool.exhausted_by
        for name in space.predictors:
            entries: list[dict[str, Any]] = []
            for demo in [*(d for _, demos in sets for d in demos[name]), *(pool.demos_for(name) if pool else [])]:
                if demo not in entries:
                    entries.append(demo)
            space.pools[name] = entries
        space.seeded = [(kind, [[space.pools[n].index(d) for d in demos[n]] for n in space.predictors])
                        for kind, demos in sets]
        space.instructions = _instruction_candidates(stage, program, ctx, space)
        space._node_settings(stage, program)
        return space

    def _bootstraps(self, stage: RandomSearch, program: dspy.Module, ctx: StageContext,
                    lm_pool: Executor) -> list[tuple[str, dict[str, list[dict[str, Any]]]]]:
        """DSPy's shuffled-bootstrap candidates, all bootstrapped at once on the shared LM threads."""
        count = stage.seeded_count()
        if not count:
            return []

        def one(i: int) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
            return shuffled_bootstrap(program, ctx, i, max_bootstrapped=max(1, stage.max_demos),
                                      max_labeled=stage.max_labeled_demos, metric_threshold=stage.metric_threshold,
                                      executor=lm_pool)

        with ThreadPoolExecutor(max_workers=count, thread_name_prefix="flowopt-seeds") as seeds:
            futures = [seeds.submit(contextvars.copy_context().run, one, i) for i in range(count)]
            results = [f.result() for f in futures]
        for _, exhausted in results:
            self.pool_exhausted_by = self.pool_exhausted_by or exhausted
        return [(f"bootstrap-{i}", demos) for i, (demos, _) in enumerate(results)]

    def _node_settings(self, stage: RandomSearch, program: dspy.Module) -> None:
        nodes = getattr(program, "nodes", None)
        if isinstance(nodes, dict):  # a Workflow: settings belong to operators
            for node_id, op in nodes.items():
                if stage.temperatures and hasattr(op, "temperature"):
                    self.temps[f"node:{node_id}"] = _dedup([getattr(op, "temperature", None), *stage.temperatures])
                if stage.ensemble_n and getattr(op, "op_name", "") == "ScEnsemble":
                    self.ensemble[f"node:{node_id}"] = _dedup([op.n, *stage.ensemble_n])
        elif stage.temperatures:
            for name, predictor in program.named_predictors():
                self.temps[name] = _dedup([predictor.config.get("temperature"), *stage.temperatures])

    def fixed_params(self) -> dict[str, Any]:
        """The incumbent's instruction and node settings (seeded candidates change demos only)."""
        params: dict[str, Any] = {}
        for i, name in enumerate(self.predictors):
            if len(self.instructions[name]) > 1:
                params[f"p{i}.instr"] = 0
        for key in self.temps:
            params[f"{key}.temp"] = 0
        for key in self.ensemble:
            params[f"{key}.n"] = 0
        return params

    def apply(self, program: dspy.Module, trial: Any) -> dspy.Module:
        """A copy of ``program`` set up as the trial says (``trial`` may be a live or a frozen trial)."""
        get = _getter(trial)
        fixed = trial.user_attrs.get("demos")
        candidate = clone_program(program)
        named = dict(candidate.named_predictors())
        for i, name in enumerate(self.predictors):
            predictor = named[name]
            pool = self.pools[name]
            if fixed is not None:
                predictor.demos = [dspy.Example(**pool[idx]) for idx in fixed[i]]
            elif pool and self.max_demos:
                k = get("int", f"p{i}.k", 0, self.max_demos) if self.search_k else self.max_demos
                chosen: list[int] = []
                for j in range(self.max_demos):
                    idx = get("cat", f"p{i}.d{j}", list(range(len(pool))))
                    if j < k and idx not in chosen:
                        chosen.append(idx)
                predictor.demos = [dspy.Example(**pool[idx]) for idx in chosen]
            options = self.instructions[name]
            if len(options) > 1:
                text = options[get("cat", f"p{i}.instr", list(range(len(options))))]
                predictor.signature = predictor.signature.with_instructions(text)
        nodes = getattr(candidate, "nodes", None)
        for key, choices in self.temps.items():
            t = choices[get("cat", f"{key}.temp", list(range(len(choices))))]
            if key.startswith("node:") and isinstance(nodes, dict):
                op = nodes[key[5:]]
                op.temperature = t
                for _, p in op.named_predictors():
                    _set_temperature(p, t)
            elif key in named:
                _set_temperature(named[key], t)
        for key, sizes in self.ensemble.items():
            n = sizes[get("cat", f"{key}.n", list(range(len(sizes))))]
            if isinstance(nodes, dict):
                nodes[key[5:]].n = n
        return candidate


def _set_temperature(predictor: Any, t: float | None) -> None:
    if t is None:
        predictor.config.pop("temperature", None)
    else:
        predictor.config["temperature"] = t


def _getter(trial: Any) -> Any:
    """``get(kind, name, ...)``: suggest on a live trial, read the stored value on a frozen one."""
    if hasattr(trial, "suggest_int"):
        def get(kind: str, name: str, *args: Any) -> Any:
            if kind == "int":
                return trial.suggest_int(name, args[0], args[1])
            return trial.suggest_categorical(name, args[0])
    else:
        def get(kind: str, name: str, *args: Any) -> Any:
            return trial.params[name]
    return get


def _dedup(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


# ---------------------------------------------------------------------------------------- instructions
class ProposeInstruction(dspy.Signature):
    """Write a better instruction for a language model task. Keep the task the same; be specific about
    what a good output looks like, judging from the examples."""

    current_instruction: str = dspy.InputField()
    task_fields: str = dspy.InputField(desc="the task's input and output fields")
    examples: str = dspy.InputField(desc="a few worked examples")
    instruction: str = dspy.OutputField(desc="the new instruction, one paragraph")


def _instruction_candidates(stage: RandomSearch, program: dspy.Module, ctx: StageContext,
                            space: _Space) -> dict[str, list[str]]:
    saved = ctx.load_checkpoint("instructions")
    out: dict[str, list[str]] = {}
    proposals = dict(saved or {})
    for name, predictor in program.named_predictors():
        options = [predictor.signature.instructions]
        extra = list((stage.instructions or {}).get(name, [])) + list((stage.instructions or {}).get("*", []))
        if stage.proposer_lm is not None and stage.n_proposals and name not in proposals:
            proposals[name] = _propose(stage, predictor, space.pools.get(name, []), ctx)
            ctx.save_checkpoint("instructions", proposals)
        for text in [*extra, *proposals.get(name, [])]:
            if isinstance(text, str) and text.strip() and text not in options:
                options.append(text)
        out[name] = options
    return out


def _propose(stage: RandomSearch, predictor: Any, pool: list[dict[str, Any]], ctx: StageContext) -> list[str]:
    sig = predictor.signature
    fields = f"inputs: {', '.join(sig.input_fields)}; outputs: {', '.join(sig.output_fields)}"
    shown = "\n\n".join("\n".join(f"{k}: {v}" for k, v in d.items() if k != "augmented") for d in pool[:3])
    propose = dspy.Predict(ProposeInstruction)
    out: list[str] = []
    with dspy.context(lm=stage.proposer_lm):
        for i in range(stage.n_proposals):
            try:
                with ctx.budget.guard():
                    pred = propose(current_instruction=sig.instructions, task_fields=fields, examples=shown or "(none)",
                                   config={"rollout_id": i, "temperature": 1.0})
            except BudgetExhausted:
                break
            except Exception as err:  # a proposer that fails leaves the other candidates
                ctx.logger.warning("instruction proposal %d failed: %s", i, err)
                continue
            text = str(getattr(pred, "instruction", "") or "").strip()
            if text:
                out.append(text)
    return out
