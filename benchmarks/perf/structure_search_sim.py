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

import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("DSPY_CACHEDIR", tempfile.mkdtemp(prefix="flowopt-sim-dspy-"))


from flowopt import Workflow
from flowopt.benchmarks.perf.harness import SCHEMA, PerfParser, setup_logging, start_run
from flowopt.benchmarks.perf.structure_families import FAMILIES, Family
from flowopt.benchmarks.perf.structure_sim_report import METHODS, goals, markdown
from flowopt.benchmarks.perf.structure_sim_world import (
    MAX_NODES,
    VOCABULARY,
    describe_structure,
    enumerate_space,
    expected_accuracy,
    initial_workflow,
    validate,
)
from flowopt.optimizers.structure import MCTS, Evaluation, RuleProposer, SearchSettings
from flowopt.optimizers.structure.baselines import hill_climb, random_walk
from flowopt.optimizers.structure.edits import AddProgrammer, AddRefine, RemoveNode
from flowopt.optimizers.structure.search_settings import SELECTIONS
from flowopt.optimizers.structure.tree import ir_key

logger = logging.getLogger("structure_search_sim")



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
# Seeds looked at while the noise handling (the finals' race, 60 explored candidates) was designed; the
# committed noisy results use other seeds.


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


def _finish(run: Any, families: dict[str, Any], space: dict[str, Any], parts: list[dict[str, Any]]) -> None:
    results = {"families": families, "space": space, "parts": parts}
    run.finish("Structure search on simulated landscapes (issue 12)", results, markdown(results, ALL_FAMILIES),
               goals=goals(families))


if __name__ == "__main__":
    setup_logging()
    logging.getLogger("flowopt").setLevel(logging.WARNING)  # the searches' per-round lines would swamp the log
    sys.exit(main())
