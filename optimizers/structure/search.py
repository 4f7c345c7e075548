"""Tree search over typed workflow edits.

Each round selects a tree node, asks the proposer for one untried edit, and evaluates the edited
workflow, unless a workflow with the same canonical JSON was already scored (then the edit is recorded
as a duplicate: nothing is paid and no round is used). Selection is ``best_first`` by default: the open
node with the highest upper 95% bound of its objective (the mean when there is no noise), so the search
keeps expanding the best workflow found (greedy on additive landscapes) and falls back to the next best
when a node's edits are used up (it gets out of deceptive local optima); with probability ``explore`` it
picks a uniformly random open node instead (a restart). AFlow's ``mixed`` selection and ``uct`` remain.

Every node keeps its measurements (per-example scores when the evaluator gives them), hence a 95%
interval; ``repeats`` measures each candidate several times. ``final_top`` leaders are re-measured at the
end with ``final_evaluate`` (fresh examples) and the best re-measured one is returned, with both scores.
``objective="penalised"`` ranks by score minus ``cost_weight`` x LM calls per example (the evaluator
reports cost); every node keeps its cost, so the report can show the score/cost Pareto front.

The search stops on ``max_rounds`` (new candidates scored), ``max_evaluations`` (evaluator calls,
repeats and finals included), convergence, an exhausted tree, or the budget. After every round the whole
state is checkpointed, so a search killed at any point and resumed with the same seed ends exactly as an
uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flowopt.errors import BudgetExhausted, ConfigError
from flowopt.io import atomic_write_json
from flowopt.optimizers.structure.edits import Edit, edit_from_dict
from flowopt.optimizers.structure.proposers import NoProposal, ProposalContext, Proposer
from flowopt.optimizers.structure.selection import select_best_first, select_mixed, select_uct
from flowopt.optimizers.structure.tree import SearchTree, TreeNode, interval_half_width, ir_key, workflow_key
from flowopt.workflow import Workflow

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 2
SELECTIONS = ("best_first", "mixed", "uct")
OBJECTIVES = ("score", "penalised")


@dataclass
class Evaluation:
    """A workflow's score on the search split, and a few examples it failed (shown to LM proposers).

    ``scores`` (one per example) give the node's confidence interval; ``cost`` is what one example cost
    on average (``{"lm_calls": ..., "tokens": ...}``).
    """

    score: float
    failures: list[dict[str, Any]] = field(default_factory=list)
    scores: list[float] | None = None
    cost: dict[str, float] = field(default_factory=dict)


Evaluator = Callable[[Workflow], "float | Evaluation | Any"]


class Checkpointer(Protocol):
    def save(self, data: dict[str, Any]) -> None: ...

    def load(self) -> dict[str, Any] | None: ...


class JsonCheckpoint:
    """Keeps the search state in one JSON file, written atomically.

    Example:
        >>> import tempfile, pathlib
        >>> ckpt = JsonCheckpoint(pathlib.Path(tempfile.mkdtemp()) / "tree.json")
        >>> ckpt.load() is None
        True
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def save(self, data: dict[str, Any]) -> None:
        atomic_write_json(self.path, data)

    def load(self) -> dict[str, Any] | None:
        if not self.path.is_file():
            return None
        return json.loads(self.path.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class SearchSettings:
    """Settings of :class:`MCTS`; bad values raise :class:`~flowopt.errors.ConfigError` with the fix.

    Example:
        >>> SearchSettings(max_rounds=10, selection="uct").selection
        'uct'
    """

    max_rounds: int = 20
    selection: str = "best_first"
    explore: float = 0.2
    top_k: int = 4
    alpha: float = 0.2
    lambda_: float = 0.3
    uct_c: float = 1.4
    widen: float = 1.0
    convergence_rounds: int | None = 8
    convergence_eps: float = 1e-4
    repeats: int = 1
    max_evaluations: int | None = None
    final_top: int = 0
    final_repeats: int = 1
    objective: str = "score"
    cost_weight: float = 0.0
    confirm: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ConfigError(f"max_rounds must be an int >= 1, got {self.max_rounds!r}", fix="pass max_rounds=20")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"selection must be one of {SELECTIONS}, got {self.selection!r}",
                              fix='pass selection="best_first" (default), "mixed" (AFlow) or "uct"')
        if not 0.0 <= self.explore <= 1.0:
            raise ConfigError(f"explore must be in [0, 1], got {self.explore!r}", fix="pass explore=0.2")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}",
                              fix='pass objective="score", or "penalised" with cost_weight > 0')
        if not isinstance(self.cost_weight, int | float) or self.cost_weight < 0:
            raise ConfigError(f"cost_weight must be a number >= 0, got {self.cost_weight!r}",
                              fix="pass cost_weight=0.01 (score lost per LM call per example)")
        if not isinstance(self.confirm, int) or self.confirm < 1:
            raise ConfigError(f"confirm must be an int >= 1, got {self.confirm!r}",
                              fix="pass confirm=3 to measure a noisy leader three times before expanding it")
        for name in ("final_top", "final_repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "final_top" else 1):
                raise ConfigError(f"{name} must be an int >= {0 if name == 'final_top' else 1}, got {value!r}",
                                  fix="pass final_top=3, final_repeats=2")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ConfigError(f"top_k must be an int >= 1, got {self.top_k!r}", fix="pass top_k=4")
        if not 0.0 <= self.lambda_ <= 1.0:
            raise ConfigError(f"lambda_ must be in [0, 1], got {self.lambda_!r}", fix="pass lambda_=0.3")
        if self.alpha < 0 or self.uct_c < 0 or self.widen <= 0:
            raise ConfigError("alpha and uct_c must be >= 0 and widen > 0", fix="pass alpha=0.2, uct_c=1.4, widen=1")
        if self.convergence_rounds is not None and (not isinstance(self.convergence_rounds, int)
                                                    or self.convergence_rounds < 1):
            raise ConfigError(f"convergence_rounds must be an int >= 1 or None, got {self.convergence_rounds!r}",
                              fix="pass convergence_rounds=8, or None to disable")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(f"repeats must be an int >= 1, got {self.repeats!r}", fix="pass repeats=1")
        if self.max_evaluations is not None and (not isinstance(self.max_evaluations, int)
                                                 or self.max_evaluations < 1):
            raise ConfigError(f"max_evaluations must be an int >= 1 or None, got {self.max_evaluations!r}",
                              fix="pass max_evaluations=50, or None for no limit")


@dataclass
class SearchResult:
    """The best workflow found, the edits that lead to it from the initial one, and the whole tree."""

    best: Workflow
    best_score: float  # as measured during the search (its mean)
    best_node: int
    edits: list[Edit]
    tree: SearchTree
    log: list[dict[str, Any]]
    rounds: int
    evaluations: int
    stop_reason: str
    best_interval: tuple[float, float] = (0.0, 0.0)  # 95% interval of the returned workflow's score
    remeasured: dict[str, Any] | None = None  # {"score", "interval", "n"} on fresh examples, if finals ran
    finalists: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        best = self.tree.nodes[self.best_node]
        return {"best_score": self.best_score, "best_interval": list(self.best_interval),
                "remeasured": self.remeasured, "best_cost": dict(best.cost), "best_node": self.best_node,
                "edits": [e.to_dict() for e in self.edits], "edit_descriptions": [e.describe() for e in self.edits],
                "rounds": self.rounds, "evaluations": self.evaluations, "stop_reason": self.stop_reason,
                "finalists": self.finalists,
                "pareto_front": [pareto_point(n) for n in self.tree.pareto_front()]}


class MCTS:
    """Tree search over workflow edits.

    ``evaluate(workflow)`` returns a score in 0..1 (a float, an :class:`Evaluation`, or anything with
    ``.score``); it may raise :class:`~flowopt.errors.BudgetExhausted`, which stops the search cleanly.
    ``should_stop()`` returning a reason (e.g. the budget's ``exhausted()``) also stops it.

    Example:
        >>> from flowopt import Workflow
        >>> from flowopt.modules import Predict
        >>> from flowopt.optimizers.structure import MCTS, RuleProposer, SearchSettings
        >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
        >>> score = lambda w: 0.5 + 0.1 * len(w.nodes)      # a toy evaluator: bigger is better
        >>> result = MCTS(RuleProposer(), score, SearchSettings(max_rounds=5), seed=0).run(wf)
        >>> result.best_score > 0.6
        True
    """

    def __init__(self, proposer: Proposer, evaluate: Evaluator, settings: SearchSettings | None = None, *,
                 seed: int = 0, checkpoint: Checkpointer | None = None, resume: bool = True,
                 should_stop: Callable[[], str | None] | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None,
                 final_evaluate: Evaluator | None = None) -> None:
        self.proposer = proposer
        self.evaluate = evaluate
        self.final_evaluate = final_evaluate or evaluate
        self.settings = settings or SearchSettings()
        self.seed = seed
        self.checkpoint = checkpoint
        self.resume = resume
        self.should_stop = should_stop
        self.on_round = on_round

    # ------------------------------------------------------------------------------ run
    def run(self, program: Workflow) -> SearchResult:
        self._lms = dict(program.lms)
        self._workflows: dict[int, Workflow] = {}
        state = self._restore(program)
        tree: SearchTree = state["tree"]
        reason = ""
        try:
            if not tree.nodes:
                self._start(program, state)
            while True:
                reason = self._stop_reason(state)
                if reason:
                    break
                node = self._select(tree, state["rng"])
                if node is None:
                    reason = "exhausted: every node's edits were tried"
                    break
                self._expand(node, state)
            self._finals(state)
        except BudgetExhausted as err:
            if not tree.nodes:  # not even the initial workflow is scored: nothing to return
                raise
            reason = f"budget exhausted ({err.limit})"
            logger.info("structure search stopped: %s", err)
        best = tree.best()
        edits = [edit_from_dict(n.edit) for n in tree.path(best.id)[1:] if n.edit is not None]
        logger.info("structure search: %s after %d rounds, %d evaluations; best %.4f via %s", reason,
                    state["round"], state["evaluations"], best.score, [e.describe() for e in edits] or "no edit")
        finalists = [{"node": n.id, "measured": n.score, "measured_interval": list(n.interval),
                      "remeasured": n.final["score"], "remeasured_interval": n.final["interval"],
                      "cost": dict(n.cost)} for n in tree.nodes if n.final is not None]
        return SearchResult(self._workflow(best), float(best.score), best.id, edits, tree,  # type: ignore[arg-type]
                            state["log"], state["round"], state["evaluations"], reason,
                            best_interval=best.final["interval"] if best.final else best.interval,
                            remeasured=best.final, finalists=finalists)

    # ------------------------------------------------------------------------------ steps
    def _start(self, program: Workflow, state: dict[str, Any]) -> None:
        ir = program.to_dict()
        root = state["tree"].add(None, None, "initial workflow", ir_key(ir), ir, evaluation=None)
        try:
            failures = self._measure(root, program, state)
        except BaseException:
            state["tree"].discard_last()  # an unscored node never stays in the tree
            raise
        root.evaluation = state["evaluations"]
        state["tree"].backpropagate(root.id, float(root.value))
        state["failures"][root.key] = failures
        state["history"].append(state["tree"].top_k_mean(self.settings.top_k))
        state["log"].append({"round": 0, "event": "root", "child": 0, "score": root.score,
                             "evaluations": state["evaluations"]})
        self._save(state)

    def _select(self, tree: SearchTree, rng: random.Random) -> TreeNode | None:
        s = self.settings
        if s.selection == "uct":
            return select_uct(tree, rng, c=s.uct_c, widen=s.widen)
        if s.selection == "mixed":
            return select_mixed(tree, rng, top_k=s.top_k, alpha=s.alpha, lambda_=s.lambda_)
        return select_best_first(tree, rng, explore=s.explore)

    def _confirm(self, node: TreeNode, state: dict[str, Any]) -> bool:
        """Under noise (per-example scores), measure a node again before expanding it until it has
        ``confirm`` measurements: a leader that was only lucky falls back, a real one stays on top."""
        if node.calls >= self.settings.confirm or node.n <= node.calls:
            return False
        self._measure(node, self._workflow(node), state)
        state["history"].append(state["tree"].top_k_mean(self.settings.top_k))
        state["log"].append({"round": state["round"], "event": "remeasure", "child": node.id, "score": node.score,
                             "evaluations": state["evaluations"]})
        self._save(state)
        return True

    def _expand(self, node: TreeNode, state: dict[str, Any]) -> None:
        tree: SearchTree = state["tree"]
        if self._confirm(node, state):
            return
        context = ProposalContext(score=float(node.score), tried=[dict(t) for t in node.tried],  # type: ignore[arg-type]
                                  failures=state["failures"].get(node.key, []))
        try:
            proposal = self.proposer.propose(self._workflow(node), context, state["rng"])
        except NoProposal as err:
            # Not a round: nothing was paid. Deterministic given the state, so a resumed run marks the same.
            node.exhausted = True
            logger.debug("node %d exhausted: %s", node.id, err)
            return
        edit = proposal.edit
        ir = proposal.workflow.to_dict()  # one serialisation gives the cache key and the tree's copy
        key = ir_key(ir)
        event: dict[str, Any] = {"parent": node.id, "edit": edit.to_dict(),
                                 "description": edit.describe(), "rejected": proposal.rejected}
        existing = tree.by_key(key)
        if existing is not None:
            # Re-proposing a scored workflow costs nothing and uses no round: only the edit is marked tried.
            delta = float(existing.value) - float(node.value)  # type: ignore[arg-type]
            node.tried.append({"edit": edit.to_dict(), "delta": delta, "duplicate_of": existing.id})
            event.update(round=state["round"], event="duplicate", child=existing.id, score=existing.score,
                         delta=delta)
        else:
            state["round"] += 1
            child = tree.add(node.id, edit.to_dict(), edit.describe(), key, ir, round=state["round"])
            try:
                failures = self._measure(child, proposal.workflow, state)
            except BaseException:
                tree.discard_last()  # an unscored node never stays in the tree
                state["round"] -= 1
                raise
            child.evaluation = state["evaluations"]
            self._workflows[child.id] = proposal.workflow
            state["failures"][key] = failures
            tree.backpropagate(child.id, float(child.value))  # type: ignore[arg-type]
            delta = float(child.value) - float(node.value)  # type: ignore[arg-type]
            node.tried.append({"edit": edit.to_dict(), "delta": delta, "child": child.id})
            event.update(round=state["round"], event="expand", child=child.id, score=child.score, delta=delta)
            state["history"].append(tree.top_k_mean(self.settings.top_k))
        event["evaluations"] = state["evaluations"]
        state["log"].append(event)
        logger.info("round %d: %s from node %d -> %s %.4f (%+.4f)", state["round"], edit.describe(), node.id,
                    event["event"], event["score"], event["delta"])
        self._save(state)
        if self.on_round is not None:
            self.on_round(event)

    def _measure(self, node: TreeNode, workflow: Workflow, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Evaluate ``repeats`` times (each an evaluator call, counted), fold the results into the node."""
        failures: list[dict[str, Any]] = []
        costs: list[dict[str, float]] = []
        for _ in range(self.settings.repeats):
            result = _as_evaluation(self.evaluate(workflow))
            state["evaluations"] += 1
            node.record(list(result.scores) if result.scores else [result.score])
            failures = failures or result.failures
            if result.cost:
                costs.append(result.cost)
        if costs:
            node.cost = {k: sum(c.get(k, 0.0) for c in costs) / len(costs) for k in costs[0]}
        node.value = self._objective(float(node.score), node.cost)  # type: ignore[arg-type]
        return failures

    def _objective(self, score: float, cost: Mapping[str, float]) -> float:
        if self.settings.objective == "penalised":
            if "lm_calls" not in cost:
                raise ConfigError("objective='penalised' needs the evaluator to report cost['lm_calls']",
                                  fix="return Evaluation(score, cost={'lm_calls': ...}) or use objective='score'")
            return score - self.settings.cost_weight * cost["lm_calls"]
        return score

    def _finals(self, state: dict[str, Any]) -> None:
        """Re-measure the ``final_top`` leaders with ``final_evaluate`` (fresh examples), by successive
        halving: each survivor gets ``final_repeats`` more measurements, then the better half goes on,
        until one is left. The search's own measurements of its leaders are biased upwards (the leaders
        are partly the lucky ones); the re-measurements are not, so the winner's interval is honest."""
        s = self.settings
        tree: SearchTree = state["tree"]
        if s.final_top == 0 or any(n.final is not None for n in tree.nodes):
            return
        pool = sorted(tree.scored(), key=lambda n: (-float(n.value), n.id))[: s.final_top]  # type: ignore[arg-type]
        stats: dict[int, list[float]] = {n.id: [0.0, 0.0, 0.0] for n in pool}  # n, sum, sum of squares
        costs: dict[int, list[dict[str, float]]] = {n.id: [] for n in pool}
        while pool:
            for node in pool:
                for _ in range(s.final_repeats):
                    result = _as_evaluation(self.final_evaluate(self._workflow(node)))
                    state["evaluations"] += 1
                    values = list(result.scores) if result.scores else [result.score]
                    st = stats[node.id]
                    st[0], st[1], st[2] = st[0] + len(values), st[1] + sum(values), st[2] + sum(v * v for v in values)
                    if result.cost:
                        costs[node.id].append(result.cost)
                self._set_final(node, stats[node.id], costs[node.id])
            if len(pool) == 1:
                break
            pool = sorted(pool, key=lambda n: (-n.final["value"], n.id))[: (len(pool) + 1) // 2]  # type: ignore[index]
        for node in tree.nodes:
            if node.final is not None:
                state["log"].append({"round": state["round"], "event": "final", "child": node.id,
                                     "score": node.final["score"], "measured": node.score,
                                     "evaluations": state["evaluations"]})
                logger.info("finalist %d: measured %.4f, re-measured %.4f on %d", node.id, node.score,
                            node.final["score"], node.final["n"])
        self._save(state)

    def _set_final(self, node: TreeNode, st: list[float], costs: list[dict[str, float]]) -> None:
        score = st[1] / st[0]
        half = interval_half_width(int(st[0]), st[1], st[2])
        cost = {k: sum(c.get(k, 0.0) for c in costs) / len(costs) for k in costs[0]} if costs else node.cost
        node.final = {"score": score, "interval": [score - half, score + half], "n": int(st[0]),
                      "value": self._objective(score, cost)}

    def final_evaluations(self) -> int:
        """Evaluator calls the finals take (successive halving of ``final_top``)."""
        s, total, pool = self.settings, 0, self.settings.final_top
        while pool:
            total += pool * s.final_repeats
            pool = 0 if pool == 1 else (pool + 1) // 2
        return total

    def _stop_reason(self, state: dict[str, Any]) -> str:
        s = self.settings
        if state["round"] >= s.max_rounds:
            return f"max_rounds ({s.max_rounds})"
        # Finals are paid from the same evaluation budget: keep room for them.
        reserve = self.final_evaluations()
        if s.max_evaluations is not None and state["evaluations"] + s.repeats + reserve > s.max_evaluations:
            return f"max_evaluations ({s.max_evaluations})"
        history = state["history"]
        r = s.convergence_rounds
        if r is not None and len(history) > r and max(history[-r - 1:]) - min(history[-r - 1:]) <= s.convergence_eps:
            return f"converged: top-{s.top_k} mean unchanged for {r} rounds"
        if self.should_stop is not None:
            reason = self.should_stop()
            if reason:
                return f"budget exhausted ({reason})"
        return ""

    def _workflow(self, node: TreeNode) -> Workflow:
        if node.id not in self._workflows:
            wf = Workflow.from_dict(node.workflow)
            wf.lms.update({k: v for k, v in self._lms.items() if k in wf.lms})
            self._workflows[node.id] = wf
        return self._workflows[node.id]

    # ------------------------------------------------------------------------------ state
    def _fresh_state(self) -> dict[str, Any]:
        return {"tree": SearchTree(), "rng": random.Random(self.seed), "round": 0, "evaluations": 0,
                "history": [], "log": [], "failures": {}}

    def _restore(self, program: Workflow) -> dict[str, Any]:
        state = self._fresh_state()
        data = self.checkpoint.load() if (self.checkpoint is not None and self.resume) else None
        if not data:
            return state
        if data.get("version") != CHECKPOINT_VERSION or data.get("seed") != self.seed:
            logger.warning("structure search checkpoint is from another version or seed; starting over")
            return state
        tree = SearchTree.from_dict(data["tree"])
        if tree.nodes and tree.nodes[0].key != workflow_key(program.canonical_json()):
            logger.warning("structure search checkpoint starts from another workflow; starting over")
            return state
        if data.get("settings") != asdict(self.settings):
            logger.warning("structure search settings changed since the checkpoint; continuing with the new ones")
        rng = random.Random()
        version, internal, gauss = data["rng"]
        rng.setstate((version, tuple(internal), gauss))
        logger.info("structure search resumed at round %d (%d evaluations, %d nodes)", data["round"],
                    data["evaluations"], len(tree.nodes))
        return {"tree": tree, "rng": rng, "round": data["round"], "evaluations": data["evaluations"],
                "history": list(data["history"]), "log": list(data["log"]), "failures": dict(data["failures"])}

    def _save(self, state: dict[str, Any]) -> None:
        if self.checkpoint is None:
            return
        self.checkpoint.save(state_to_dict(state, self.seed, self.settings))


def state_to_dict(state: Mapping[str, Any], seed: int, settings: SearchSettings) -> dict[str, Any]:
    return {"version": CHECKPOINT_VERSION, "seed": seed, "settings": asdict(settings),
            "round": state["round"], "evaluations": state["evaluations"], "history": list(state["history"]),
            "log": list(state["log"]), "failures": dict(state["failures"]), "rng": list(state["rng"].getstate()),
            "tree": state["tree"].to_dict()}


def replay(program: Workflow, edits: Sequence[Edit | Mapping[str, Any]]) -> Workflow:
    """Apply a sequence of edits (objects or their dicts, e.g. from a search log) to ``program``.

    Example:
        >>> from flowopt import Workflow
        >>> from flowopt.modules import Predict
        >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
        >>> replay(wf, [{"kind": "wrap_ensemble", "node": "solve", "n": 3}]).nodes["solve"].op_name
        'ScEnsemble'
    """
    current = program
    for edit in edits:
        current = (edit if isinstance(edit, Edit) else edit_from_dict(edit)).apply(current)
    return current


def replay_log(program: Workflow, log: Sequence[Mapping[str, Any]]) -> dict[int, Workflow]:
    """Rebuild every tree node's workflow from a search log (node id -> workflow), checking each edit."""
    workflows = {0: program}
    for event in log:
        if event.get("event") == "expand":
            workflows[event["child"]] = replay(workflows[event["parent"]], [event["edit"]])
    return workflows


def pareto_point(node: TreeNode) -> dict[str, Any]:
    """One point of the score/cost front, for reports: the node, its score, interval and cost."""
    return {"node": node.id, "score": node.score, "interval": list(node.interval), **node.cost,
            "description": node.description}


def _as_evaluation(value: Any) -> Evaluation:
    if isinstance(value, Evaluation):
        return value
    if isinstance(value, int | float):
        return Evaluation(float(value))
    score = getattr(value, "score", None)
    if isinstance(score, int | float):
        scores = getattr(value, "scores", None)
        return Evaluation(float(score), list(getattr(value, "failures", []) or []),
                          [float(x) for x in scores] if scores else None, dict(getattr(value, "cost", {}) or {}))
    raise ConfigError(f"the evaluator returned {value!r}, not a score",
                      fix="return a float in 0..1, an Evaluation, or an object with .score")
