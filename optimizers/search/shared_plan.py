"""The plan of a shared search: every candidate as a full definition (demos, instruction text and
settings per predictor and node), so the study, not each worker's own search space, says what a
candidate is.

Example:
    >>> import dspy
    >>> from flowopt.optimizers.search.shared_plan import apply_definition, definition_of
    >>> program = dspy.Predict("question -> answer")
    >>> definition = definition_of(program)
    >>> definition["predictors"]["self"]["demos"]
    []
    >>> definition_of(apply_definition(program, definition)) == definition
    True
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import dspy

from flowopt.compiler import StageContext, clone_program
from flowopt.errors import ConfigError, FlowoptError
from flowopt.optimizers.search.shared_claims import StudyWorker
from flowopt.optimizers.search.space import SearchSpace

if TYPE_CHECKING:
    from flowopt.optimizers.search.stage import RandomSearch


def definition_of(program: dspy.Module) -> dict[str, Any]:
    """What makes this candidate: per predictor its demos, instruction text and temperature; per
    workflow node its temperature and ensemble size (JSON-able)."""
    predictors: dict[str, dict[str, Any]] = {}
    for name, predictor in program.named_predictors():
        entry: dict[str, Any] = {
            "demos": [d.toDict() if hasattr(d, "toDict") else dict(d) for d in predictor.demos],
            "instructions": predictor.signature.instructions,
        }
        if "temperature" in predictor.config:
            entry["temperature"] = predictor.config["temperature"]
        predictors[name] = entry
    nodes: dict[str, dict[str, Any]] = {}
    for node_id, op in (getattr(program, "nodes", None) or {}).items():
        settings = {key: getattr(op, key) for key in ("temperature", "n") if hasattr(op, key)}
        if settings:
            nodes[node_id] = settings
    return {"predictors": predictors, "nodes": nodes}


def apply_definition(program: dspy.Module, definition: dict[str, Any]) -> dspy.Module:
    """A copy of ``program`` set up as ``definition`` says."""
    candidate = clone_program(program)
    named = dict(candidate.named_predictors())
    nodes = getattr(candidate, "nodes", None) or {}
    if set(named) != set(definition["predictors"]) or not set(definition["nodes"]) <= set(nodes):
        raise ConfigError(f"the shared study was planned for a program with predictors "
                          f"{sorted(definition['predictors'])}; this worker's program has {sorted(named)}",
                          fix="run every worker with the same program and stages, or pass a new study_name")
    for node_id, settings in definition["nodes"].items():
        for key, value in settings.items():
            setattr(nodes[node_id], key, value)
    for name, entry in definition["predictors"].items():
        predictor = named[name]
        predictor.demos = [dspy.Example(**d) for d in entry["demos"]]
        if predictor.signature.instructions != entry["instructions"]:
            predictor.signature = predictor.signature.with_instructions(entry["instructions"])
        if "temperature" in entry:
            predictor.config["temperature"] = entry["temperature"]
        else:
            predictor.config.pop("temperature", None)
    return candidate


def first_candidates(stage: RandomSearch, program: dspy.Module, ctx: StageContext) -> list[tuple[str, dict[str, Any]]]:
    """The candidates defined without any LM call (incumbent, zero-shot, labeled-only), as
    ``(kind, definition)``: the first ones :func:`plan_candidates` returns, known at once."""
    return _definitions(stage, program, ctx, SearchSpace.without_lm(stage, program, ctx), count=None)


def plan_candidates(stage: RandomSearch, program: dspy.Module,
                    ctx: StageContext) -> tuple[list[tuple[str, dict[str, Any]]], SearchSpace]:
    """Every candidate of the search as ``(kind, definition)``, in candidate order, with the space.

    They are the very candidates a one-process search asks: seeded ones as they are, sampled ones
    drawn from the sampler seeded by (seed, number) in a throwaway in-memory study.
    """
    with ThreadPoolExecutor(max_workers=max(1, ctx.num_threads), thread_name_prefix="flowopt-plan") as lm_pool:
        space = SearchSpace.build(stage, program, ctx, lm_pool)
    return _definitions(stage, program, ctx, space, count=stage.n_candidates + (stage.extra or 0)), space


def _definitions(stage: RandomSearch, program: dspy.Module, ctx: StageContext, space: SearchSpace,
                 count: int | None) -> list[tuple[str, dict[str, Any]]]:
    """Candidates ``0..count-1`` of ``space`` (``None``: its seeded ones) as ``(kind, definition)``."""
    import optuna

    scratch = optuna.create_study(direction="maximize")
    planned = []
    for number in range(len(space.seeded) if count is None else count):
        trial, candidate = stage.ask_candidate(scratch, space, program, ctx, number, None)
        planned.append((str(trial.user_attrs["kind"]), definition_of(candidate)))
    return planned


PLAN = "plan"  # the study's user attr written once every candidate is enqueued
SETTINGS = "settings"  # the study's user attr: the settings it was planned with (written before any candidate)
# Settings that may differ between the workers of one study (the planner alone uses the proposer LM).
SETTINGS_LOCAL_TO_A_WORKER = ("heartbeat_s", "stale_after_s", "wait_timeout_s", "parallel", "proposer_lm")


class PlanningWorker(StudyWorker):
    """A worker's part in planning the shared study: check its settings against the study's, and plan
    every candidate when it is the one to (the first, or the one taking over from a dead planner)."""

    def plan_step(self, program: dspy.Module) -> bool:
        """Whether the plan is complete: checks this worker's settings against the study's, and plans
        now if no other worker is planning (or the one that was died)."""
        if self.plan is not None:
            return True
        attrs = self.study.user_attrs
        if SETTINGS in attrs and not self.settings_checked:
            mine = _fingerprint(self.stage)
            if attrs[SETTINGS] != mine:
                theirs = attrs[SETTINGS]
                differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                raise ConfigError(f"the shared study {self.stage.study_name!r} was planned with other search "
                                  f"settings ({', '.join(differ)} differ)",
                                  fix="run every worker with the same search settings, or pass a new study_name")
            self.settings_checked = True
        done, plan = self.try_decide(PLAN, lambda: self._plan(program), attrs)
        if done:
            self.plan = dict(plan)
            self.settings_checked = True  # planned with our settings (the check above, or by us)
            self.log(f"plan of {self.plan['candidates']} candidates ready")
        return done

    def _plan(self, program: dspy.Module) -> dict[str, Any]:
        """Enqueue every candidate: first the ones defined without an LM call (other workers score them
        while this one bootstraps), then the rest."""
        self.study.set_user_attr(SETTINGS, _fingerprint(self.stage))  # before any candidate exists
        present = {t.user_attrs.get("candidate") for t in self.study.get_trials(deepcopy=False)}
        first = first_candidates(self.stage, program, self.ctx)
        self._enqueue(first, present)
        self.log(f"{len(first)} candidates enqueued before planning the rest")
        planned, space = plan_candidates(self.stage, program, self.ctx)
        if planned[: len(first)] != first:  # the two ways of defining them must agree, or workers would differ
            raise FlowoptError("the shared search's first candidates differ from its full plan's",
                               fix="report this as a flowopt bug; meanwhile run the search in one process")
        self._enqueue(planned, present)
        self.record_calls()
        return {"candidates": len(planned), "planner": self.worker_id,
                "pool_demos": {n: len(p) for n, p in space.pools.items()},
                "instruction_candidates": {n: len(c) for n, c in space.instructions.items()},
                "pool_exhausted_by": space.pool_exhausted_by}

    def _enqueue(self, planned: list[tuple[str, dict[str, Any]]], present: set[Any]) -> None:
        for number, (kind, definition) in enumerate(planned):
            if number not in present:  # a planner that died half-way enqueued the others
                self.study.enqueue_trial({}, user_attrs={"candidate": number, "kind": kind, "definition": definition})
                present.add(number)



def _fingerprint(stage: RandomSearch) -> dict[str, Any]:
    """The settings every worker of one study must share (JSON-able, as stored in the study)."""
    settings = {k: v for k, v in stage.settings().items() if k not in SETTINGS_LOCAL_TO_A_WORKER}
    return dict(json.loads(json.dumps(settings, default=str)))

