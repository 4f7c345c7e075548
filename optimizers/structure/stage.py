"""The ``structure`` compile stage: MCTS over typed edits of a ``Workflow``, under the shared budget."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import dspy

from flowopt.compiler import Stage, StageContext
from flowopt.errors import BudgetExhausted, ConfigError, LMError
from flowopt.optimizers.structure.pareto import pareto_point, pick_point
from flowopt.optimizers.structure.proposers import LMProposer, Proposer, RuleProposer, Vocabulary
from flowopt.optimizers.structure.result import Evaluation
from flowopt.optimizers.structure.search import MCTS
from flowopt.optimizers.structure.search_settings import SearchSettings
from flowopt.settings import at_least, between, check_stage, one_of
from flowopt.workflow import Workflow

logger = logging.getLogger(__name__)

SPLITS = ("trainset", "valset")


#: The stage's search settings unless told otherwise: three finalists re-measured on fresh examples.
DEFAULT_SEARCH = SearchSettings(final_top=3)
SEARCH_FIELDS = frozenset(f.name for f in dataclasses.fields(SearchSettings))


@dataclass(frozen=True, init=False)
class StructureSearch(Stage):
    """Search the workflow's structure: select a node of the tree, apply one edit, score it, repeat.

    ``proposer="rule"`` enumerates edits (no optimizer LM); ``"lm"`` asks ``optimizer_lm`` (any dspy LM;
    default: the configured one) for an edit as structured output. ``split`` is the search split
    (the compiler reports on the valset). The tree is checkpointed every round (``tree.json`` in the
    stage folder) and resumed; the report gets the winning edits, the tree and a picture
    (``tree.png``).

    Measurements: every candidate is run on the search examples with its own rollouts (``rollout_id``
    1..``repeats`` on the LMs, so neither DSPy's cache nor the evaluation memo answers a repeat: a
    repeat is a new sample when the LM samples, temperature > 0), and its LM calls and tokens per
    example are counted. The ``final_top`` leaders race on fresh examples (the split's examples past
    ``max_examples``, else a held-out quarter of it), ranked by all their measurements, and the winner is
    returned; the report gives its search score and its fresh re-measurement, their 95% intervals, and
    the score/LM-calls Pareto front (``pareto.png``). ``objective="penalised"`` ranks by score minus
    ``cost_weight`` x LM calls per example. ``objective="pareto"`` also searches near the cheaper points
    of the front and keeps each point's workflow in the report, so that :func:`pick` returns the best
    one within a cost limit::

        best = flowopt.compile(wf, train, metric, stages=[StructureSearch(objective="pareto")])
        cheap = pick(best, max_calls=3)   # the best workflow of the front at <= 3 LM calls per example

    Settings:
        search: the tree search's :class:`~flowopt.optimizers.structure.search_settings.SearchSettings`
            (default: ``SearchSettings(final_top=3)``), each documented there. Its fields may also be
            passed by name (``StructureSearch(max_rounds=10)``) or as a mapping (``search={...}``).
        proposer: ``"rule"`` (enumerate edits) or ``"lm"`` (ask ``optimizer_lm``).
        optimizer_lm: the LM that proposes edits for ``proposer="lm"`` (default: the configured one).
        max_attempts: the LM proposer's tries per edit (a malformed or invalid edit is asked again).
        max_nodes: the largest workflow an edit may produce (nodes).
        edit_kinds: the edit kinds to propose (default: all of them).
        ensemble_sizes: sample counts a ``wrap_ensemble`` edit may choose.
        refine_rounds: round counts an ``add_refine`` edit may choose.
        split: the examples candidates are scored on: ``"trainset"`` or ``"valset"``.
        max_examples: search examples (the rest of the split are the finalists' fresh examples;
            ``None``: all but a held-out quarter when there are finals).
        draw: draw ``tree.png`` and ``pareto.png`` in the stage folder.

    Example:
        >>> from flowopt.optimizers.structure import StructureSearch
        >>> StructureSearch(max_rounds=10, selection="uct").settings()["selection"]
        'uct'
        >>> StructureSearch(max_rounds=10).search.final_top
        3
    """

    name: ClassVar[str] = "structure"
    search: SearchSettings = DEFAULT_SEARCH
    proposer: str = "rule"
    optimizer_lm: Any = None
    max_attempts: int = 3
    max_nodes: int = 8
    edit_kinds: tuple[str, ...] | None = None
    ensemble_sizes: tuple[int, ...] = (3, 5)
    refine_rounds: tuple[int, ...] = (1, 2)
    split: str = "trainset"
    max_examples: int | None = None
    draw: bool = True

    def __init__(self, search: SearchSettings | Mapping[str, Any] | None = None, **settings: Any) -> None:
        own = {f.name: f.default for f in dataclasses.fields(self) if f.name != "search"}
        searched = {f.name for f in dataclasses.fields(SearchSettings)}
        unknown = sorted(set(settings) - set(own) - searched)
        if unknown:  # compile turns this into a ConfigError naming the stage
            raise TypeError(f"StructureSearch got unexpected settings {unknown}")
        if search is not None and not isinstance(search, SearchSettings | Mapping):
            raise ConfigError(f"StructureSearch search must be a SearchSettings or a mapping, got {search!r}",
                              fix="pass search=SearchSettings(max_rounds=20), or the settings by name")
        base = search if isinstance(search, SearchSettings) else DEFAULT_SEARCH
        flat = {**(search if isinstance(search, Mapping) else {}), **{k: settings[k] for k in searched & set(settings)}}
        object.__setattr__(self, "search", dataclasses.replace(base, **flat) if flat else base)
        for name, default in own.items():
            object.__setattr__(self, name, settings.get(name, default))
        self.__post_init__()

    def __post_init__(self) -> None:
        check_stage(self, {
            "proposer": one_of("rule", "lm"), "max_attempts": at_least(1), "max_nodes": at_least(1),
            "ensemble_sizes": between(1, 64), "refine_rounds": between(1, 10), "split": one_of(*SPLITS),
            "max_examples": at_least(1),
        })
        self.vocabulary()  # checks the edit kinds now, not at run time

    def __getattr__(self, name: str) -> Any:
        """A search setting read by name (``stage.max_rounds``), as it may be passed."""
        search = self.__dict__.get("search")
        if search is not None and name in SEARCH_FIELDS:
            return getattr(search, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def settings(self) -> dict[str, Any]:
        """The search settings and the stage's own, flat (as they may be passed)."""
        own = super().settings()
        return {**own.pop("search"), **own}

    def vocabulary(self) -> Vocabulary:
        kinds = Vocabulary().kinds if self.edit_kinds is None else tuple(self.edit_kinds)
        return Vocabulary(kinds=kinds, ensemble_sizes=tuple(self.ensemble_sizes),
                          refine_rounds=tuple(self.refine_rounds), max_nodes=self.max_nodes)

    def make_proposer(self) -> Proposer:
        if self.proposer == "lm":
            return LMProposer(self.optimizer_lm, vocabulary=self.vocabulary(), max_attempts=self.max_attempts)
        return RuleProposer(self.vocabulary())

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        if not isinstance(program, Workflow):
            raise ConfigError(f"structure search needs a flowopt.Workflow, got {type(program).__name__}",
                              fix="declare the program as a Workflow, or leave 'structure' out of the stages")
        examples, fresh = self._split_examples(list(getattr(ctx, self.split) or ctx.trainset))
        search_eval = _Measurer(ctx, examples)
        final_eval = _Measurer(ctx, fresh, rollout_offset=1000) if fresh is not examples else search_eval

        checkpoint = _ContextCheckpoint(ctx) if ctx.run_dir is not None else None
        search = MCTS(self.make_proposer(), search_eval, self.search, seed=ctx.seed,
                      checkpoint=checkpoint, resume=bool(ctx.resume), should_stop=ctx.budget.exhausted,
                      final_evaluate=final_eval)
        try:
            result = search.run(program)
        except BudgetExhausted as err:
            # Not even the starting workflow could be scored: hand it back unchanged.
            ctx.record(stop_reason=f"budget: {err.limit}", candidates_tried=0)
            return program
        stop = result.stop_reason
        if stop.startswith("budget exhausted"):
            stop = "budget: " + stop[len("budget exhausted ("):-1]
        ctx.record(
            candidates_tried=len(result.tree.nodes), evaluations=result.evaluations, rounds=result.rounds,
            stop_reason=stop,
            search_score=round(result.best_score, 6), initial_score=result.tree.nodes[0].score,
            search_interval=[round(x, 6) for x in result.tree.nodes[result.best_node].interval],
            remeasured=result.remeasured, finalists=result.finalists,
            best_cost=result.tree.nodes[result.best_node].cost,
            pareto_front=[pareto_point(n, with_workflow=self.search.objective == "pareto")
                          for n in result.tree.pareto_front()],
            search_examples=len(examples), final_examples=len(fresh), objective=self.search.objective,
            edits=[e.to_dict() for e in result.edits], edit_descriptions=[e.describe() for e in result.edits],
            tree=result.tree.to_dict(with_workflows=False),
        )
        if ctx.run_dir is not None and self.draw:
            try:
                from flowopt.optimizers.structure.draw import draw_pareto, draw_tree

                path = ctx.run_dir / "tree.png"
                draw_tree(result.tree, path=path, best=result.best_node)
                ctx.record(tree_picture=str(path))
                if result.tree.pareto_front():
                    pareto = draw_pareto(result.tree, path=ctx.run_dir / "pareto.png", best=result.best_node)
                    ctx.record(pareto_picture=str(pareto))
            except Exception as err:  # a picture is a nicety; never fail a compile over it
                logger.warning("could not draw the search tree: %s", err)
        best = result.best
        best.meta = {**best.meta, "structure_edits": [e.to_dict() for e in result.edits]}
        return best


    def _split_examples(self, examples: list[Any]) -> tuple[list[Any], list[Any]]:
        """(search examples, fresh examples for the finalists' re-measurement)."""
        if not examples:
            raise ConfigError("structure search has no examples to score candidates on",
                              fix="pass a non-empty trainset (or valset with split='valset')")
        if self.max_examples is not None and len(examples) > self.max_examples:
            return examples[: self.max_examples], examples[self.max_examples:]
        if self.search.final_top and len(examples) >= 8:
            cut = len(examples) - len(examples) // 4
            return examples[:cut], examples[cut:]
        return examples, examples  # too few to hold some out: finalists get fresh rollouts only


