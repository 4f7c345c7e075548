"""Structure search on a simulated task whose best structure is known: MCTS vs random edits vs hill climbing.

The fake LM (a scripted DSPy engine; every workflow really runs through DSPy and the Programmer
sandbox) answers math questions of two kinds, ``arith`` and ``word``, correctly with a known
probability that depends on the kind of call, drawn from a hash of (question, call, sample) so that
results are reproducible:

=================  =====  =====
call               arith  word
=================  =====  =====
Predict            0.30   0.45
ChainOfThought     0.55   0.65
one ScEnsemble     0.55   0.65   (samples are independent, so majority-of-n adds a known amount)
sample
Programmer code    0.95   0.35
=================  =====  =====

A Refine reviewer spots a wrong attempt with probability 0.7 and each revision fixes it with
probability 0.35 (so more rounds help); a Programmer-branch selector takes the program's answer for
arithmetic and the reasoning answer otherwise. The best structure therefore combines an ensemble, a
programmer branch and a refinement with the most rounds. The optimum of the search space (at most 5
nodes, ensembles of 3/5/7, 1-3 refine rounds) is found exhaustively, then each method runs from
``Predict`` for each seed until it evaluates a workflow with the optimal score or spends
``--max-evals`` evaluations (then it counts as ``--max-evals``, censored). Evaluations are counted
per run (identical graphs are scored once per run); the actual scores are memoised across runs to
save time, which changes no count.
For the same reason the sandbox result of identical generated code (``print(<number>)``) is memoised.

Run: python benchmarks/perf/structure_search_sim.py [--seeds 10] [--examples 60] [--max-evals 300]
Writes benchmarks/results/structure_search_sim.{json,md}. Goal (issue 5): MCTS median <= 0.5x random's.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import platform
import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dspy

from flowopt import Workflow
from flowopt.io import atomic_write_json, atomic_write_text
from flowopt.modules import Predict
from flowopt.optimizers.structure import MCTS, RuleProposer, SearchSettings, Vocabulary
from flowopt.optimizers.structure.baselines import hill_climb, random_walk
from flowopt.optimizers.structure.tree import workflow_key
from flowopt.testing import ScriptedEngine, ScriptedRequest

RESULTS = Path(__file__).resolve().parents[1] / "results"
logger = logging.getLogger("structure_search_sim")

P_CORRECT = {"predict": {"arith": 0.30, "word": 0.45}, "cot": {"arith": 0.55, "word": 0.65},
             "code": {"arith": 0.95, "word": 0.35}}
P_REVIEW_CATCHES = 0.7
P_REVISE_FIXES = 0.35
VOCABULARY = Vocabulary(kinds=("swap_operator", "wrap_ensemble", "add_refine", "add_programmer", "remove_node",
                               "set_config"), ensemble_sizes=(3, 5, 7), refine_rounds=(1, 2, 3), max_nodes=5)


def make_examples(n: int) -> list[dspy.Example]:
    out = []
    for i in range(n):
        a, b, c = 17 + 7 * i, 3 + (5 * i) % 11, 2 + i % 9
        if i % 2 == 0:
            q, gold = f"[arith] Compute {a} * {b} + {c}.", a * b + c
        else:
            q, gold = f"[word] Ann packs {b} boxes of {a} apples and eats {c}. How many are left?", a * b - c
        out.append(dspy.Example(question=q, answer=str(gold)).with_inputs("question"))
    return out


class SimWorld:
    """The fake LM's knowledge: gold answers by question, and seeded coin flips."""

    def __init__(self, examples: list[dspy.Example]) -> None:
        self.gold = {ex.question: int(ex.answer) for ex in examples}
        self._counts: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def coin(self, p: float, *parts: Any) -> bool:
        digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < p

    def sample_index(self, key: str) -> int:
        # The engine never sees DSPy's rollout_id, so the k-th identical sampled request in one
        # evaluation is sample k. The vote is over a multiset of outcomes, so thread order never matters.
        with self._lock:
            index = self._counts[key]
            self._counts[key] += 1
            return index

    def answer(self, req: ScriptedRequest) -> dict[str, Any]:
        q = req.inputs.get("question", "")
        kind = "arith" if q.startswith("[arith]") else "word"
        gold = self.gold.get(q, 0)
        outs, ins = req.output_fields, req.inputs
        if "is_correct" in outs:  # Refine reviewer
            correct = _number(ins.get("attempt", "")) == gold
            flags = not correct and self.coin(P_REVIEW_CATCHES, "review", q, ins.get("attempt"))
            return {"feedback": "recheck the arithmetic" if flags else "looks right", "is_correct": not flags}
        if "feedback" in ins:  # Refine revision: fixes, or produces another wrong number
            attempt = _number(ins.get("attempt", ""))
            fixed = attempt == gold or self.coin(P_REVISE_FIXES, "revise", q, attempt)
            return {"reasoning": "revised", "answer": str(gold if fixed else (attempt or gold) + 1)}
        if "code" in outs:  # Programmer writes code
            ok = self.coin(P_CORRECT["code"][kind], "code", q)
            return {"reasoning": "compute it", "code": f"print({gold if ok else gold + 2})"}
        if "draft_answer" in ins:  # Refine's first draft keeps the upstream answer
            return {"reasoning": "start from the draft", "answer": ins["draft_answer"]}
        if "program_answer" in ins:  # programmer-branch selector
            program = ins["program_answer"].strip()
            return {"answer": program if kind == "arith" and program else ins.get("candidate_answer", "")}
        role = "cot" if "reasoning" in outs else "predict"
        salt = self.sample_index(req.prompt) if (req.temperature or 0) > 0 else 0
        ok = self.coin(P_CORRECT[role][kind], role, q, salt)
        return {**({"reasoning": "steps"} if role == "cot" else {}), "answer": str(gold if ok else gold + 1)}


