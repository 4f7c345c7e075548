"""The default search (iterated local search: first-improvement climbs, restarts from the incumbent's
neighbourhood), the score/cost Pareto objective and picking a point of the front, and the settings check."""

from __future__ import annotations

import random
import re
from pathlib import Path

import dspy
import pytest

import flowopt
from flowopt import ConfigError
from flowopt.compiler import CompileReport, StageReport
from flowopt.modules import Predict
from flowopt.optimizers.structure import (
    MCTS,
    Evaluation,
    RuleProposer,
    SearchSettings,
    SearchTree,
    StructureSearch,
    Vocabulary,
    pick,
    pick_point,
)
from flowopt.optimizers.structure.selection import neighbourhood, select_climb
from flowopt.testing import scripted_lm

from .conftest import single

VOCAB = Vocabulary(kinds=("swap_operator", "wrap_ensemble", "add_refine", "add_programmer", "remove_node"),
                   ensemble_sizes=(3, 5), refine_rounds=(1,), max_nodes=4)


def _deceptive(wf) -> float:
    """An ensemble alone and a Programmer branch alone each cost 0.04; together they gain 0.30. Every
    other edit only costs: the start (0.50) is a local optimum that no single edit leaves upwards."""
    ops = {type(op).op_name for op in wf.nodes.values()}
    ensemble, branch = "ScEnsemble" in ops, "Programmer" in ops  # AddProgrammer adds it with its selector
    if ensemble and branch:
        return 0.80 - 0.01 * (len(wf.nodes) - 3)
    return 0.50 - 0.04 * (ensemble + branch) - 0.05 * (len(wf.nodes) - 1 - 2 * branch) - 0.02 * (
        "ChainOfThought" in ops)


@pytest.mark.parametrize("seed", range(3))
def test_climb_crosses_a_valley_that_no_single_edit_crosses(seed):
    settings = SearchSettings(max_rounds=1000, max_evaluations=80, convergence_rounds=None)
    result = MCTS(RuleProposer(VOCAB), _deceptive, settings, seed=seed).run(single())
    assert result.best_score >= 0.79  # ensemble and Programmer branch together
    assert all(_deceptive(result.best) >= n.score for n in result.tree.nodes)


def test_climb_moves_on_first_improvement_and_restarts_near_the_incumbent():
    def score(wf):
        return 0.1 * len(wf.nodes) + 0.05 * ("ChainOfThought" in {type(op).op_name for op in wf.nodes.values()})

    result = MCTS(RuleProposer(VOCAB), score, SearchSettings(max_rounds=25, convergence_rounds=None), seed=0).run(
        single())
    tree = result.tree
    for event in result.log:
        if event.get("event") != "expand":
            continue
        parent, child = tree.nodes[event["parent"]], tree.nodes[event["child"]]
        # After an improving child the climb goes on from it (or from a later, better, child of it).
        later = [e for e in result.log if e.get("event") == "expand" and e["round"] > event["round"]]
        if child.score > parent.score and later and later[0]["parent"] == parent.id:
            pytest.fail(f"node {parent.id} was expanded again after its child {child.id} improved on it")
    assert result.best_score == max(n.score for n in tree.nodes)


def test_select_climb_restarts_from_the_nearest_open_node_of_the_incumbent():
    tree = SearchTree()
    tree.add(None, None, "root", "k0", {}, score=0.3)
    tree.add(0, {"kind": "a"}, "a", "k1", {}, score=0.5)   # the incumbent
    tree.add(1, {"kind": "b"}, "b", "k2", {}, score=0.2)   # its child
    tree.add(0, {"kind": "c"}, "c", "k3", {}, score=0.4)   # two edits away from it (via the root)
    for node in tree.nodes:
        node.value = node.score
    tree.nodes[1].exhausted = True
    assert [[n.id for n in ring] for ring in neighbourhood(tree, 1)] == [[0, 2], [3]]
    picks = {select_climb(tree, random.Random(s), [1]).id for s in range(30)}
    assert picks == {0, 2}  # the ring nearest the incumbent, never node 3 while those are open
    tree.nodes[0].exhausted = tree.nodes[2].exhausted = True
    climb = [1]
    assert select_climb(tree, random.Random(0), climb).id == 3 and climb == [3]


def _costly(wf) -> Evaluation:
    """Bigger is better and dearer: an ensemble n costs n calls, anything else one call."""
    calls = sum(getattr(op, "n", 1) for op in wf.nodes.values())
    return Evaluation(min(0.3 + 0.1 * calls, 1.0) - 0.02 * len(wf.nodes), cost={"lm_calls": float(calls)})


