"""``RandomSearch``: optuna search over demo subsets, instructions and node settings.

Per predictor it searches which demos to show (a subset of the bootstrapped pool, see
:mod:`flowopt.optimizers.demos`) and which instruction to use (the original, given candidates, or
ones written by an optional proposer LM); per node the temperature and, for ``ScEnsemble``, the
number of samples. Candidates are scored on minibatches of the valset and pruned early by optuna
when they trail; survivors are scored on the whole valset.

Resume: the study lives in ``run_dir/search.db`` (sqlite), so a killed search continues where it
stopped. Each candidate's parameters are drawn from a sampler seeded by (seed, candidate number), so a
resumed search proposes exactly what an uninterrupted one would have. ``storage="postgresql://..."``
(any optuna RDB URL) lets several processes or machines work on one study.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import dspy

from flowopt.compiler import Stage, StageContext, clone_program
from flowopt.errors import BudgetExhausted, ConfigError
from flowopt.optimizers.demos import bootstrap_pool

logger = logging.getLogger(__name__)

SAMPLERS = ("random", "tpe")
PRUNERS = ("median", "none")
STUDY_NAME = "flowopt-search"
INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class RandomSearch(Stage):
    """Search demo subsets, instructions and node settings with optuna (random sampler by default).

    Settings:
        n_candidates: candidates to try, counting the incumbent (tried first) and pruned ones.
        max_demos: demos per predictor; each candidate fills max_demos slots from the pool.
        search_k: also search how many demos to show (0..max_demos) instead of always max_demos.
        pool_size: bootstrapped training runs to collect as the demo pool.
        max_labeled_demos: labeled demos in the teacher that bootstraps the pool.
        sampler: ``"random"`` or ``"tpe"``.
        pruner: ``"median"`` (optuna's MedianPruner on minibatch scores) or ``"none"``.
        minibatch_size: valset examples per pruning step (default: a quarter of the valset, at
            least ``num_threads``).
        instructions: extra candidate instructions per predictor name (``"*"``: every predictor).
        proposer_lm: an LM that writes ``n_proposals`` more instructions per predictor.
        temperatures: temperatures to try per node (the current one is always a candidate).
        ensemble_n: sample counts to try for ``ScEnsemble`` nodes of a Workflow.
        storage: an optuna storage URL; default ``sqlite:///<run_dir>/search.db`` (in memory
            without a run_dir). With ``postgresql://...`` several processes share the study.
        study_name: the study's name in ``storage``.

    Example:
        >>> from flowopt.optimizers.search import RandomSearch
        >>> RandomSearch(n_candidates=8, sampler="tpe").settings()["sampler"]
        'tpe'
    """

    name: ClassVar[str] = "search"
    n_candidates: int = 16
    max_demos: int = 4
    search_k: bool = False
    pool_size: int = 16
    max_labeled_demos: int = 16
    metric_threshold: float | None = None
    sampler: str = "random"
    pruner: str = "median"
    minibatch_size: int | None = None
    instructions: Mapping[str, Sequence[str]] | None = None
    proposer_lm: Any = None
    n_proposals: int = 3
    temperatures: Sequence[float] = ()
    ensemble_n: Sequence[int] = ()
    storage: str | None = None
    study_name: str = STUDY_NAME

    def __post_init__(self) -> None:
        for name, minimum in (("n_candidates", 1), ("max_demos", 0), ("pool_size", 0), ("max_labeled_demos", 0),
                              ("n_proposals", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"RandomSearch {name} must be an int >= {minimum}, got {value!r}",
                                  fix=f"pass {name}={max(minimum, 4)}")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"RandomSearch sampler must be one of {SAMPLERS}, got {self.sampler!r}",
                              fix='pass sampler="random" or sampler="tpe"')
        if self.pruner not in PRUNERS:
            raise ConfigError(f"RandomSearch pruner must be one of {PRUNERS}, got {self.pruner!r}",
                              fix='pass pruner="median" or pruner="none"')
        if self.minibatch_size is not None and (not isinstance(self.minibatch_size, int) or self.minibatch_size < 1):
            raise ConfigError(f"RandomSearch minibatch_size must be an int >= 1 or None, got {self.minibatch_size!r}",
                              fix="pass minibatch_size=16")
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

    # ------------------------------------------------------------------ run
    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        space = _Space.build(self, program, ctx)
        study = self._study(ctx, space)
        order = list(ctx.valset)
        ctx.rng.shuffle(order)  # one fixed order: minibatch scores of candidates are comparable
        batch = self.minibatch_size or max(ctx.num_threads, math.ceil(len(order) / 4))
        stop_reason = "done"
        bar = ctx.progress(total=self.n_candidates, desc=f"{ctx.stage_name}: candidates",
                           initial=min(self.n_candidates, _finished(study)))
        try:
            while _finished(study) < self.n_candidates:
                ctx.budget.check()
                number = _effective_number(study)
                study.sampler = self._sampler(ctx.seed, number)
                trial = study.ask()
                trial.set_user_attr("candidate", number)
                candidate = space.apply(program, trial)
                try:
                    state, value = self._score(candidate, trial, order, batch, ctx)
                except BudgetExhausted:
                    trial.set_user_attr(INTERRUPTED, "budget")
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    raise
                study.tell(trial, value, state=state)
                bar.update(1)
        except BudgetExhausted as err:
            stop_reason = f"budget: {err.limit}"
        finally:
            bar.close()
        if space.pool_exhausted_by:
            stop_reason = f"budget: {space.pool_exhausted_by}"
        return self._best(study, space, program, ctx, stop_reason)

    def _score(self, candidate: dspy.Module, trial: Any, order: list[Any], batch: int,
               ctx: StageContext) -> tuple[Any, float | None]:
        from optuna.trial import TrialState

        scores: list[float] = []
        for start in range(0, len(order), batch):
            ctx.budget.check()
            chunk = order[start:start + batch]
            result = ctx.evaluate(candidate, chunk, desc=f"candidate {trial.number}")
            scores.extend(result.scores)
            if start + batch < len(order):
                trial.report(sum(scores) / len(scores), step=len(scores))
                if trial.should_prune():
                    return TrialState.PRUNED, None
        return TrialState.COMPLETE, sum(scores) / max(1, len(scores))

    def _best(self, study: Any, space: _Space, program: dspy.Module, ctx: StageContext,
              stop_reason: str) -> dspy.Module:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        pruned = sum(1 for t in trials if t.state == TrialState.PRUNED)
        ctx.record(candidates_tried=len(complete) + pruned, pruned=pruned, stop_reason=stop_reason,
                   pool_demos={n: len(p) for n, p in space.pools.items()},
                   instruction_candidates={n: len(c) for n, c in space.instructions.items()})
        if not complete:
            return program
        best = max(complete, key=lambda t: (t.value, -t.user_attrs.get("candidate", t.number)))
        ctx.record(best_candidate=best.user_attrs.get("candidate", best.number), best_value=round(best.value, 6))
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
        return optuna.pruners.MedianPruner(n_startup_trials=max(2, min(5, self.n_candidates // 4)),
                                           n_warmup_steps=0)

    def _study(self, ctx: StageContext, space: _Space) -> Any:
        import optuna

        storage: Any = self.storage
        local = storage is None or storage == "sqlite"
        if ctx.run_dir is not None and storage is None:
            # optuna's journal file: resumable like sqlite, but no schema set-up and no commit per call.
            from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

            path = str(ctx.run_dir / "search.journal")
            storage = optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))
        elif storage == "sqlite":
            if ctx.run_dir is None:
                raise ConfigError('RandomSearch storage="sqlite" needs a run_dir',
                                  fix="pass run_dir= to compile, or leave storage unset")
            storage = f"sqlite:///{ctx.run_dir / 'search.db'}"
        elif isinstance(storage, str) and not storage.startswith("sqlite"):
            # Heartbeats let a shared study notice a worker that died and fail its trial.
            storage = optuna.storages.RDBStorage(storage, heartbeat_interval=60, grace_period=180)
        study = optuna.create_study(storage=storage, study_name=self.study_name, direction="maximize",
                                    pruner=self._pruner(), load_if_exists=True)
        if local and ctx.run_dir is not None and not ctx.resume and study.get_trials(deepcopy=False):
            # A leftover study from an earlier, not resumed, run in the same folder: start afresh.
            optuna.delete_study(study_name=self.study_name, storage=storage)
            study = optuna.create_study(storage=storage, study_name=self.study_name, direction="maximize",
                                        pruner=self._pruner())
        if local:
            # Trials left RUNNING belong to a process that was killed (we are the only worker).
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                study._storage.set_trial_user_attr(t._trial_id, INTERRUPTED, "killed")
                study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        else:
            optuna.storages.fail_stale_trials(study)
        if not study.get_trials(deepcopy=False):
            study.enqueue_trial(space.incumbent_params(), user_attrs={"incumbent": True})
        return study


def _finished(study: Any) -> int:
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED))


def _effective_number(study: Any) -> int:
    """The candidate number of the next trial: trials interrupted by a kill or the budget don't count."""
    trials = study.get_trials(deepcopy=False)
    return sum(1 for t in trials if INTERRUPTED not in t.user_attrs)


