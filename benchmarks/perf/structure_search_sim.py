"""Structure search on a simulated math task whose best structure is known: MCTS vs random edits vs hill climbing.

The task: half the questions are bare ``arith`` computations, half are ``word`` problems. A fake LM
(a scripted DSPy engine) answers each kind of call correctly with a known probability:

================================  =====  =====
call                              arith  word
================================  =====  =====
Predict                           0.30   0.45
ChainOfThought (and one sample    0.55   0.65
of ScEnsemble, at temperature)
Programmer (code, then sandbox)   0.95   0.35
================================  =====  =====

- ``ScEnsemble(n)``: n independent chain-of-thought samples, majority vote (wrong answers agree, so a
  vote is correct/wrong only): more samples help, with diminishing returns.
- Programmer branch + selector: the selector takes the program's answer for arithmetic and the
  reasoning answer for word problems, but slips (takes the other one) with probability 0.03. Two
  Programmer nodes write the same program (same prompt), so a second branch adds only another slip.
- ``Refine(max_rounds=r)``: per round a reviewer flags a wrong attempt with probability 0.7 and a
  correct one with probability 0.08 (a false alarm); the loop stops when the reviewer accepts. A
  revision fixes a flagged wrong answer with probability 0.6 if the question is *fixable* (half of
  them, fixed per question: the other half are beyond the model) and breaks a flagged correct answer
  with probability 0.5. So refining helps weak answers and hurts strong ones; extra rounds have
  diminishing returns (in this space 4 rounds still beat 3, by 0.0008), and a second Refine costs more
  in false alarms than it fixes.

The score of a workflow is its **expected accuracy** under these rules, computed exactly from its
graph (:func:`expected_accuracy`): deterministic per structure, with no 1/N ties between structures.
The same rules drive the fake LM, and the script checks that running a few workflows through DSPy,
the operators and the Programmer sandbox on ``--validate-examples`` questions gives the same accuracy
within sampling error (the "validation" table). The search space (every workflow reachable from
``Predict`` with the vocabulary below and at most ``MAX_NODES`` nodes) is enumerated completely with
the edits' own IR transforms (each new state validated once by ``Workflow.from_dict``), which gives the
optimum and shows that exactly one workflow reaches it.

Families (``--families``; the others are defined in ``structure_families.py``): ``needle`` (this task,
optimum found by enumerating the space), ``needle_deep`` (the same task from a draft reviewed twice,
5 edits from the nearest optimum), ``cost`` (this task ranked by accuracy minus 0.01 x LM calls
per question, ``objective="penalised"``), ``additive`` (a 6-node chain, optimum 5 edits deep),
``deceptive`` (two edits that help only together) and ``noisy`` (each measurement on 30 examples; the
search re-measures its leaders). For every family and seed, the search (``MCTS`` with the stage's
defaults), a random walk and hill climbing with restarts run side by side from the same start, with
the same proposer and evaluation function. An evaluation is an evaluator call.

Run: python -m flowopt.benchmarks.perf.structure_search_sim [--seeds 20] [--families ...] [--methods ...]
[--method-budget random_walk=200] [--out STEM] [--smoke]; ``--merge a.json b.json --out STEM`` combines runs made
in separate processes (e.g. one per family). Writes benchmarks/results/structure_search_sim.{json,md}.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("DSPY_CACHEDIR", tempfile.mkdtemp(prefix="flowopt-sim-dspy-"))

import dspy

from flowopt import Workflow
from flowopt.benchmarks.perf.harness import SCHEMA, Goal, PerfParser, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.structure_families import FAMILIES, Family
from flowopt.modules import Predict
from flowopt.optimizers.structure import MCTS, Evaluation, InvalidEdit, RuleProposer, SearchSettings, Vocabulary
from flowopt.optimizers.structure.baselines import hill_climb, random_walk
from flowopt.optimizers.structure.edits import SELECT_INSTRUCTION, AddProgrammer, AddRefine, RemoveNode
from flowopt.optimizers.structure.search_settings import SELECTIONS
from flowopt.optimizers.structure.tree import ir_key
from flowopt.testing import ScriptedEngine, ScriptedRequest

logger = logging.getLogger("structure_search_sim")

KINDS = ("arith", "word")
P_ANSWER = {"Predict": {"arith": 0.30, "word": 0.45}, "ChainOfThought": {"arith": 0.55, "word": 0.65}}
P_CODE = {"arith": 0.95, "word": 0.35}
P_SELECT_SLIP = 0.03
P_CATCH, P_FIX, P_FALSE_ALARM, P_BREAK, P_FIXABLE = 0.7, 0.6, 0.08, 0.5, 0.5
MAX_NODES = 5
VOCABULARY = Vocabulary(kinds=("swap_operator", "wrap_ensemble", "add_refine", "add_programmer", "remove_node",
                               "set_config"), ensemble_sizes=(3, 5, 7, 9), refine_rounds=(1, 2, 3, 4),
                        max_nodes=MAX_NODES)
METHODS = ("search", "random_walk", "hill_climb")


# ------------------------------------------------------------------------------------ the model
def majority(n: int, p: float) -> float:
    """P(a majority vote of n independent binary samples, each right with p, is right); ties: 1/2."""
    return sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) * (1.0 if 2 * k > n else 0.5 if 2 * k == n else 0.0)
               for k in range(n + 1))


def refine(p: float, rounds: int, fixable: bool) -> float:
    """P(correct) after Refine(max_rounds=rounds) on an answer that is correct with probability p."""
    fix = P_FIX if fixable else 0.0
    right, wrong, done = p, 1.0 - p, 0.0
    for _ in range(rounds):
        done += right * (1 - P_FALSE_ALARM)  # accepted as correct: stop
        right, wrong = (right * P_FALSE_ALARM * (1 - P_BREAK) + wrong * P_CATCH * fix,
                        right * P_FALSE_ALARM * P_BREAK + wrong * P_CATCH * (1 - fix))
    return done + right


def expected_accuracy(ir: dict[str, Any]) -> float:
    """Exact expected accuracy of a workflow (IR data) under the fake LM's rules, over both kinds.

    Every node's answer depends on one upstream answer plus fresh coins, except for two facts fixed
    per question: whether the program (the same for every Programmer node) is right, and whether the
    question is fixable by revision. Conditioning on both makes everything else independent.
    """
    nodes = {n["id"]: n for n in ir["nodes"]}
    sources = {(e["dst"], d): e["src"] for e in ir["edges"] for d in e["map"].values()}

    def p(node_id: str, kind: str, code_ok: bool, fixable: bool) -> float:
        node = nodes[node_id]
        op, config = node["op"], node["config"]
        if op in P_ANSWER:
            return P_ANSWER[op][kind]
        if op == "ScEnsemble":
            return majority(config["n"], P_ANSWER["ChainOfThought"][kind])
        if op == "Programmer":
            return 1.0 if code_ok else 0.0
        if op == "Refine":
            return refine(p(sources[(node_id, "draft_answer")], kind, code_ok, fixable), config["max_rounds"], fixable)
        if op == "Custom" and node["signature"]["instructions"] == SELECT_INSTRUCTION:
            cand = p(sources[(node_id, "candidate_answer")], kind, code_ok, fixable)
            prog = p(sources[(node_id, "program_answer")], kind, code_ok, fixable)
            first, second = (prog, cand) if kind == "arith" else (cand, prog)
            return (1 - P_SELECT_SLIP) * first + P_SELECT_SLIP * second
        raise ValueError(f"the model has no rule for node {node_id} ({op})")

    out = sources[("$output", "answer")]
    return sum(0.5 * pc * pf * p(out, k, code_ok, fixable)
               for k in KINDS for code_ok, pc in ((True, P_CODE[k]), (False, 1 - P_CODE[k]))
               for fixable, pf in ((True, P_FIXABLE), (False, 1 - P_FIXABLE)))


def structure_signature(ir: dict[str, Any]) -> str:
    """The workflow's computation with node ids left out: two workflows that differ only in the names
    of their nodes get the same signature (they score the same)."""
    nodes = {n["id"]: n for n in ir["nodes"]}
    inputs: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for e in ir["edges"]:
        for src_field, dst_field in e["map"].items():
            inputs[e["dst"]].append((dst_field, f"{src_field}@{e['src']}"))

    def sig(node_id: str) -> str:
        if node_id == "$input":
            return "$input"
        node = nodes.get(node_id, {"op": node_id, "config": {}, "signature": {}})
        feeds = sorted(f"{dst}<-{src.split('@')[0]}@{sig(src.split('@')[1])}" for dst, src in inputs[node_id])
        return f"{node['op']}{json.dumps(node['config'], sort_keys=True)}[{';'.join(feeds)}]"

    return sig("$output")


def initial_workflow() -> Workflow:
    return Workflow("question -> answer", name="sim").add("solve", Predict("question -> answer"))


def describe_structure(ir: dict[str, Any]) -> str:
    ops = [f"{n['id']}:{n['op']}" + "".join(f" {k}={n['config'][k]}" for k in ("n", "max_rounds") if k in n["config"])
           for n in ir["nodes"]]
    return ", ".join(ops)


# ----------------------------------------------------------------------- the space, enumerated
def enumerate_space(vocabulary: Vocabulary, start: Workflow | None = None) -> dict[str, dict[str, Any]]:
    """Every workflow reachable from ``start`` (default: the initial one): key -> {"ir", "depth", "path"}
    (breadth first; depth is the fewest edits from ``start``).

    Edits are applied to IR data (:meth:`Edit.apply_ir`); each distinct edited graph is built and
    validated (:meth:`Edit.build`, ``Workflow.from_dict``) once, however many paths reach it.
    """
    first = start or initial_workflow()
    first_ir = first.to_dict()
    space = {ir_key(first_ir): {"ir": first_ir, "depth": 0, "path": []}}
    built: set[str] = set()  # edited graphs (keys of the edit's raw data) already built, valid or not
    frontier: list[tuple[Workflow, dict[str, Any], list[str]]] = [(first, first_ir, [])]
    while frontier:
        nxt = []
        for wf, ir, path in frontier:
            for edit in vocabulary.candidates(wf):
                try:
                    data = edit.apply_ir(ir)
                    raw = ir_key(data)
                    if raw in built or len(data["nodes"]) > vocabulary.max_nodes:
                        continue
                    built.add(raw)
                    new = edit.build(wf, data)
                except InvalidEdit:
                    continue
                new_ir = new.to_dict()
                key = ir_key(new_ir)
                if key not in space:
                    space[key] = {"ir": new_ir, "depth": len(path) + 1, "path": [*path, edit.describe()]}
                    nxt.append((new, new_ir, space[key]["path"]))
        frontier = nxt
        logger.info("space: %d workflows (frontier %d)", len(space), len(frontier))
    logger.info("space closed: %d workflows", len(space))
    return space


# ------------------------------------------------------------------------- shared evaluator
_TRUE: dict[tuple[str, str], float] = {}


class FamilyEvaluator:
    """One run's evaluation function: the family's true score (and LM calls), or under noise a binomial
    draw on ``noise_examples`` examples (per-example 0/1 scores, so the search can form intervals).

    It counts its calls and notes the call that first scored an optimal workflow (evaluations to the
    optimum, the same count for every method). ``objective=True`` returns one number, the family's
    objective (what the baselines rank by)."""

    def __init__(self, family: Family, seed: int, target: float, *, objective: bool = False) -> None:
        self.family, self.target, self.objective = family, target, objective
        self.rng = random.Random(1_000_003 * seed + 17)
        self.calls = 0
        self.first_optimal: int | None = None

    def true(self, ir: dict[str, Any]) -> float:
        key = (self.family.name, ir_key(ir))
        if key not in _TRUE:
            _TRUE[key] = self.family.true_score(ir)
        return _TRUE[key]

    def __call__(self, workflow: Workflow) -> Evaluation | float:
        ir = workflow.to_dict()
        self.calls += 1
        p = self.true(ir)
        cost = {"lm_calls": self.family.lm_calls(ir)} if self.family.lm_calls is not None else {}
        value = p - self.family.cost_weight * cost.get("lm_calls", 0.0)
        if value > self.target + 1e-9:
            raise RuntimeError(f"{self.family.name}: a workflow scores {value} above the stated optimum "
                               f"{self.target}: {describe_structure(ir)}")
        if self.first_optimal is None and value >= self.target - 1e-9:
            self.first_optimal = self.calls
        if self.objective:
            return value
        n = self.family.noise_examples
        if n is None:
            return Evaluation(p, cost=cost)
        k = sum(self.rng.random() < p for _ in range(n))
        return Evaluation(k / n, scores=[1.0] * k + [0.0] * (n - k), cost=cost)


def search_settings(family: Family, selection: str = "auto") -> SearchSettings:
    """The stage's defaults and the family's budget, plus the settings a user picks for noise (not
    defaults; chosen on seeds 0-119): leaders are measured three times before they are expanded
    (``confirm=3``), at most 60 new candidates are explored
    (``max_rounds``), and the rest of the budget races the 10 leaders on fresh samples (3 measurements
    each, then the leader against its strongest challenger)."""
    extra: dict[str, Any] = {"max_rounds": 10 * family.max_evals}
    if family.noise_examples is not None:
        extra.update(final_top=10, final_repeats=3, confirm=3, max_rounds=60)
    if family.cost_weight:
        extra.update(objective="penalised", cost_weight=family.cost_weight)
    return SearchSettings(max_evaluations=family.max_evals, convergence_rounds=None, selection=selection, **extra)


# --------------------------------------------------------------------------------- the methods
def run_method(method: str, seed: int, family: Family, target: float, budget: int | None = None,
               selection: str = "auto") -> dict[str, Any]:
    """One run; deterministic families stop once the optimum is scored (the best scored is returned, so
    it is returned from then on), the noisy one spends its whole budget and returns its pick."""
    t0 = time.perf_counter()
    start = family.start()
    proposer = RuleProposer(family.vocabulary)
    noisy = family.noise_examples is not None
    optimal = lambda ir: family.objective(ir) >= target - 1e-9  # noqa: E731
    budget = budget or family.max_evals
    row: dict[str, Any] = {"method": method, "seed": seed, "budget": budget}
    if method == "search":
        evaluate = FamilyEvaluator(family, seed, target)
        search = MCTS(proposer, evaluate, search_settings(family, selection), seed=seed,
                      should_stop=None if noisy else (lambda: "optimum scored" if evaluate.first_optimal else None))
        result = search.run(start)
        best_ir = result.best.to_dict()
        node = result.tree.nodes[result.best_node]
        low, high = result.best_interval
        measured = result.remeasured["score"] if result.remeasured else float(node.score)  # type: ignore[arg-type]
        true = family.true_score(best_ir)
        row.update(evaluations=result.evaluations, interval=[round(low, 4), round(high, 4)],
                   covered=low - 1e-9 <= true <= high + 1e-9, search_measured=round(float(node.score), 4))  # type: ignore[arg-type]
    else:
        evaluate = FamilyEvaluator(family, seed, target, objective=not noisy)
        run = random_walk if method == "random_walk" else hill_climb
        found = run(start, proposer, lambda wf: _score_of(evaluate(wf)), seed=seed,
                    max_evaluations=budget, target=None if noisy else target)
        best_ir = found.best.to_dict()
        measured, true = found.best_score, family.true_score(best_ir)
        row.update(evaluations=found.evaluations)
    row.update(evals_to_optimum=evaluate.first_optimal, returned_optimal=optimal(best_ir),
               returned_true=round(true, 4), returned_measured=round(measured, 4))
    if family.lm_calls is not None:
        row["returned_lm_calls"] = family.lm_calls(best_ir)
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def _score_of(value: Evaluation | float) -> float:
    return value.score if isinstance(value, Evaluation) else float(value)


# ------------------------------------------------------------------ the fake LM, for validation
class SimWorld:
    """The fake LM of one evaluation: gold answers, and coins seeded by (call, question, k-th identical call)."""

    def __init__(self, examples: list[dspy.Example]) -> None:
        self.gold = {ex.question: int(ex.answer) for ex in examples}
        self._counts: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def coin(self, p: float, req: ScriptedRequest, *parts: Any) -> bool:
        # The k-th identical request in one evaluation is sample k (the engine never sees rollout ids).
        with self._lock:
            index = self._counts[req.prompt]
            self._counts[req.prompt] += 1
        digest = hashlib.sha256("|".join(map(str, (*parts, req.prompt, index))).encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < p

    def answer(self, req: ScriptedRequest) -> dict[str, Any]:
        ins, outs = req.inputs, req.output_fields
        q = ins.get("question", "")
        kind = "arith" if q.startswith("[arith]") else "word"
        gold = self.gold.get(q, 0)
        if "is_correct" in outs:  # Refine reviewer
            right = _number(ins.get("attempt", "")) == gold
            flags = self.coin(P_FALSE_ALARM if right else P_CATCH, req, "review")
            return {"feedback": "recheck the arithmetic" if flags else "looks right", "is_correct": not flags}
        if "feedback" in ins:  # Refine revision of a flagged attempt
            attempt = _number(ins.get("attempt", ""))
            fixable = _hash_coin(P_FIXABLE, "fixable", q)
            ok = (not self.coin(P_BREAK, req, "break")) if attempt == gold else (
                fixable and self.coin(P_FIX, req, "fix"))
            return {"reasoning": "revised", "answer": str(gold if ok else gold + 1)}
        if "code" in outs:  # Programmer: one program per question (same prompt, temperature 0)
            ok = _hash_coin(P_CODE[kind], "code", q)
            return {"reasoning": "compute it", "code": f"print({gold if ok else gold + 2})"}
        if "draft_answer" in ins:  # Refine's first draft keeps the upstream answer
            return {"reasoning": "start from the draft", "answer": ins["draft_answer"]}
        if "program_answer" in ins:  # the selector
            program, candidate = ins["program_answer"].strip(), ins.get("candidate_answer", "")
            first, second = (program, candidate) if kind == "arith" and program else (candidate, program)
            return {"answer": second if second and self.coin(P_SELECT_SLIP, req, "slip") else first}
        op = "ChainOfThought" if "reasoning" in outs else "Predict"
        ok = self.coin(P_ANSWER[op][kind], req, op) if (req.temperature or 0) > 0 else _hash_coin(
            P_ANSWER[op][kind], op, q)
        return {**({"reasoning": "steps"} if op == "ChainOfThought" else {}), "answer": str(gold if ok else gold + 1)}


def _hash_coin(p: float, *parts: Any) -> bool:
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < p


def _number(text: str) -> int | None:
    found = re.findall(r"-?\d+", str(text))
    return int(found[-1]) if found else None


def make_examples(n: int) -> list[dspy.Example]:
    out = []
    for i in range(n):
        a, b, c = 17 + 7 * i, 3 + (5 * i) % 11, 2 + i % 9
        if i % 2 == 0:
            q, gold = f"[arith] Compute {a} * {b} + {c}.", a * b + c
        else:
            q, gold = f"[word] Ann packs {b} boxes of {a} apples and eats {c}. How many are left? (#{i})", a * b - c
        out.append(dspy.Example(question=q, answer=str(gold)).with_inputs("question"))
    return out


def run_through_dspy(workflow: Workflow, examples: list[dspy.Example], threads: int = 8) -> float:
    """Accuracy of ``workflow`` on ``examples`` with the fake LM, through DSPy and the real operators."""
    world = SimWorld(examples)
    lm = dspy.LM("scripted/sim", engine=ScriptedEngine(world.answer), cache=False)

    def one(ex: dspy.Example) -> float:
        with dspy.context(lm=lm):
            try:
                pred = workflow(**ex.inputs())
            except Exception as err:  # a failed parse scores as a failure, as in compile()
                logger.debug("example failed: %s", err)
                return 0.0
        return float(_number(pred.answer) == int(ex.answer))

    with ThreadPoolExecutor(threads) as pool:
        scores = list(pool.map(one, examples))
    return sum(scores) / len(scores)


def validate(space: dict[str, dict[str, Any]], best_key: str, n_examples: int) -> list[dict[str, Any]]:
    """Run a few workflows (initial, best, and some on the way) through DSPy; compare with the model."""
    chosen = [next(iter(space)), best_key]
    path = space[best_key]["path"]
    wf = initial_workflow()
    proposer = RuleProposer(VOCABULARY)
    for step in path[:-1]:
        wf = next(new for edit, new in proposer.valid_edits(wf) if edit.describe() == step)
        chosen.insert(-1, ir_key(wf.to_dict()))
    examples = make_examples(n_examples)
    rows = []
    for key in dict.fromkeys(chosen):
        ir = space[key]["ir"]
        model = expected_accuracy(ir)
        measured = run_through_dspy(Workflow.from_dict(ir), examples)
        se = math.sqrt(model * (1 - model) / n_examples)
        rows.append({"structure": describe_structure(ir), "model": round(model, 4), "dspy_run": round(measured, 4),
                     "z": round((measured - model) / se, 2) if se else 0.0})
        logger.info("validation: %s", rows[-1])
    return rows


# ------------------------------------------------------------------------------------------ main
def lm_calls(ir: dict[str, Any]) -> float:
    """LM calls per question of a workflow of the simulated task (Refine: a review and a revision a round)."""
    calls = {"Predict": 1, "ChainOfThought": 1, "Programmer": 1, "Custom": 1}
    return float(sum(n["config"]["n"] if n["op"] == "ScEnsemble" else 2 * n["config"]["max_rounds"]
                     if n["op"] == "Refine" else calls[n["op"]] for n in ir["nodes"]))


def needle() -> Family:
    return Family("needle", initial_workflow, VOCABULARY, expected_accuracy, max_evals=400,
                  description="the simulated math task (expected accuracy of a fake LM), from Predict, at most "
                              f"{MAX_NODES} nodes: one optimal structure, deep in the space")


def deep_start() -> Workflow:
    """A draft reviewed twice (Predict, then two Refine rounds of one): a plausible hand-built workflow,
    5 edits from the nearest optimum of the needle task."""
    wf = AddProgrammer("solve").apply(AddRefine("solve", 1).apply(initial_workflow()))
    # A second Refine right after the first is refused, so it goes in while the branch separates them.
    return RemoveNode("solve_select").apply(AddRefine("solve", 1).apply(wf))


def needle_deep() -> Family:
    return Family("needle_deep", deep_start, VOCABULARY, expected_accuracy, max_evals=400,
                  description="the needle task started from a draft reviewed twice (Predict, Refine, Refine): "
                              "the nearest optimum is 5 edits away")


def cost() -> Family:
    return Family("cost", initial_workflow, VOCABULARY, expected_accuracy, max_evals=400, lm_calls=lm_calls,
                  cost_weight=COST_WEIGHT,
                  description=f"the needle task ranked by accuracy - {COST_WEIGHT} x LM calls per question")


ALL_FAMILIES: dict[str, Any] = {"needle": needle, "needle_deep": needle_deep, "cost": cost, **FAMILIES}
COST_WEIGHT = 0.01


def summarise(family: Family, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cap = family.max_evals
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        # A run that never scored the optimum counts as cap + 1 evaluations (censored).
        # (A hill climb run before a fix could overshoot its budget by one evaluation: such a hit is a miss.)
        caps = [r.get("budget", cap) for r in mine]
        evals = [min(r["evals_to_optimum"], c + 1) if r["evals_to_optimum"] is not None else c + 1
                 for r, c in zip(mine, caps)]
        out[method] = {"runs": len(mine), "budget": max(caps),
                       "scored_optimum": sum(e <= c for e, c in zip(evals, caps)),
                       "returned_optimum": sum(r["returned_optimal"] for r in mine),
                       "median_evals_to_optimum": statistics.median(evals),
                       "mean_returned_true": round(statistics.mean(r["returned_true"] for r in mine), 4),
                       "median_evaluations": statistics.median(r["evaluations"] for r in mine)}
        if method == "search":
            out[method]["covered"] = sum(r.get("covered", False) for r in mine)
            gaps = [r["returned_measured"] - r["returned_true"] for r in mine]
            out[method]["median_measured_minus_true"] = round(statistics.median(gaps), 4)
        if family.lm_calls is not None:
            out[method]["median_lm_calls"] = statistics.median(r["returned_lm_calls"] for r in mine)
    if all(m in out for m in METHODS):
        search, walk, climb = (out[m]["median_evals_to_optimum"] for m in METHODS)
        out["search_over_random_walk"] = round(search / walk, 3)
        out["search_over_hill_climb"] = round(search / climb, 3)
    return out


SMOKE = {"seeds": 2, "families": ["deceptive"], "max_evals": 25}
# The goals of issue 12, per family: the search returns the optimum in >= 90% of seeds, is no worse than
# hill climbing by more than 20% and takes <= 0.5x the random walk's evaluations where the landscape is
# deceptive or large; under noise the true score is inside the reported 95% interval in >= 90% of seeds.
RANDOM_WALK_GOAL = ("deceptive", "additive")
# Seeds looked at while the noise handling (the finals' race, 60 explored candidates) was designed; the
# committed noisy results use other seeds.
DESIGN_SEEDS = {"noisy": "0-119 (19/20 on 0-19 and 93/100 on 20-119 with these settings)."}


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("structure_search_sim", __doc__, smoke=SMOKE)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--families", nargs="+", default=list(ALL_FAMILIES), choices=list(ALL_FAMILIES))
    parser.add_argument("--max-evals", type=int, default=0, help="cap every family's budget (0: its own)")
    parser.add_argument("--validate-examples", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--selection", default="auto", choices=list(SELECTIONS),
                        help="the search's selection (default: the stage's, auto)")
    parser.add_argument("--method-budget", nargs="*", default=[], metavar="METHOD=N",
                        help="a smaller evaluation budget for a slow baseline, e.g. random_walk=200 (a run "
                             "that does not score the optimum counts as N + 1)")
    parser.add_argument("--merge", nargs="*", type=Path, default=None,
                        help="combine the runs of these results files (made by separate processes) into --out")
    run = start_run(parser, argv)
    args = run.args
    if args.merge:
        parts = [_read_part(path) for path in args.merge]
        args.merge = [str(path) for path in args.merge]  # recorded in the results' settings (JSON)
        families: dict[str, Any] = {}
        for part in parts:
            for fam_name, fam in part["families"].items():
                merged = families.setdefault(fam_name, {**fam, "runs": []})
                if len(fam) > len(merged):  # a finished part knows more (the optimum of an enumerated space)
                    merged.update({k: v for k, v in fam.items() if k not in ("runs", "summary")})
                merged["runs"] += fam["runs"]
        for fam_name, fam in families.items():
            fam["summary"] = summarise(ALL_FAMILIES[fam_name](), fam["runs"])
        space = next((part["space"] for part in parts if part["space"]), {})
        _finish(run, families, space, [{k: part[k] for k in ("command", "load_average", "wall_s")} for part in parts])
        return 0
    method_budget = {m: int(n) for m, n in (item.split("=") for item in args.method_budget)}
    families = {}
    space_info: dict[str, Any] = {}
    for name in args.families:
        family = ALL_FAMILIES[name]()
        if args.max_evals:
            family.max_evals = min(family.max_evals, args.max_evals)
        if family.optimum is None:  # needle, cost: the optimum of the enumerated space
            space = enumerate_space(VOCABULARY, family.start())  # depths from this family's start
            if not space_info:
                depth_hist: dict[int, int] = defaultdict(int)
                for v in space.values():
                    depth_hist[v["depth"]] += 1
                space_info = {"size": len(space), "depth_histogram": dict(sorted(depth_hist.items()))}
            info = _optimum(family, space, args.validate_examples)
            target = info["optimum"]
        else:
            target = family.optimum
            info = {"optimum": target}
        rows = []
        for method in args.methods:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                row = run_method(method, seed, family, target, method_budget.get(method), args.selection)
                logger.info("%s %s", name, row)
                rows.append(row)
        families[name] = {"description": family.description, "max_evals": family.max_evals, **info,
                          "settings": asdict(search_settings(family, args.selection)),
                          "summary": summarise(family, rows), "runs": rows}
        logger.info("%s: %s", name, families[name]["summary"])
    _finish(run, families, space_info, [])
    return 0


def _optimum(family: Family, space: dict[str, dict[str, Any]], validate_examples: int) -> dict[str, Any]:
    ranked = sorted(((family.objective(v["ir"]), k) for k, v in space.items()), reverse=True)
    target = ranked[0][0]
    optimal_keys = [k for val, k in ranked if val >= target - 1e-12]
    best_key = min(optimal_keys, key=lambda k: (space[k]["depth"], k))
    info = {"optimum": target, "optimal_workflows": len(optimal_keys), "optimal_depth": space[best_key]["depth"],
            "optimal_structure": describe_structure(space[best_key]["ir"]), "optimal_path": space[best_key]["path"],
            "start": describe_structure(space[next(iter(space))]["ir"]),
            "runner_up": round(next(val for val, _ in ranked if val < target - 1e-12), 6), "space_size": len(space)}
    if family.name == "needle" and validate_examples:
        info["validation"] = validate(space, best_key, validate_examples)
    return info


def _read_part(path: Path) -> dict[str, Any]:
    """A results file of this script (harness schema, or the plain JSON of earlier versions) as one part;
    or the log of a process stopped before it wrote one (its ``<family> {row}`` lines)."""
    if path.suffix == ".log":
        return _part_from_log(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("schema") == SCHEMA:
        return {"families": data["results"]["families"], "space": data["results"]["space"],
                "command": data["command"], "load_average": data["load_average"], "wall_s": data["wall_s"]}
    return {"families": data["families"], "space": data.get("space", {}), "command": data["command"],
            "load_average": {"before": data["load_average_before"], "after": data["load_average_after"]},
            "wall_s": data["wall_s"]}


def _part_from_log(path: Path) -> dict[str, Any]:
    import ast

    families: dict[str, Any] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        head, _, rest = line.partition(" ")
        if head in ALL_FAMILIES and rest.startswith("{'method'"):
            family = ALL_FAMILIES[head]()
            entry = families.setdefault(head, {"description": family.description, "max_evals": family.max_evals,
                                               "optimum": family.optimum, "settings": asdict(search_settings(family)),
                                               "runs": []})
            entry["runs"].append(ast.literal_eval(rest))
    return {"families": families, "space": {}, "wall_s": 0.0, "load_average": {"before": [], "after": []},
            "command": f"(the runs logged in {path.name} by a process stopped before it finished)"}


def _goals(families: dict[str, Any]) -> list[Goal]:
    goals = []
    for name, fam in families.items():
        summ = fam["summary"]
        if "search" not in summ:
            continue
        search = summ["search"]
        goals.append(Goal.at_least(f"{name}: share of seeds the search returns the optimum",
                                   round(search["returned_optimum"] / search["runs"], 3), 0.9))
        ran = {m: summ[m]["runs"] for m in METHODS if m in summ}
        goals.append(Goal.at_least(f"{name}: seeds of the method with fewest ({min(ran, key=ran.__getitem__)})",
                                   min(ran.values()), 20))
        if "search_over_hill_climb" in summ:
            goals.append(Goal.at_most(f"{name}: search / hill climbing, median evals to optimum",
                                      summ["search_over_hill_climb"], 1.2))
        if name in RANDOM_WALK_GOAL and "search_over_random_walk" in summ:
            goals.append(Goal.at_most(f"{name}: search / random walk, median evals to optimum",
                                      summ["search_over_random_walk"], 0.5))
        if fam.get("settings", {}).get("final_top") and "covered" in search:
            goals.append(Goal.at_least(f"{name}: true score inside the reported 95% interval",
                                       round(search["covered"] / search["runs"], 3), 0.9))
    return goals


def _finish(run: Any, families: dict[str, Any], space: dict[str, Any], parts: list[dict[str, Any]]) -> None:
    results = {"families": families, "space": space, "parts": parts}
    run.finish("Structure search on simulated landscapes (issue 12)", results, _markdown(results),
               goals=_goals(families))


def _markdown(data: dict[str, Any]) -> list[str]:
    lines = []
    for part in data["parts"]:
        load = part["load_average"]
        lines.append(f"- part `{part['command']}`: " + (f"load average {load['before']} before, {load['after']} "
                                                          f"after, {part['wall_s']} s" if load["before"] else
                                                          "its load was not recorded (see the load of this merge)"))
    if data["parts"]:
        lines.append("")
    lines += [
        "Counts, not times, are the result. Methods, side by side on every family and seed, from the same "
        "start with the same rule proposer and one shared evaluation function: `search` = `MCTS` with the "
        "stage's defaults (selection `auto`: an iterated local search, a first-improvement climb, and at a local "
        "optimum a restart from a random open workflow nearest the best one; on the noisy family `confirm=3` (a "
        "node is measured 3 times before it is expanded, so `auto` searches best-first: the highest upper 95% "
        "bound), at most 60 new candidates explored, and the rest of the budget a race of the 10 leaders on "
        "fresh samples (3 measurements each, then the leader against its strongest challenger, ranked by all "
        "of a finalist's measurements, the interval from the fresh ones alone); on "
        "the cost family `objective=\"penalised\"`); `random_walk` = a uniformly random valid edit at each step; "
        "`hill_climb` = steepest ascent with random restarts. An evaluation is one evaluator call (the search's "
        "final re-measurements included). Deterministic families stop a run once the optimum is scored (the "
        "best scored is what every method returns, so from then on it is returned); a run that never scores "
        "it counts as its budget + 1 evaluations (so a median above the budget means fewer than half the runs "
        "found it, and a ratio to it is an upper bound).",
        "",
    ]
    if data["space"]:
        sp = data["space"]
        lines += [f"Needle/cost space: **{sp['size']} workflows** reachable from `Predict` with at most {MAX_NODES} "
                  f"nodes (enumerated; workflows by edits from `Predict`: {sp['depth_histogram']}).", ""]
    for name, fam in data["families"].items():
        summ = fam["summary"]
        start = fam.get("start") or describe_structure(ALL_FAMILIES[name]().start().to_dict())
        deep = (f" ({fam['optimal_workflows']} optimal workflows, the nearest {fam['optimal_depth']} edits from "
                f"the start `{start}`: `{fam['optimal_structure']}`; runner-up {fam['runner_up']})"
                if "optimal_depth" in fam else "")
        optimum = "not recorded (its process was stopped before it wrote its results)" if fam["optimum"] is None \
            else round(fam["optimum"], 6)
        seeds = sorted({r["seed"] for r in fam["runs"]})
        design = (f" The search's settings for this family were chosen on seeds {DESIGN_SEEDS[name]}"
                  if name in DESIGN_SEEDS else "")
        lines += [f"## {name}", "", f"{fam['description']}. Budget {fam['max_evals']} evaluations; optimum "
                  f"{optimum}{deep}. Seeds {_seed_ranges(seeds)}.{design}", ""]
        costs = any("median_lm_calls" in m for m in summ.values() if isinstance(m, dict))
        rows = []
        for method in [m for m in METHODS if m in summ]:
            m = summ[method]
            rows.append([method, m.get("budget", fam["max_evals"]), f"{m['scored_optimum']}/{m['runs']}",
                         f"{m['returned_optimum']}/{m['runs']}", m["median_evals_to_optimum"],
                         m["mean_returned_true"], m["median_evaluations"]] + ([m["median_lm_calls"]] if costs else []))
        lines += markdown_table(["method", "budget", "scored the optimum", "returned it", "median evals to optimum",
                                 "mean true score returned", "median evaluations used"]
                                + (["median LM calls"] if costs else []), rows, align="lrrrrrr" + "r" * costs)
        if "search_over_random_walk" in summ:
            lines += ["", f"search / random walk median evals to optimum: **{summ['search_over_random_walk']}**; "
                          f"search / hill climbing: **{summ['search_over_hill_climb']}**."]
        if fam.get("settings", {}).get("final_top") and "search" in summ:
            s = summ["search"]
            lines += ["", f"Returned workflow's true score inside its reported 95% interval (from the "
                          f"re-measurement on fresh samples): **{s['covered']}/{s['runs']}**; median re-measured "
                          f"minus true {s['median_measured_minus_true']}."]
        lines.append("")
    return lines


def _seed_ranges(seeds: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for seed in seeds:
        if spans and seed == spans[-1][1] + 1:
            spans[-1][1] = seed
        else:
            spans.append([seed, seed])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


if __name__ == "__main__":
    setup_logging()
    logging.getLogger("flowopt").setLevel(logging.WARNING)  # the searches' per-round lines would swamp the log
    sys.exit(main())