def test_pareto_front_is_non_dominated_and_pick_respects_the_limit():
    settings = SearchSettings(max_rounds=30, convergence_rounds=None, objective="pareto")
    result = MCTS(RuleProposer(VOCAB), _costly, settings, seed=0).run(single())
    front = result.front()
    assert len(front) >= 3
    calls = [p["lm_calls"] for p in front]
    assert calls == sorted(calls) and [p["score"] for p in front] == sorted(p["score"] for p in front)
    scored = result.tree.scored()
    for point in front:  # nothing scored beats a front point on both score and calls
        assert not any(n.score > point["score"] and n.cost["lm_calls"] <= point["lm_calls"] for n in scored)
    for limit in (1.0, 3.0, 6.0):
        chosen = result.pick(max_calls=limit)
        evaluation = _costly(chosen)
        assert evaluation.cost["lm_calls"] <= limit
        best_within = max(n.score for n in scored if n.cost["lm_calls"] <= limit)
        assert evaluation.score == pytest.approx(best_within)
    with pytest.raises(ConfigError, match="no point of the front fits"):
        result.pick(max_calls=0.5)


def test_pareto_needs_a_cost_and_pick_needs_a_front():
    with pytest.raises(ConfigError, match="lm_calls"):
        MCTS(RuleProposer(VOCAB), lambda wf: 0.5, SearchSettings(max_rounds=2, objective="pareto")).run(single())
    with pytest.raises(ConfigError, match="no score/cost front"):
        pick_point([], max_calls=1)


def _metric(ex, pred, trace=None):
    return float(str(pred.answer).strip() == ex.answer)


def _reasoning_helps(req):
    """Right on questions i < 8 without reasoning, on every question with it (an ensemble votes it in)."""
    i = int(re.findall(r"\d+", req.inputs["question"])[0])
    right = "reasoning" in req.output_fields or i < 8
    return {"reasoning": "step by step", "answer": str(i + 1 if right else i + 2)}


def test_pareto_through_compile_and_pick(tmp_path):
    wf = flowopt.Workflow("question -> answer", name="one").add("solve", Predict("question -> answer"))
    train = [dspy.Example(question=f"q{i}: {i} + 1?", answer=str(i + 1)).with_inputs("question") for i in range(16)]
    stage = StructureSearch(max_rounds=12, convergence_rounds=None, objective="pareto", final_top=0,
                            edit_kinds=("swap_operator", "wrap_ensemble"), ensemble_sizes=(3,))
    lm = scripted_lm(_reasoning_helps, model=f"scripted/pareto-{random.random()}")
    with dspy.context(lm=lm):
        best = flowopt.compile(wf, train, _metric, quiet=True, run_dir=tmp_path, stages=[stage])
    report = best.report.stage("structure")
    front = report.info["pareto_front"]
    assert front and all("workflow" in p for p in front)
    assert report.info["pareto_picture"].endswith("pareto.png") and Path(report.info["pareto_picture"]).is_file()
    # One LM call a question: ChainOfThought (right everywhere) beats Predict; the ensemble costs 3.
    cheap = pick(best, max_calls=1.0)
    assert type(cheap.nodes["solve"]).op_name == "ChainOfThought"
    with dspy.context(lm=lm):
        assert cheap(question="q12: 12 + 1?").answer == "13"
    with pytest.raises(ConfigError, match="no point of the front fits"):
        pick(best, max_calls=0.5)
    with pytest.raises(ConfigError, match='objective="pareto"'):  # a front without workflows
        pick(CompileReport(stages=[StageReport("structure", info={"pareto_front": [{"score": 1, "lm_calls": 1}]})]))


@pytest.mark.parametrize(("settings", "match"), [
    ({"max_rounds": 2.5}, "SearchSettings max_rounds must be an int >= 1, got 2.5"),
    ({"confirm": True}, "confirm must be an int >= 1, got True"),
    ({"explore": float("nan")}, "NaN and infinity are refused"),
    ({"objective": "cheap"}, "objective must be one of"),
    ({"widen": 0.0}, "widen must be a number > 0"),
    ({"max_evaluations": 0}, "max_evaluations must be an int >= 1 or None"),
])
def test_search_settings_use_the_shared_validator(settings, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        SearchSettings(**settings)


def test_auto_selection_climbs_without_noise_and_goes_best_first_under_confirmation():
    # Under noise (leaders re-measured, confirm > 1) a first-improvement climb follows one lucky
    # measurement: "auto" searches best-first there, and climbs otherwise; an explicit choice stands.
    assert SearchSettings().resolved_selection() == "climb"
    assert SearchSettings(confirm=3).resolved_selection() == "best_first"
    assert SearchSettings(confirm=3, selection="climb").resolved_selection() == "climb"
    assert StructureSearch().search.resolved_selection() == "climb"

    def noisy(seed: int):
        rng = random.Random(seed)

        def evaluate(wf):
            p = _deceptive(wf)
            k = sum(rng.random() < p for _ in range(30))
            return Evaluation(k / 30, scores=[1.0] * k + [0.0] * (30 - k))
        return evaluate

    def events(selection: str) -> list[tuple[str, float]]:
        settings = SearchSettings(max_rounds=200, max_evaluations=40, convergence_rounds=None, confirm=3,
                                  selection=selection)
        result = MCTS(RuleProposer(VOCAB), noisy(7), settings, seed=7).run(single())
        return [(e["event"], e.get("child")) for e in result.log]

    assert events("auto") == events("best_first") != events("climb")
