"""Tree search over typed workflow edits.

Each round selects a tree node, asks the proposer for one untried edit, and evaluates the edited
workflow, unless a workflow with the same canonical JSON was already scored (then the edit is recorded
as a duplicate: nothing is paid and no round is used). Selection is ``auto`` by default: ``climb``,
or ``best_first`` when ``confirm`` > 1 (under noise a first-improvement move follows one lucky
measurement; on the noisy benchmark family best-first returned the optimum in 83 of 100 seeds, the
climb in 72). ``climb`` is an iterated local search: the node being climbed is expanded until one of
its edits beats it, and the climb moves there at once (first improvement: greedy on additive
landscapes, one evaluation per step when most edits help). When the climbed node's edits are used up
(a local optimum), the search restarts from a random open node among those nearest, in edits, to the
best one, and climbs from there: a kick and a climb make a pair of edits, which crosses a deceptive
valley where two edits help only together, and a duplicate edit back to a scored workflow costs
nothing. A re-measurement (``confirm``) that does not bear out a move under noise undoes it.
``best_first`` (the highest upper 95% bound, the previous
default), AFlow's ``mixed`` selection and ``uct`` remain.

Every node keeps its measurements (per-example scores when the evaluator gives them), hence a 95%
interval; ``repeats`` measures each candidate several times. The ``final_top`` leaders race at the end on
``final_evaluate`` (fresh examples) for the rest of the budget, ranked by all their measurements, and the
winner is returned with its search score and its fresh re-measurement (score and 95% interval).
``objective="penalised"`` ranks by score minus ``cost_weight`` x LM calls per example (the evaluator
reports cost); every node keeps its cost, so the report can show the score/cost Pareto front.
``objective="pareto"`` climbs by score but restarts from a random point of the score/LM-calls front
(so cheap good workflows get their neighbourhoods searched too), and the caller picks a point of the
front afterwards with :meth:`SearchResult.pick` (e.g. the best workflow under 3 LM calls per example).

The search stops on ``max_rounds`` (new candidates scored), ``max_evaluations`` (evaluator calls,
repeats and finals included), convergence, an exhausted tree, or the budget. After every round the whole
state is checkpointed, so a search killed at any point and resumed with the same seed ends exactly as an
uninterrupted one.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from flowopt.errors import BudgetExhausted, ConfigError
from flowopt.optimizers.structure.checkpoint import CHECKPOINT_VERSION, Checkpointer, state_to_dict
from flowopt.optimizers.structure.edits import edit_from_dict
from flowopt.optimizers.structure.proposers import NoProposal, ProposalContext, Proposer
from flowopt.optimizers.structure.result import Evaluator, SearchResult, as_evaluation
from flowopt.optimizers.structure.search_settings import SearchSettings
from flowopt.optimizers.structure.selection import select_best_first, select_climb, select_mixed, select_uct
from flowopt.optimizers.structure.tree import SearchTree, TreeNode, interval_half_width, ir_key, workflow_key
from flowopt.workflow import Workflow

logger = logging.getLogger(__name__)


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
                node = self._select(tree, state)
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

    def _select(self, tree: SearchTree, state: dict[str, Any]) -> TreeNode | None:
        s, rng = self.settings, state["rng"]
        selection = s.resolved_selection()
        if selection == "climb":
            # Under "pareto" a restart starts near a random point of the front, not only near the best.
            anchors = tree.pareto_front() if s.objective == "pareto" else None
            return select_climb(tree, rng, state["climb"], explore=s.explore, anchors=anchors)
        if selection == "uct":
            return select_uct(tree, rng, c=s.uct_c, widen=s.widen)
        if selection == "mixed":
            return select_mixed(tree, rng, top_k=s.top_k, alpha=s.alpha, lambda_=s.lambda_)
        return select_best_first(tree, rng, explore=s.explore)

    def _confirm(self, node: TreeNode, state: dict[str, Any]) -> bool:
        """Under noise (per-example scores), measure a node again before expanding it until it has
        ``confirm`` measurements: a leader that was only lucky falls back, a real one stays on top."""
        if node.calls >= self.settings.confirm or node.n <= node.calls:
            return False
        self._measure(node, self._workflow(node), state)
        climb = state["climb"]
        # A move the re-measurement does not bear out (the node is no better than the one it was
        # reached from) is undone: the climb goes on from where it was.
        while len(climb) > 1 and climb[-1] == node.id and node.value <= state["tree"].nodes[climb[-2]].value:
            climb.pop()
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
            self._climb_to(node, existing, state)
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
            self._climb_to(node, child, state)
            event.update(round=state["round"], event="expand", child=child.id, score=child.score, delta=delta)
            state["history"].append(tree.top_k_mean(self.settings.top_k))
        event["evaluations"] = state["evaluations"]
        state["log"].append(event)
        logger.info("round %d: %s from node %d -> %s %.4f (%+.4f)", state["round"], edit.describe(), node.id,
                    event["event"], event["score"], event["delta"])
        self._save(state)
        if self.on_round is not None:
            self.on_round(event)

    def _climb_to(self, node: TreeNode, reached: TreeNode, state: dict[str, Any]) -> None:
        """First improvement: an edit of the climbed node that beats it moves the climb there."""
        climb = state["climb"]
        if climb and climb[-1] == node.id and float(reached.value) > float(node.value) + 1e-12:  # type: ignore[arg-type]
            climb.append(reached.id)

    def _measure(self, node: TreeNode, workflow: Workflow, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Evaluate ``repeats`` times (each an evaluator call, counted), fold the results into the node."""
        failures: list[dict[str, Any]] = []
        costs: list[dict[str, float]] = []
        for _ in range(self.settings.repeats):
            result = as_evaluation(self.evaluate(workflow))
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
        objective = self.settings.objective
        if objective != "score" and "lm_calls" not in cost:
            raise ConfigError(f"objective={objective!r} needs the evaluator to report cost['lm_calls']",
                              fix="return Evaluation(score, cost={'lm_calls': ...}) or use objective='score'")
        if objective == "penalised":
            return score - self.settings.cost_weight * cost["lm_calls"]
        return score

    def _finals(self, state: dict[str, Any]) -> None:
        """Race the ``final_top`` leaders on fresh examples (``final_evaluate``): each is measured
        ``final_repeats`` times, then, one evaluator call at a time, the leader and its strongest
        challenger (the highest upper 95% bound among the others) are measured again, LUCB style, until
        the leader's lower bound clears every challenger's upper bound or the finals' budget is spent:
        whatever ``max_evaluations`` leaves after the search, and at least :meth:`final_evaluations`.

        The ranking pools every measurement of a finalist, the search's and the fresh ones: ranking by
        the fresh ones alone threw half the evidence away, and an optimum with one unlucky fresh draw
        fell out (11 of the 17 misses on seeds 20-119 of the noisy benchmark family). The reported score
        and interval are the fresh measurements' alone: the search's measurements of its leaders are
        biased upwards (the leaders are partly the lucky ones), the fresh ones are not."""
        s = self.settings
        tree: SearchTree = state["tree"]
        if s.final_top == 0 or any(n.final is not None for n in tree.nodes):
            return
        pool = sorted(tree.scored(), key=lambda n: (-float(n.value), n.id))[: s.final_top]  # type: ignore[arg-type]
        fresh: dict[int, list[float]] = {n.id: [0.0, 0.0, 0.0] for n in pool}  # n, sum, sum of squares
        costs: dict[int, list[dict[str, float]]] = {n.id: [] for n in pool}
        budget = self.final_evaluations()
        if s.max_evaluations is not None:
            budget = max(budget, s.max_evaluations - state["evaluations"])

        def measure(node: TreeNode, times: int) -> None:
            nonlocal budget
            for _ in range(times):
                result = as_evaluation(self.final_evaluate(self._workflow(node)))
                state["evaluations"] += 1
                budget -= 1
                values = list(result.scores) if result.scores else [result.score]
                st = fresh[node.id]
                st[0], st[1], st[2] = st[0] + len(values), st[1] + sum(values), st[2] + sum(v * v for v in values)
                if result.cost:
                    costs[node.id].append(result.cost)
            self._set_final(node, fresh[node.id], costs[node.id])

        for node in pool:
            measure(node, s.final_repeats)
        while len(pool) > 1 and budget >= 2:
            leader, *others = sorted(pool, key=lambda n: (-n.final["value"], n.id))  # type: ignore[index]
            challenger = max(others, key=lambda n: (_upper(n), -n.id))
            if _lower(leader) > _upper(challenger) or (_upper(leader) == _lower(leader)
                                                       and _upper(challenger) == _lower(challenger)):
                break  # settled, or measurements that never vary: more of them cannot change the order
            measure(leader, 1)
            measure(challenger, 1)
        for node in tree.nodes:
            if node.final is not None:
                state["log"].append({"round": state["round"], "event": "final", "child": node.id,
                                     "score": node.final["score"], "measured": node.score,
                                     "evaluations": state["evaluations"]})
                logger.info("finalist %d: measured %.4f, re-measured %.4f on %d", node.id, node.score,
                            node.final["score"], node.final["n"])
        self._save(state)

    def _set_final(self, node: TreeNode, st: list[float], costs: list[dict[str, float]]) -> None:
        """The fresh measurements give the reported score and interval; all of them, the search's too,
        the value the finalists are ranked by."""
        score = st[1] / st[0]
        half = interval_half_width(int(st[0]), st[1], st[2])
        cost = {k: sum(c.get(k, 0.0) for c in costs) / len(costs) for k in costs[0]} if costs else node.cost
        n, total, total_sq = st[0] + node.n, st[1] + node.total, st[2] + node.total_sq
        pooled = total / n
        node.final = {"score": score, "interval": [score - half, score + half], "n": int(st[0]),
                      "pooled": pooled, "pooled_half": interval_half_width(int(n), total, total_sq),
                      "value": self._objective(pooled, cost)}

    def final_evaluations(self) -> int:
        """Evaluator calls kept for the finals: as many as successive halving of ``final_top`` would
        take (``final_repeats`` each, then the better half again, until one is left)."""
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
                "history": [], "log": [], "failures": {}, "climb": [0]}

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
                "history": list(data["history"]), "log": list(data["log"]), "failures": dict(data["failures"]),
                "climb": list(data["climb"])}

    def _save(self, state: dict[str, Any]) -> None:
        if self.checkpoint is None:
            return
        self.checkpoint.save(state_to_dict(state, self.seed, self.settings))


def _upper(node: TreeNode) -> float:
    """A finalist's objective plus half its 95% interval over all its measurements."""
    return float(node.final["value"] + node.final["pooled_half"])  # type: ignore[index]


def _lower(node: TreeNode) -> float:
    return float(node.final["value"] - node.final["pooled_half"])  # type: ignore[index]
