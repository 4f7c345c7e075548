"""Landscapes for the structure search benchmark: workflows scored by known rules, so the optimum is known.

Each family is a start workflow, an edit vocabulary, and a true score of a workflow's IR. The needle and
cost families use the simulated math task of ``structure_search_sim.py`` (exact expected accuracy of a
fake LM); the others are pipelines whose nodes each have a best operator:

- ``additive`` (large): a 6-node chain ``s1..s6``; each node adds a fixed gain when it has its target
  operator (ChainOfThought, or ScEnsemble of a given n), less for a near miss, and every node beyond the
  six costs 0.03. Gains add up, so the optimum is every target at once: 5 edits from the start.
- ``deceptive``: a 3-node chain; s1 and s2 gain 0.06 each with ChainOfThought (a local optimum of 0.56),
  while s3 loses 0.04 with an ensemble alone and 0.04 with a Programmer branch alone, but gains 0.20
  with both (0.76): two edits that help only together.
- ``noisy``: a 3-node chain with gains of 0.10 per node (optimum 0.70, runner-up 0.63), each
  measurement a binomial draw on 30 examples (standard error about 0.08).

Example:
    >>> family = FAMILIES["deceptive"]()
    >>> round(family.true_score(family.start().to_dict()), 2)
    0.44
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flowopt import Workflow
from flowopt.modules import Predict
from flowopt.optimizers.structure import Vocabulary
from flowopt.optimizers.structure.edits import SELECT_INSTRUCTION

IR = dict[str, Any]
KINDS = ("swap_operator", "wrap_ensemble", "add_refine", "add_programmer", "remove_node", "set_config")


@dataclass
class Family:
    """A landscape: start workflow, vocabulary, true score (and LM calls) of a workflow's IR."""

    name: str
    start: Callable[[], Workflow]
    vocabulary: Vocabulary
    true_score: Callable[[IR], float]
    max_evals: int
    description: str
    lm_calls: Callable[[IR], float] | None = None
    cost_weight: float = 0.0  # objective = score - cost_weight * LM calls per example
    noise_examples: int | None = None  # a measurement is a binomial draw on this many examples
    optimum: float | None = None  # known by construction (else found by enumerating the space)

    def objective(self, ir: IR) -> float:
        score = self.true_score(ir)
        if self.cost_weight and self.lm_calls is not None:
            score -= self.cost_weight * self.lm_calls(ir)
        return score


def chain(n: int) -> Workflow:
    """question -> answer through n Predict nodes s1..sn, each reading the question and the previous step."""
    wf = Workflow("question -> answer", name=f"chain{n}")
    for i in range(1, n + 1):
        inputs = "question" if i == 1 else f"question, a{i - 1}"
        out = "answer" if i == n else f"a{i}"
        wf.add(f"s{i}", Predict(f"{inputs} -> {out}"))
    return wf


def _op(ir: IR, node_id: str) -> tuple[str, int]:
    node = next(n for n in ir["nodes"] if n["id"] == node_id)
    return node["op"], int(node["config"].get("n", 0))


def _has_programmer_branch(ir: IR, node_id: str) -> bool:
    """A selector (AddProgrammer's Custom node) reads this node's answer as its candidate."""
    selectors = {n["id"] for n in ir["nodes"] if n["op"] == "Custom"
                 and n["signature"].get("instructions") == SELECT_INSTRUCTION}
    return any(e["src"] == node_id and e["dst"] in selectors for e in ir["edges"])


def gain(op: tuple[str, int], target: tuple[str, int], weight: float, near: float) -> float:
    """``weight`` for the target operator, ``near * weight`` for another non-Predict choice; a node whose
    target is Predict scores 0 as Predict and loses ``near * weight`` as anything else."""
    if op == target:
        return 0.0 if target[0] == "Predict" else weight
    if target[0] == "Predict":
        return -near * weight if op[0] != "Predict" else 0.0
    if op[0] == "Predict":
        return 0.0
    return near * weight


def additive(targets: dict[str, tuple[str, int]], weights: dict[str, float], base: float, near: float,
             extra_penalty: float) -> Callable[[IR], float]:
    def score(ir: IR) -> float:
        extra = len(ir["nodes"]) - len(targets)
        return base + sum(gain(_op(ir, i), t, weights[i], near) for i, t in targets.items()) - extra_penalty * extra

    return score


def large() -> Family:
    targets = {"s1": ("ChainOfThought", 0), "s2": ("ScEnsemble", 5), "s3": ("ChainOfThought", 0),
               "s4": ("ScEnsemble", 3), "s5": ("ChainOfThought", 0), "s6": ("Predict", 0)}
    weights = {"s1": 0.06, "s2": 0.08, "s3": 0.05, "s4": 0.07, "s5": 0.04, "s6": 0.05}
    return Family("additive", lambda: chain(6), Vocabulary(kinds=KINDS, ensemble_sizes=(3, 5), refine_rounds=(1, 2),
                                                           max_nodes=8),
                  additive(targets, weights, 0.40, 0.5, 0.03), max_evals=400, optimum=0.70,
                  description="6-node chain, additive gains per node, optimum 5 edits deep (0.70)")


def deceptive() -> Family:
    targets = {"s1": ("ChainOfThought", 0), "s2": ("ChainOfThought", 0)}
    weights = {"s1": 0.06, "s2": 0.06}
    part = additive(targets, weights, 0.44, 0.0, 0.0)

    def score(ir: IR) -> float:
        ensemble = _op(ir, "s3")[0] == "ScEnsemble"
        branch = _has_programmer_branch(ir, "s3")
        trap = 0.20 if ensemble and branch else -0.04 * (ensemble + branch)
        extra = len(ir["nodes"]) - 3 - (2 if branch else 0)
        return part(ir) + trap - 0.03 * extra

    return Family("deceptive", lambda: chain(3), Vocabulary(kinds=KINDS, ensemble_sizes=(3, 5), refine_rounds=(1, 2),
                                                            max_nodes=6),
                  score, max_evals=400, optimum=0.76,
                  description="3-node chain: local optimum 0.56; s3 ensemble and s3 Programmer branch each -0.04 "
                              "alone, +0.20 together (0.76)")


def noisy() -> Family:
    targets = {"s1": ("ChainOfThought", 0), "s2": ("ScEnsemble", 5), "s3": ("ChainOfThought", 0)}
    weights = {"s1": 0.10, "s2": 0.10, "s3": 0.10}
    return Family("noisy", lambda: chain(3), Vocabulary(kinds=KINDS, ensemble_sizes=(3, 5), refine_rounds=(1, 2),
                                                        max_nodes=5),
                  additive(targets, weights, 0.40, 0.3, 0.07), max_evals=200, noise_examples=30, optimum=0.70,
                  description="3-node chain, gains 0.10 per node (optimum 0.70, runner-up 0.63), each "
                              "measurement on 30 examples")


FAMILIES: dict[str, Callable[[], Family]] = {"additive": large, "deceptive": deceptive, "noisy": noisy}
