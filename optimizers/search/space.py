"""The search space: the candidates' demo sets, the pool sampled candidates draw from, instruction
options and node settings, and how a trial turns into a program.

Example:
    >>> from flowopt.optimizers.search.space import SearchSpace
    >>> SearchSpace().seeded
    []
"""

from __future__ import annotations

import contextvars
import random
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import dspy

from flowopt.compiler import StageContext, clone_program
from flowopt.optimizers.demos import bootstrap_pool, compose_demos, labeled_demos, shuffled_bootstrap
from flowopt.optimizers.search.instructions import instruction_candidates

if TYPE_CHECKING:
    from flowopt.optimizers.search.stage import RandomSearch


class CandidateSource(Protocol):
    """What picking a winner needs of the candidates: their pools, instructions and programs
    (a :class:`SearchSpace`, or a shared study's stored definitions)."""

    @property
    def pools(self) -> Any: ...

    @property
    def instructions(self) -> Any: ...

    def apply(self, program: dspy.Module, trial: Any) -> dspy.Module: ...


class SearchSpace:
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
        self.kinds: tuple[str, ...] = ()  # the kinds of extra candidates allowed (see .kinds)

    @classmethod
    def build(cls, stage: RandomSearch, program: dspy.Module, ctx: StageContext, lm_pool: Executor,
              planned: int | None = None) -> SearchSpace:
        """The space of ``stage`` on ``program``; ``planned``: how many of its planned candidates will be
        raced (default all ``n_candidates``), so only their shuffled bootstraps are made."""
        space = cls._start(stage, program)
        sets, unshuffled = space._fixed_sets(stage, program, ctx)
        count = stage.seeded_count() if planned is None else min(stage.seeded_count(), max(0, planned - 3))
        bootstraps = space._bootstraps(stage, program, ctx, lm_pool, count, unshuffled)
        if unshuffled:  # in the zero-shot slot, second
            sets.insert(1, bootstraps.pop(0))
        sets.extend(bootstraps)
        pool = None
        distinct = {repr(sorted(d.items())) for _, demos in sets for ds in demos.values() for d in ds}
        if stage.pool_size > len(distinct) and stage.may_sample() and stage.max_demos:
            # Sampled candidates draw from every demo above; bootstrap more only if those are too few.
            pool = bootstrap_pool(program, ctx, successes=stage.pool_size, max_labeled_demos=stage.max_labeled_demos,
                                  metric_threshold=stage.metric_threshold, executor=lm_pool)
            space.pool_exhausted_by = space.pool_exhausted_by or pool.exhausted_by
        space._set_pools(sets, pool.demos_for if pool else None)
        space.instructions = instruction_candidates(stage, program, ctx, space)
        space._node_settings(stage, program)
        return space

    @classmethod
    def without_lm(cls, stage: RandomSearch, program: dspy.Module, ctx: StageContext) -> SearchSpace:
        """The space of the candidates that need no LM call to define (incumbent, zero-shot, labeled):
        they apply exactly as in the full space, so a shared search can score them while it plans.
        They are the full space's first candidates: when the unshuffled bootstrap takes the second slot,
        only the incumbent comes before it."""
        space = cls._start(stage, program)
        sets, unshuffled = space._fixed_sets(stage, program, ctx)
        space._set_pools(sets[:1] if unshuffled else sets, None)
        space.instructions = {name: [p.signature.instructions] for name, p in program.named_predictors()}
        space._node_settings(stage, program)
        return space

    @classmethod
    def _start(cls, stage: RandomSearch, program: dspy.Module) -> SearchSpace:
        space = cls()
        space.max_demos = stage.max_demos
        space.search_k = stage.search_k
        space.kinds = tuple(stage.kinds)
        space.predictors = [n for n, _ in program.named_predictors()]
        return space

    def _fixed_sets(self, stage: RandomSearch, program: dspy.Module,
                    ctx: StageContext) -> tuple[list[tuple[str, dict[str, list[dict[str, Any]]]]], bool]:
        """The incumbent's, zero-shot and labeled-only demo sets (as many as ``n_candidates`` allows), and
        whether DSPy's unshuffled bootstrap takes the zero-shot slot.

        An incumbent without demos is the zero-shot program already: its slot goes to the unshuffled
        bootstrap instead (BFRS's seed -1, the demos stage's program), so a search run on its own tries
        BFRS's very candidates and races that one like the rest instead of scoring it in full."""
        current = {name: [d.toDict() if hasattr(d, "toDict") else dict(d) for d in predictor.demos]
                   for name, predictor in program.named_predictors()}
        unshuffled = stage.n_candidates > 1 and not any(current.values())
        sets: list[tuple[str, dict[str, list[dict[str, Any]]]]] = [("incumbent", current)]
        if stage.n_candidates > 1 and not unshuffled:
            sets.append(("zero-shot", {n: [] for n in self.predictors}))
        if stage.n_candidates > 2:
            sets.append(("labeled", labeled_demos(ctx.trainset, stage.max_labeled_demos, ctx.seed, self.predictors)))
        return sets, unshuffled

    def _set_pools(self, sets: list[tuple[str, dict[str, list[dict[str, Any]]]]],
                   more: Callable[[str], list[dict[str, Any]]] | None) -> None:
        for name in self.predictors:
            entries: list[dict[str, Any]] = []
            for demo in [*(d for _, demos in sets for d in demos[name]), *(more(name) if more else [])]:
                if demo not in entries:
                    entries.append(demo)
            self.pools[name] = entries
        self.seeded = [(kind, [[self.pools[n].index(d) for d in demos[n]] for n in self.predictors])
                       for kind, demos in sets]

    def _bootstraps(self, stage: RandomSearch, program: dspy.Module, ctx: StageContext, lm_pool: Executor,
                    count: int, unshuffled: bool = False) -> list[tuple[str, dict[str, list[dict[str, Any]]]]]:
        """DSPy's first ``count`` shuffled-bootstrap candidates (after its unshuffled one, kind
        ``"bootstrap"``, when ``unshuffled``), all bootstrapped at once on the shared LM threads."""
        if not count and not unshuffled:
            return []
        names = [n for n, _ in program.named_predictors()]
        size = max(1, stage.max_demos)

        def one(i: int) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
            if i < 0:  # DSPy's BootstrapFewShot on the trainset in order, as the demos stage runs it
                pool = bootstrap_pool(program, ctx, successes=size, max_labeled_demos=stage.max_labeled_demos,
                                      metric_threshold=stage.metric_threshold, executor=lm_pool)
                return compose_demos(ctx, pool, names, size, stage.max_labeled_demos), pool.exhausted_by
            return shuffled_bootstrap(program, ctx, i, max_bootstrapped=size,
                                      max_labeled=stage.max_labeled_demos, metric_threshold=stage.metric_threshold,
                                      executor=lm_pool)

        numbers = [*([-1] if unshuffled else []), *range(count)]
        with ThreadPoolExecutor(max_workers=len(numbers), thread_name_prefix="flowopt-seeds") as seeds:
            futures = [seeds.submit(contextvars.copy_context().run, one, i) for i in numbers]
            results = [f.result() for f in futures]
        for _, exhausted in results:
            self.pool_exhausted_by = self.pool_exhausted_by or exhausted
        return [("bootstrap" if i < 0 else f"bootstrap-{i}", demos) for i, (demos, _) in zip(numbers, results)]

    def fresh_bootstrap(self, stage: RandomSearch, program: dspy.Module, ctx: StageContext,
                        number: int) -> list[list[dict[str, Any]]]:
        """A new shuffled bootstrap of DSPy's full demo size for extra candidate ``number`` (BFRS's
        candidate ``number``: none of the planned ones), as demos per predictor in order."""
        demos, exhausted = shuffled_bootstrap(program, ctx, number, max_bootstrapped=max(1, stage.max_demos),
                                              max_labeled=stage.max_labeled_demos,
                                              metric_threshold=stage.metric_threshold)
        self.pool_exhausted_by = self.pool_exhausted_by or exhausted
        return [list(demos.get(name, [])) for name in self.predictors]

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

    def extra_kinds(self) -> list[str]:
        """The kinds of extra candidate this space can make (of those allowed): a kind needs something to
        vary (demos to draw, more than one instruction, settings to try)."""
        can = {"bootstrap": self.max_demos > 0, "subset": self.max_demos > 0 and any(self.pools.values()),
               "instruction": any(len(v) > 1 for v in self.instructions.values()),
               "settings": any(len(v) > 1 for v in self.temps.values())
               or any(len(v) > 1 for v in self.ensemble.values())}
        return [k for k in self.kinds if can.get(k)]

    def change_one(self, kind: str, params: dict[str, Any], rng: random.Random,
                   tried: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """``params`` with one instruction (``kind="instruction"``) or one node setting (``"settings"``)
        drawn anew among the options other than the current one, and among those not in ``tried`` (the
        parameters of the changes already made to the same ``params``) while any is left."""
        if kind == "instruction":
            options = {f"p{i}.instr": len(self.instructions[n]) for i, n in enumerate(self.predictors)}
        else:
            options = {**{f"{k}.temp": len(v) for k, v in self.temps.items()},
                       **{f"{k}.n": len(v) for k, v in self.ensemble.items()}}
        changes = [(name, i) for name, n in sorted(options.items()) for i in range(n) if i != params.get(name, 0)]
        if not changes:
            return dict(params)
        fresh = [(name, i) for name, i in changes if not any(t.get(name) == i for t in tried)]
        name, value = rng.choice(fresh or changes)
        return {**params, name: value}

    def apply(self, program: dspy.Module, trial: Any) -> dspy.Module:
        """A copy of ``program`` set up as the trial says (``trial`` may be a live or a frozen trial)."""
        get = _getter(trial)
        fixed = trial.user_attrs.get("demos")
        literal = trial.user_attrs.get("demo_sets")  # an extra bootstrap's own demos, per predictor
        candidate = clone_program(program)
        named = dict(candidate.named_predictors())
        for i, name in enumerate(self.predictors):
            predictor = named[name]
            pool = self.pools[name]
            if literal is not None:
                predictor.demos = [dspy.Example(**d) for d in literal[i]]
            elif fixed is not None:
                predictor.demos = [dspy.Example(**pool[idx]) for idx in fixed[i]]
            elif pool and self.max_demos:
                k = get("int", f"p{i}.k", 1, self.max_demos) if self.search_k else self.max_demos
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