def _number(text: str) -> int | None:
    found = re.findall(r"-?\d+", str(text))
    return int(found[-1]) if found else None


class SimEvaluator:
    """Runs a workflow on the examples with a fresh fake LM; memoises scores by canonical JSON."""

    def __init__(self, examples: list[dspy.Example], threads: int = 8) -> None:
        self.examples = examples
        self.threads = threads
        self.memo: dict[str, float] = {}

    def __call__(self, workflow: Workflow) -> float:
        key = workflow_key(workflow.canonical_json())
        if key not in self.memo:
            self.memo[key] = self._run(workflow)
        return self.memo[key]

    def _run(self, workflow: Workflow) -> float:
        world = SimWorld(self.examples)
        lm = dspy.LM("scripted/sim", engine=ScriptedEngine(world.answer), cache=False)

        def one(ex: dspy.Example) -> float:
            with dspy.context(lm=lm):
                try:
                    pred = workflow(**ex.inputs())
                except Exception as err:  # a failed parse scores as a failure, as in compile()
                    logger.debug("example failed: %s", err)
                    return 0.0
            return float(_number(pred.answer) == int(ex.answer))

        with ThreadPoolExecutor(self.threads) as pool:
            scores = list(pool.map(one, self.examples))
        return sum(scores) / len(scores)


def _memoise_sandbox() -> None:
    """Run each distinct generated program once: the fake LM's code is ``print(<number>)``, so the
    sandbox's answer never changes, and a subprocess per example would dominate the run time."""
    import functools

    import flowopt.modules.programmer as programmer

    programmer.run_python = functools.lru_cache(maxsize=None)(programmer.run_python)


def initial_workflow() -> Workflow:
    return Workflow("question -> answer", name="sim").add("solve", Predict("question -> answer"))


def find_optimum(evaluate: SimEvaluator, max_depth: int) -> tuple[float, int, list[str]]:
    """Exhaustive breadth-first enumeration of the space (to ``max_depth`` edits): best score and size."""
    proposer = RuleProposer(VOCABULARY)
    start = initial_workflow()
    seen = {workflow_key(start.canonical_json()): (evaluate(start), [])}
    frontier = [(start, [])]
    for _ in range(max_depth):
        nxt = []
        for wf, path in frontier:
            for edit, new in proposer.valid_edits(wf):
                key = workflow_key(new.canonical_json())
                if key not in seen:
                    seen[key] = (evaluate(new), [*path, edit.describe()])
                    nxt.append((new, seen[key][1]))
        frontier = nxt
        logger.info("depth %d: %d workflows", _ + 1, len(seen))
    best_score, best_path = max(seen.values(), key=lambda v: (v[0], -len(v[1])))
    return best_score, len(seen), best_path


def evals_to_target(trace: list[tuple[int, float]], target: float, cap: int) -> int:
    """First evaluation index whose score reaches the target; ``cap`` when never reached."""
    return next((i for i, s in trace if s >= target - 1e-9), cap)