def pick(compiled: Any, *, max_calls: float | None = None, max_tokens: float | None = None) -> Workflow:
    """The best workflow of a compiled program's score/cost front (``StructureSearch(objective="pareto")``)
    within a cost limit: LM calls and/or tokens per example, as measured on the search split.

    ``compiled`` is what :func:`flowopt.compile` returned (or its ``CompileReport``). The workflow keeps the
    compiled program's LM bindings. Scores on the front are search-split measurements; score the pick on
    held-out data before relying on it.

    Example:
        >>> from flowopt.compiler import CompileReport, StageReport
        >>> from flowopt.optimizers.structure import pick
        >>> pick(CompileReport(stages=[StageReport("structure")]), max_calls=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        flowopt.errors.ConfigError: the structure stage recorded no front with workflows. Fix: run ...
    """
    report = getattr(compiled, "report", compiled)
    try:
        front = report.stage("structure").info.get("pareto_front", [])
    except (KeyError, AttributeError) as err:
        raise ConfigError("this program has no structure stage report",
                          fix='compile with stages=[StructureSearch(objective="pareto")]') from err
    front = [p for p in front if "workflow" in p]
    if not front:
        raise ConfigError("the structure stage recorded no front with workflows",
                          fix='run StructureSearch(objective="pareto")')
    point = pick_point(front, max_calls=max_calls, max_tokens=max_tokens)
    wf = Workflow.from_dict(point["workflow"])
    own = getattr(compiled, "lms", {}) or {}
    wf.lms.update({k: v for k, v in own.items() if k in wf.lms})
    return wf


