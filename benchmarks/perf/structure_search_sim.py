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

Each method starts from ``Predict`` for each seed and runs until it scores the optimal workflow or
spends ``--max-evals`` evaluations (then it counts as ``--max-evals``, censored). All methods share one
evaluation function; each run counts an evaluation the first time it scores a distinct workflow
(canonical JSON); cache hits are free for every method. Speed-only memos, which change no count:
scores and the edits' results (a pure function of workflow and edit) are memoised across runs.

Run: python benchmarks/perf/structure_search_sim.py [--seeds 20] [--max-evals 400]
Writes benchmarks/results/structure_search_sim.{json,md}. Goal (issue 5): MCTS median <= 0.5x random's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("DSPY_CACHEDIR", tempfile.mkdtemp(prefix="flowopt-sim-dspy-"))

import dspy

from flowopt import Workflow
from flowopt.errors import FlowoptError
from flowopt.io import atomic_write_json, atomic_write_text
from flowopt.modules import Predict
from flowopt.optimizers.structure import MCTS, InvalidEdit, RuleProposer, SearchSettings, Vocabulary
from flowopt.optimizers.structure.baselines import hill_climb, random_walk
from flowopt.optimizers.structure.edits import SELECT_INSTRUCTION, Edit
from flowopt.optimizers.structure.tree import ir_key
from flowopt.testing import ScriptedEngine, ScriptedRequest

RESULTS = Path(__file__).resolve().parents[1] / "results"
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
METHODS = ("mcts", "random_walk", "random_tree", "hill_climb")


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
def enumerate_space(vocabulary: Vocabulary) -> dict[str, dict[str, Any]]:
    """Every workflow reachable from the initial one: key -> {"ir", "depth", "path"} (breadth first).

    Uses the edits' own IR transforms (:meth:`Edit.apply_ir`) and validates each new state once with
    ``Workflow.from_dict`` (whose result gives the next edits), instead of building a workflow per edit.
    """
    start = initial_workflow()
    ir0 = start.to_dict()
    space = {ir_key(ir0): {"ir": ir0, "depth": 0, "path": []}}
    frontier: list[tuple[dict[str, Any], Workflow, list[str]]] = [(ir0, start, [])]
    refused = 0
    normalised: dict[str, str | None] = {}
    while frontier:
        nxt = []
        for ir, wf, path in frontier:
            for edit in vocabulary.candidates(wf):
                try:
                    new = edit.apply_ir(ir)
                except InvalidEdit:
                    continue
                if len(new["nodes"]) > vocabulary.max_nodes:
                    continue
                raw = ir_key(new)
                if raw not in normalised:  # validate and normalise each distinct edited graph once
                    try:
                        built = Workflow.from_dict(new)
                    except FlowoptError:
                        normalised[raw] = None
                        refused += 1
                        continue
                    new = built.to_dict()  # the IR exactly as a real edit would produce it
                    normalised[raw] = ir_key(new)
                    if normalised[raw] not in space:
                        space[normalised[raw]] = {"ir": new, "depth": len(path) + 1, "path": [*path, edit.describe()]}
                        nxt.append((new, built, space[normalised[raw]]["path"]))
        frontier = nxt
        logger.info("space: %d workflows (frontier %d)", len(space), len(frontier))
    logger.info("space closed: %d workflows, %d edited graphs refused by validation", len(space), refused)
    return space


# ------------------------------------------------------------------- shared evaluator and memos
class ModelEvaluator:
    """The evaluation function every method uses: expected accuracy, memoised by canonical JSON."""

    def __init__(self) -> None:
        self.scores: dict[str, float] = {}

    def __call__(self, workflow: Workflow) -> float:
        ir = _ir_of(workflow)
        key = ir_key(ir)
        if key not in self.scores:
            self.scores[key] = expected_accuracy(ir)
        return self.scores[key]


_IR_MEMO: dict[int, tuple[Workflow, dict[str, Any]]] = {}
_APPLY_MEMO: dict[tuple[str, str], Workflow | InvalidEdit] = {}
_INTERNED: dict[str, Workflow] = {}