def run_method(method: str, seed: int, evaluate: SimEvaluator, target: float, cap: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    if method == "mcts":
        settings = SearchSettings(max_rounds=10 * cap, max_evaluations=cap, convergence_rounds=None)
        reached: list[int] = []

        def stop() -> str | None:
            return "target reached" if reached else None

        def on_round(event: dict[str, Any]) -> None:
            if event["event"] == "expand" and event["score"] >= target - 1e-9:
                reached.append(event["evaluations"])

        result = MCTS(RuleProposer(VOCABULARY), evaluate, settings, seed=seed, should_stop=stop,
                      on_round=on_round).run(initial_workflow())
        trace = [(n.evaluation, n.score) for n in result.tree.nodes]
    elif method == "random":
        trace = random_walk(initial_workflow(), RuleProposer(VOCABULARY), evaluate, seed=seed, max_evaluations=cap,
                            target=target)
    else:
        trace = hill_climb(initial_workflow(), RuleProposer(VOCABULARY), evaluate, seed=seed, max_evaluations=cap,
                           target=target)
    n = evals_to_target(trace, target, cap)
    return {"method": method, "seed": seed, "evals_to_best": n, "reached": n < cap or any(
        s >= target - 1e-9 for _, s in trace), "evaluations": len(trace), "best": max(s for _, s in trace),
        "wall_s": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--examples", type=int, default=60)
    parser.add_argument("--max-evals", type=int, default=300)
    parser.add_argument("--depth", type=int, default=6, help="depth of the exhaustive optimum search")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("flowopt", "dspy", "LiteLLM", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    _memoise_sandbox()
    evaluate = SimEvaluator(make_examples(args.examples))
    t0 = time.perf_counter()
    target, space, best_path = find_optimum(evaluate, args.depth)
    logger.info("optimum %.4f over %d workflows via %s (%.0fs)", target, space, best_path,
                time.perf_counter() - t0)
    runs = []
    for method in ("mcts", "random", "hill_climb"):
        for seed in range(args.seeds):
            row = run_method(method, seed, evaluate, target, args.max_evals)
            logger.info("%s", row)
            runs.append(row)
    summary = {}
    for method in ("mcts", "random", "hill_climb"):
        counts = [r["evals_to_best"] for r in runs if r["method"] == method]
        summary[method] = {"median": statistics.median(counts), "mean": round(statistics.mean(counts), 1),
                           "min": min(counts), "max": max(counts),
                           "reached": sum(r["reached"] for r in runs if r["method"] == method), "runs": len(counts)}
    ratio = summary["mcts"]["median"] / summary["random"]["median"]
    data = {"benchmark": "structure_search_sim", "seeds": args.seeds, "examples": args.examples,
            "max_evals": args.max_evals, "optimum": target, "optimal_path": best_path, "space_size": space,
            "space_depth": args.depth, "probabilities": P_CORRECT, "summary": summary,
            "mcts_over_random_median": round(ratio, 3), "goal": "mcts median <= 0.5 x random median",
            "goal_met": ratio <= 0.5, "runs": runs, "python": sys.version.split()[0],
            "platform": platform.platform(), "wall_s": round(time.perf_counter() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "structure_search_sim.json", data)
    atomic_write_text(args.out / "structure_search_sim.md", _markdown(data))
    logger.info("MCTS/random median ratio %.3f (goal <= 0.5): %s", ratio, "met" if ratio <= 0.5 else "NOT met")
    return 0


def _markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Structure search on a simulated task (issue 5)",
        "",
        "`python benchmarks/perf/structure_search_sim.py"
        f" --seeds {data['seeds']} --examples {data['examples']} --max-evals {data['max_evals']}`",
        "",
        f"Fake LM with structure-dependent accuracy (see the script's docstring); {data['examples']} questions; "
        f"search space: every workflow within {data['space_depth']} edits of `Predict` with at most 5 nodes "
        f"({data['space_size']} distinct workflows). Optimum score {data['optimum']:.4f}, reached for example by: "
        + " -> ".join(data["optimal_path"]) + ".",
        "",
        "Evaluations until a workflow with the optimal score is scored (identical graphs count once per run; "
        f"runs that never reach it count as {data['max_evals']}):",
        "",
        "| method | median | mean | min | max | reached |",
        "|---|---|---|---|---|---|",
    ]
    for method, s in data["summary"].items():
        lines.append(f"| {method} | {s['median']} | {s['mean']} | {s['min']} | {s['max']} | "
                     f"{s['reached']}/{s['runs']} |")
    lines += ["", f"MCTS median / random median = **{data['mcts_over_random_median']}** "
                  f"(goal <= 0.5: {'met' if data['goal_met'] else 'not met'}).", "",
              "Methods: `mcts` = MCTS with AFlow's mixed selection (top-k 4, alpha 0.2, lambda 0.3) and the "
              "rule proposer; `random` = random walk, each step a uniformly random valid edit of the current "
              "workflow; `hill_climb` = steepest-ascent hill climbing (score every neighbour, move to the best "
              "if it improves, stop at a local optimum).", "",
              f"Python {data['python']} on {data['platform']}; total {data['wall_s']} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
