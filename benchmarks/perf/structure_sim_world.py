"""The simulated world of ``structure_search_sim``: the task's accuracy model (what each workflow would
score), the space of workflows the edits reach, and a scripted LM that behaves as the model says (to
check the model through DSPy).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import tempfile
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("DSPY_CACHEDIR", tempfile.mkdtemp(prefix="flowopt-sim-dspy-"))

import dspy

from flowopt import Workflow
from flowopt.modules import Predict
from flowopt.optimizers.structure import InvalidEdit, RuleProposer, Vocabulary
from flowopt.optimizers.structure.edits import SELECT_INSTRUCTION
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
            right = number_in(ins.get("attempt", "")) == gold
            flags = self.coin(P_FALSE_ALARM if right else P_CATCH, req, "review")
            return {"feedback": "recheck the arithmetic" if flags else "looks right", "is_correct": not flags}
        if "feedback" in ins:  # Refine revision of a flagged attempt
            attempt = number_in(ins.get("attempt", ""))
            fixable = hash_coin(P_FIXABLE, "fixable", q)
            ok = (not self.coin(P_BREAK, req, "break")) if attempt == gold else (
                fixable and self.coin(P_FIX, req, "fix"))
            return {"reasoning": "revised", "answer": str(gold if ok else gold + 1)}
        if "code" in outs:  # Programmer: one program per question (same prompt, temperature 0)
            ok = hash_coin(P_CODE[kind], "code", q)
            return {"reasoning": "compute it", "code": f"print({gold if ok else gold + 2})"}
        if "draft_answer" in ins:  # Refine's first draft keeps the upstream answer
            return {"reasoning": "start from the draft", "answer": ins["draft_answer"]}
        if "program_answer" in ins:  # the selector
            program, candidate = ins["program_answer"].strip(), ins.get("candidate_answer", "")
            first, second = (program, candidate) if kind == "arith" and program else (candidate, program)
            return {"answer": second if second and self.coin(P_SELECT_SLIP, req, "slip") else first}
        op = "ChainOfThought" if "reasoning" in outs else "Predict"
        ok = self.coin(P_ANSWER[op][kind], req, op) if (req.temperature or 0) > 0 else hash_coin(
            P_ANSWER[op][kind], op, q)
        return {**({"reasoning": "steps"} if op == "ChainOfThought" else {}), "answer": str(gold if ok else gold + 1)}


def hash_coin(p: float, *parts: Any) -> bool:
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < p


def number_in(text: str) -> int | None:
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
        return float(number_in(pred.answer) == int(ex.answer))

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