def _ir_of(workflow: Workflow) -> dict[str, Any]:
    hit = _IR_MEMO.get(id(workflow))
    if hit is not None and hit[0] is workflow:
        return hit[1]
    return workflow.to_dict()


class MemoVocabulary(Vocabulary):
    """``Vocabulary`` whose ``check`` (apply an edit) is memoised: a speed-only cache, as the result is a
    pure function of the workflow and the edit. Workflows are interned by canonical JSON and their IR
    kept, so ``to_dict``/``canonical_json`` on them are answered from the memo (see :func:`install_memos`)."""

    def check(self, edit: Edit, workflow: Workflow, *, ir: dict[str, Any] | None = None) -> Workflow:
        source = _ir_of(workflow)
        memo_key = (ir_key(source), json.dumps(edit.to_dict(), sort_keys=True))
        if memo_key not in _APPLY_MEMO:
            try:
                new = super().check(edit, workflow, ir=source)
                _APPLY_MEMO[memo_key] = intern(new)
            except InvalidEdit as err:
                _APPLY_MEMO[memo_key] = err
        result = _APPLY_MEMO[memo_key]
        if isinstance(result, InvalidEdit):
            raise result
        return result


def intern(workflow: Workflow) -> Workflow:
    ir = workflow.to_dict()
    key = ir_key(ir)
    if key not in _INTERNED:
        _INTERNED[key] = workflow
        _IR_MEMO[id(workflow)] = (workflow, ir)
    return _INTERNED[key]


def install_memos() -> None:
    """Answer ``to_dict``/``canonical_json`` of interned (never mutated) workflows from the memo, and
    run each distinct generated program once in the sandbox (the fake LM's code is ``print(<n>)``)."""
    import functools

    import flowopt.modules.programmer as programmer

    original_to_dict = Workflow.to_dict

    def to_dict(self: Workflow) -> dict[str, Any]:
        hit = _IR_MEMO.get(id(self))
        return json.loads(json.dumps(hit[1])) if hit is not None and hit[0] is self else original_to_dict(self)

    Workflow.to_dict = to_dict  # type: ignore[method-assign]
    programmer.run_python = functools.lru_cache(maxsize=None)(programmer.run_python)


