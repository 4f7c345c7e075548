"""Monte Carlo tree search over typed workflow edits.

Each round selects a tree node (AFlow's mixed probability over the top-k, or UCT), asks the proposer
for one edit, and evaluates the edited workflow, unless a workflow with the same canonical JSON was
already scored (then the edit is recorded as a duplicate and nothing is paid). The search stops on
``max_rounds``, ``max_evaluations``, convergence (the top-k mean unchanged for R rounds), an exhausted
tree, or the budget. After every round the whole state (tree, RNG, log) is checkpointed, so a search
killed at any point and resumed with the same seed ends exactly as an uninterrupted one.
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
from flowopt.optimizers.structure.selection import select_mixed, select_uct
from flowopt.optimizers.structure.tree import SearchTree, TreeNode, ir_key, workflow_key
from flowopt.workflow import Workflow

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1


@dataclass
class Evaluation:
    """A workflow's score on the search split, and a few examples it failed (shown to LM proposers)."""

    score: float
    failures: list[dict[str, Any]] = field(default_factory=list)


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
    selection: str = "mixed"
    top_k: int = 4
    alpha: float = 0.2
    lambda_: float = 0.3
    uct_c: float = 1.4
    widen: float = 1.0
    convergence_rounds: int | None = 8
    convergence_eps: float = 1e-4
    repeats: int = 1
    max_evaluations: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ConfigError(f"max_rounds must be an int >= 1, got {self.max_rounds!r}", fix="pass max_rounds=20")
        if self.selection not in ("mixed", "uct"):
            raise ConfigError(f"selection must be 'mixed' or 'uct', got {self.selection!r}",
                              fix='pass selection="mixed" (AFlow) or selection="uct"')
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
    best_score: float
    best_node: int
    edits: list[Edit]
    tree: SearchTree
    log: list[dict[str, Any]]
    rounds: int
    evaluations: int
    stop_reason: str

    def summary(self) -> dict[str, Any]:
        return {"best_score": self.best_score, "best_node": self.best_node,
                "edits": [e.to_dict() for e in self.edits], "edit_descriptions": [e.describe() for e in self.edits],
                "rounds": self.rounds, "evaluations": self.evaluations, "stop_reason": self.stop_reason}


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
                 on_round: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.proposer = proposer
        self.evaluate = evaluate
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
        except BudgetExhausted as err:
            if not tree.nodes:  # not even the initial workflow is scored: nothing to return
                raise
            reason = f"budget exhausted ({err.limit})"
            logger.info("structure search stopped: %s", err)
        best = tree.best()
        edits = [edit_from_dict(n.edit) for n in tree.path(best.id)[1:] if n.edit is not None]
        logger.info("structure search: %s after %d rounds, %d evaluations; best %.4f via %s", reason,
                    state["round"], state["evaluations"], best.score, [e.describe() for e in edits] or "no edit")
        return SearchResult(self._workflow(best), float(best.score), best.id, edits, tree,  # type: ignore[arg-type]
                            state["log"], state["round"], state["evaluations"], reason)

    # ------------------------------------------------------------------------------ steps
    def _start(self, program: Workflow, state: dict[str, Any]) -> None:
        evaluation = self._score(program, state)
        ir = program.to_dict()
        root = state["tree"].add(None, None, "initial workflow", ir_key(ir), ir, score=evaluation.score,
                                 evaluation=state["evaluations"])
        state["tree"].backpropagate(root.id, evaluation.score)
        state["failures"][root.key] = evaluation.failures
        state["history"].append(state["tree"].top_k_mean(self.settings.top_k))
        state["log"].append({"round": 0, "event": "root", "child": 0, "score": evaluation.score,
                             "evaluations": state["evaluations"]})
        self._save(state)

    def _select(self, tree: SearchTree, rng: random.Random) -> TreeNode | None:
        s = self.settings
        if s.selection == "uct":
            return select_uct(tree, rng, c=s.uct_c, widen=s.widen)
        return select_mixed(tree, rng, top_k=s.top_k, alpha=s.alpha, lambda_=s.lambda_)

    def _expand(self, node: TreeNode, state: dict[str, Any]) -> None:
        tree: SearchTree = state["tree"]
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
        event: dict[str, Any] = {"round": state["round"] + 1, "parent": node.id, "edit": edit.to_dict(),
                                 "description": edit.describe(), "rejected": proposal.rejected}
        existing = tree.by_key(key)
        if existing is not None:
            delta = float(existing.score) - float(node.score)  # type: ignore[arg-type]
            node.tried.append({"edit": edit.to_dict(), "delta": delta, "duplicate_of": existing.id})
            event.update(event="duplicate", child=existing.id, score=existing.score, delta=delta)
        else:
            evaluation = self._score(proposal.workflow, state)
            child = tree.add(node.id, edit.to_dict(), edit.describe(), key, ir,
                             score=evaluation.score, round=state["round"] + 1, evaluation=state["evaluations"])
            self._workflows[child.id] = proposal.workflow
            state["failures"][key] = evaluation.failures
            tree.backpropagate(child.id, evaluation.score)
            delta = evaluation.score - float(node.score)  # type: ignore[arg-type]
            node.tried.append({"edit": edit.to_dict(), "delta": delta, "child": child.id})
            event.update(event="expand", child=child.id, score=evaluation.score, delta=delta)
        state["round"] += 1
        event["evaluations"] = state["evaluations"]
        state["history"].append(tree.top_k_mean(self.settings.top_k))
        state["log"].append(event)
        logger.info("round %d: %s from node %d -> %s %.4f (%+.4f)", state["round"], edit.describe(), node.id,
                    event["event"], event["score"], event["delta"])
        self._save(state)
        if self.on_round is not None:
            self.on_round(event)

    def _score(self, workflow: Workflow, state: dict[str, Any]) -> Evaluation:
        results = [_as_evaluation(self.evaluate(workflow)) for _ in range(self.settings.repeats)]
        state["evaluations"] += 1
        score = sum(r.score for r in results) / len(results)
        return Evaluation(score, results[0].failures)

    def _stop_reason(self, state: dict[str, Any]) -> str:
        s = self.settings
        if state["round"] >= s.max_rounds:
            return f"max_rounds ({s.max_rounds})"
        if s.max_evaluations is not None and state["evaluations"] >= s.max_evaluations:
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


def _as_evaluation(value: Any) -> Evaluation:
    if isinstance(value, Evaluation):
        return value
    if isinstance(value, int | float):
        return Evaluation(float(value))
    score = getattr(value, "score", None)
    if isinstance(score, int | float):
        return Evaluation(float(score), list(getattr(value, "failures", []) or []))
    raise ConfigError(f"the evaluator returned {value!r}, not a score",
                      fix="return a float in 0..1, an Evaluation, or an object with .score")