class _Measurer:
    """Scores a workflow on fixed examples; the k-th call for one workflow runs with ``rollout_id`` k
    on every LM (the ambient one and the workflow's own), which gives a distinct sample and a distinct
    memo key, and counts the LM calls and tokens it took per example."""

    def __init__(self, ctx: StageContext, examples: list[Any], *, rollout_offset: int = 0) -> None:
        self.ctx, self.examples, self.offset = ctx, examples, rollout_offset
        self.calls: dict[str, int] = {}

    def __call__(self, workflow: Workflow) -> Evaluation:
        key = workflow.canonical_json()
        self.calls[key] = k = self.calls.get(key, 0) + 1
        rollout = self.offset + k
        run = copy.copy(workflow)
        run.lms = {name: _with_rollout(lm, rollout) for name, lm in workflow.lms.items()}
        ambient = dspy.settings.lm
        before = self.ctx.budget.usage()
        try:
            with dspy.context(lm=_with_rollout(ambient, rollout)) if ambient is not None else nullcontext():
                result = self.ctx.evaluate(run, self.examples, desc="structure candidate")
        except LMError as err:
            # Too many examples failed (e.g. the LM cannot follow a new operator's format): the
            # candidate scores 0 like any failed example would, and the search goes on.
            logger.info("structure candidate failed to run: %s", err)
            return Evaluation(0.0, [{"error": str(err)[:500]}], [0.0] * len(self.examples), self._cost(before))
        failures = [{**ex.toDict(), "score": s} for ex, s in zip(self.examples, result.scores) if s < 1.0][:5]
        return Evaluation(result.score, _jsonable(failures), list(result.scores), self._cost(before))

    def _cost(self, before: dict[str, Any]) -> dict[str, float]:
        """LM calls (real and cached) and tokens (of real calls) per example since ``before``."""
        after = self.ctx.budget.usage()
        n = max(len(self.examples), 1)
        calls = after["lm_calls"] + after["cache_hits"] - before["lm_calls"] - before["cache_hits"]
        return {"lm_calls": calls / n, "tokens": (after["tokens"] - before["tokens"]) / n}


def _with_rollout(lm: Any, rollout: int) -> Any:
    copier = getattr(lm, "copy", None)
    if isinstance(lm, dict) or not callable(copier):
        return lm  # an LM not built yet (loaded from JSON) or not a dspy.LM: used as it is
    return copier(rollout_id=rollout)


class _ContextCheckpoint:
    """The search's checkpoint in the stage folder, through the context (atomic JSON)."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx

    def save(self, data: dict[str, Any]) -> None:
        self.ctx.save_checkpoint("tree", data)

    def load(self) -> dict[str, Any] | None:
        return self.ctx.load_checkpoint("tree")


def _jsonable(value: Any) -> Any:
    import json

    return json.loads(json.dumps(value, default=str))