# --------------------------------------------------------------------------------- the methods
def run_method(method: str, seed: int, evaluate: ModelEvaluator, target: float, cap: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    start = intern(initial_workflow())
    proposer = RuleProposer(MemoVocabulary(**{f: getattr(VOCABULARY, f) for f in VOCABULARY.__dataclass_fields__}))
    if method in ("mcts", "random_tree"):
        # random_tree: the same tree search with a uniformly random open node (lambda 1, no top-k cut).
        extra = {} if method == "mcts" else {"lambda_": 1.0, "top_k": 10**9}
        settings = SearchSettings(max_rounds=50 * cap, max_evaluations=cap, convergence_rounds=None, **extra)
        reached: list[int] = []

        def on_round(event: dict[str, Any]) -> None:
            if event["event"] == "expand" and event["score"] >= target - 1e-12:
                reached.append(event["evaluations"])

        result = MCTS(proposer, evaluate, settings, seed=seed, on_round=on_round,
                      should_stop=lambda: "target reached" if reached else None).run(start)
        trace = [(n.evaluation, n.score) for n in result.tree.nodes]
    elif method == "random_walk":
        trace = random_walk(start, proposer, evaluate, seed=seed, max_evaluations=cap, target=target)
    else:
        trace = hill_climb(start, proposer, evaluate, seed=seed, max_evaluations=cap, target=target)
    n = next((i for i, s in trace if s >= target - 1e-12), None)
    return {"method": method, "seed": seed, "evals_to_best": n if n is not None else cap, "reached": n is not None,
            "evaluations": len(trace), "best": round(max(s for _, s in trace), 6),
            "wall_s": round(time.perf_counter() - t0, 2)}


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
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--max-evals", type=int, default=400)
    parser.add_argument("--validate-examples", type=int, default=400)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("flowopt", "dspy", "LiteLLM", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    t0 = time.perf_counter()
    space = enumerate_space(VOCABULARY)
    scored = sorted(((expected_accuracy(v["ir"]), k) for k, v in space.items()), reverse=True)
    target = scored[0][0]
    optimal = [k for s, k in scored if s >= target - 1e-12]
    best_key = min(optimal, key=lambda k: (space[k]["depth"], k))  # the one fewest edits away
    optimal_structures = {structure_signature(space[k]["ir"]) for k in optimal}
    runner_up = next(s for s, _ in scored if s < target - 1e-12)
    best = space[best_key]
    logger.info("optimum %.4f (%d workflow(s)), runner-up %.4f: %s via %s", target, len(optimal), runner_up,
                describe_structure(best["ir"]), best["path"])
    enum_s = time.perf_counter() - t0
    validation = validate(space, best_key, args.validate_examples) if args.validate_examples else []

    install_memos()
    evaluate = ModelEvaluator()
    runs = []
    for method in METHODS:
        for seed in range(args.seeds):
            row = run_method(method, seed, evaluate, target, args.max_evals)
            logger.info("%s", row)
            runs.append(row)
    summary = {}
    for method in METHODS:
        counts = [r["evals_to_best"] for r in runs if r["method"] == method]
        summary[method] = {"median": statistics.median(counts), "mean": round(statistics.mean(counts), 1),
                           "min": min(counts), "max": max(counts),
                           "reached": sum(r["reached"] for r in runs if r["method"] == method), "runs": len(counts)}
    ratio = summary["mcts"]["median"] / summary["random_walk"]["median"]
    ratio_tree = summary["mcts"]["median"] / summary["random_tree"]["median"]
    depth_hist = defaultdict(int)
    for v in space.values():
        depth_hist[v["depth"]] += 1
    data = {"benchmark": "structure_search_sim", "command": "python benchmarks/perf/structure_search_sim.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "seeds": args.seeds, "max_evals": args.max_evals, "optimum": round(target, 6),
            "optimal_workflows": len(optimal),
            "optimal_structures": len(optimal_structures), "structures": len({structure_signature(v["ir"])
                                                                              for v in space.values()}),
            "runner_up": round(runner_up, 6),
            "optimal_structure": describe_structure(best["ir"]), "optimal_path": best["path"],
            "space_size": len(space), "space_depth": max(depth_hist), "max_nodes": MAX_NODES,
            "vocabulary": {"ensemble_sizes": VOCABULARY.ensemble_sizes, "refine_rounds": VOCABULARY.refine_rounds,
                           "kinds": VOCABULARY.kinds},
            "model": {"p_answer": P_ANSWER, "p_code": P_CODE, "p_select_slip": P_SELECT_SLIP, "p_catch": P_CATCH,
                      "p_fix": P_FIX, "p_fixable": P_FIXABLE, "p_false_alarm": P_FALSE_ALARM,
                      "p_break": P_BREAK},
            "top_scores": [{"score": round(s, 6), "structure": describe_structure(space[k]["ir"])}
                           for s, k in scored[:5]],
            "validation": validation, "validate_examples": args.validate_examples, "summary": summary,
            "mcts_over_random_walk_median": round(ratio, 3), "mcts_over_random_tree_median": round(ratio_tree, 3),
            "goal": "mcts median <= 0.5 x random (walk) median", "goal_met": ratio <= 0.5, "runs": runs,
            "python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "enumeration_s": round(enum_s, 1), "wall_s": round(time.perf_counter() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "structure_search_sim.json", data)
    atomic_write_text(args.out / "structure_search_sim.md", _markdown(data))
    logger.info("MCTS/random-walk median ratio %.3f (goal <= 0.5): %s; MCTS/random-tree %.3f", ratio,
                "met" if ratio <= 0.5 else "NOT met", ratio_tree)
    return 0


def _markdown(data: dict[str, Any]) -> str:
    m = data["model"]
    lines = [
        "# Structure search on a simulated task (issue 5)",
        "",
        f"`{data['command'].strip()}` ({data['cpus']} CPUs, Python {data['python']} on {data['platform']}; "
        f"total {data['wall_s']} s, of which {data['enumeration_s']} s enumerating the space)",
        "",
        "**Task and fake LM** (rules in the script's docstring): half arithmetic, half word problems. "
        f"P(correct) Predict {m['p_answer']['Predict']}, ChainOfThought / one ensemble sample "
        f"{m['p_answer']['ChainOfThought']}, Programmer {m['p_code']}; ScEnsemble(n) = majority of n samples; "
        f"Programmer branch + selector (takes the program for arithmetic, slips with p={m['p_select_slip']}); "
        f"Refine: reviewer catches a wrong attempt with p={m['p_catch']} (revision fixes it with p={m['p_fix']} "
        f"if the question is fixable, p={m['p_fixable']} per question) "
        f"and flags a correct one with p={m['p_false_alarm']} (revision breaks it with p={m['p_break']}). "
        "A workflow's score is its exact expected accuracy under these rules (no 1/N ties).",
        "",
        f"**Space**: every workflow reachable from `Predict` with edits {list(data['vocabulary']['kinds'])}, "
        f"ensembles n in {list(data['vocabulary']['ensemble_sizes'])}, Refine rounds in "
        f"{list(data['vocabulary']['refine_rounds'])}, at most {data['max_nodes']} nodes: "
        f"**{data['space_size']} workflows** (enumerated completely; up to {data['space_depth']} edits from "
        f"`Predict`; {data['structures']} distinct structures once node names are ignored). Optimum "
        f"**{data['optimum']:.4f}**, reached by **{data['optimal_structures']}** structure "
        f"({data['optimal_workflows']} workflows that differ only in node names, e.g. `solve_code` vs "
        f"`solve_code2`; a run reaches the goal with any of them); runner-up {data['runner_up']:.4f}: "
        f"`{data['optimal_structure']}`, e.g. via "
        + " -> ".join(data["optimal_path"]) + ".",
        "",
        "| top scores | structure |", "|---|---|",
        *[f"| {t['score']:.4f} | `{t['structure']}` |" for t in data["top_scores"]],
        "",
    ]
    if data["validation"]:
        lines += [f"**Validation**: the model's accuracy vs running the workflow through DSPy, the operators and the "
                  f"sandbox with the fake LM on {data['validate_examples']} questions (z = difference / binomial SE):",
                  "", "| structure | model | DSPy run | z |", "|---|---|---|---|",
                  *[f"| `{v['structure']}` | {v['model']} | {v['dspy_run']} | {v['z']} |" for v in data["validation"]],
                  ""]
    lines += [
        f"**Evaluations until the optimal workflow is scored**, {data['seeds']} seeds each (each run counts a "
        f"distinct workflow once; runs that never reach it count as {data['max_evals']}):",
        "",
        "| method | median | mean | min | max | reached |",
        "|---|---|---|---|---|---|",
    ]
    for method, s in data["summary"].items():
        lines.append(f"| {method} | {s['median']} | {s['mean']} | {s['min']} | {s['max']} | "
                     f"{s['reached']}/{s['runs']} |")
    lines += ["", f"MCTS median / random-walk median = **{data['mcts_over_random_walk_median']}** "
                  f"(goal <= 0.5: **{'met' if data['goal_met'] else 'not met'}**); MCTS / random-tree = "
                  f"{data['mcts_over_random_tree_median']}.", "",
              "Methods, all from `Predict` with the rule proposer's vocabulary and one shared evaluation function: "
              "`mcts` = MCTS with AFlow's mixed selection (root + top-3 by score, alpha 0.2, lambda 0.3), one "
              "untried uniformly random edit of the selected node per round; `random_walk` = from the current "
              "workflow, a uniformly random valid edit, always moving; `random_tree` = the same tree search with "
              "a uniformly random node of the tree (lambda 1, no top-k); `hill_climb` = steepest ascent (score "
              "every neighbour, move to the best if it improves, stop at a local optimum)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