# ---------------------------------------------------------------------------------------- space
class _Space:
    """The search space of one program and how to apply a trial's parameters to a copy of it."""

    def __init__(self) -> None:
        self.predictors: list[str] = []
        self.pools: dict[str, list[dict[str, Any]]] = {}
        self.current_demos: dict[str, int] = {}
        self.instructions: dict[str, list[str]] = {}
        self.max_demos = 0
        self.search_k = False
        self.temps: dict[str, list[float | None]] = {}
        self.ensemble: dict[str, list[int]] = {}
        self.pool_exhausted_by: str | None = None

    @classmethod
    def build(cls, stage: RandomSearch, program: dspy.Module, ctx: StageContext) -> _Space:
        space = cls()
        space.max_demos = stage.max_demos
        space.search_k = stage.search_k
        named = program.named_predictors()
        space.predictors = [n for n, _ in named]
        pool = bootstrap_pool(program, ctx, successes=stage.pool_size, max_labeled_demos=stage.max_labeled_demos,
                              metric_threshold=stage.metric_threshold) if stage.pool_size else None
        if pool is not None:
            space.pool_exhausted_by = pool.exhausted_by
        for name, predictor in named:
            current = [d.toDict() if hasattr(d, "toDict") else dict(d) for d in predictor.demos]
            entries = list(current)
            for demo in pool.demos_for(name) if pool is not None else []:
                if demo not in entries:
                    entries.append(demo)
            space.pools[name] = entries
            space.current_demos[name] = len(current)
        space.instructions = _instruction_candidates(stage, program, ctx, space)
        space._node_settings(stage, program)
        return space

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

    def incumbent_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for i, name in enumerate(self.predictors):
            k = min(self.current_demos[name], self.max_demos)
            if self.pools[name] and self.max_demos:
                if self.search_k:
                    params[f"p{i}.k"] = k
                for j in range(self.max_demos):
                    params[f"p{i}.d{j}"] = j if j < k else 0
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
        candidate = clone_program(program)
        named = dict(candidate.named_predictors())
        for i, name in enumerate(self.predictors):
            predictor = named[name]
            pool = self.pools[name]
            if pool and self.max_demos:
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
        for key, choices in self.ensemble.items():
            n = choices[get("cat", f"{key}.n", list(range(len(choices))))]
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
