"""The ``structure`` stage inside ``flowopt.compile``, its budget, and the LM-based proposer."""

from __future__ import annotations

import json
import random
import re

import dspy
import pytest

import flowopt
from flowopt import ConfigError
from flowopt.modules import Predict
from flowopt.optimizers.structure import (
    LMProposer,
    NoProposal,
    ProposalContext,
    StructureSearch,
    Vocabulary,
)
from flowopt.testing import scripted_lm


def _adder(req):
    """Sums the numbers of the question. Without demos it answers in a sentence (the metric wants the
    bare number); without a reasoning field it gets sums of 50 or more wrong. So demos fix the format
    and chain of thought (or an ensemble of it) fixes the hard questions."""
    gold = sum(int(x) for x in re.findall(r"\d+", req.inputs.get("question", "")))
    value = gold if ("reasoning" in req.output_fields or gold < 50) else gold + 1
    answer = str(value) if req.demos else f"The answer is {value}"
    known = {"answer": answer, "reasoning": "add them", "code": f"print({value})", "is_correct": True,
             "feedback": "ok", "best_index": 0}
    return {f: known.get(f, answer) for f in req.output_fields}


def _task():
    train = [dspy.Example(question=f"What is {a} + {a * 3 % 40}?", answer=str(a + a * 3 % 40)).with_inputs("question")
             for a in range(3, 43, 2)]
    wf = flowopt.Workflow("question -> answer", name="add").add("solve", Predict("question -> answer"))
    return wf, train


def _metric(ex, pred, trace=None):
    return float(str(pred.answer).strip() == ex.answer)


def test_compile_demos_search_structure_shows_each_stage(tmp_path):
    wf, train = _task()
    with dspy.context(lm=scripted_lm(_adder)):
        best = flowopt.compile(wf, train, _metric, run_dir=tmp_path, quiet=True,
                               stages=["demos", ("search", {"n_candidates": 2}), ("structure", {"max_rounds": 4})])
    report = best.report
    baseline, demos, structure = report.stage("baseline"), report.stage("demos"), report.stage("structure")
    assert baseline.score == 0.0
    assert demos.score > baseline.score and demos.kept
    assert structure.kept and structure.score == 1.0 and structure.change > 0
    assert report.best_score == 1.0
    info = structure.info
    assert structure.candidates_tried >= 2 and structure.stop_reason == "max_rounds (4)"
    assert info["edits"] and len(info["tree"]["nodes"]) == structure.candidates_tried
    # The winner keeps the demos stage's demos and runs "solve" with reasoning.
    assert type(best.nodes["solve"]).op_name in ("ChainOfThought", "ScEnsemble")
    assert any(p["demos"] for n in best.to_dict()["nodes"] for p in n["predictors"].values())
    stage_dir = next((tmp_path / "stages").glob("*-structure"))
    assert (stage_dir / "tree.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((stage_dir / "tree.json").read_text())["round"] == 4
    with dspy.context(lm=scripted_lm(_adder)):
        assert best(question="What is 40 + 30?").answer == "70"


def test_structure_stage_respects_the_budget():
    wf, train = _task()
    budget = flowopt.Budget(max_lm_calls=60)
    with dspy.context(lm=scripted_lm(_adder)):
        best = flowopt.compile(wf, train, _metric, quiet=True, budget=budget,
                               stages=[("structure", {"max_rounds": 50, "convergence_rounds": None})])
    row = best.report.stage("structure")
    assert row.stop_reason.startswith("budget"), row.stop_reason
    total = sum(r.lm_calls or 0 for r in best.report.stages)
    assert total <= 60


def test_structure_needs_a_workflow():
    with pytest.raises(ConfigError, match="Workflow"), dspy.context(lm=scripted_lm(_adder)):
        flowopt.compile(dspy.Predict("question -> answer"), _task()[1], _metric, quiet=True, stages=["structure"])


@pytest.mark.parametrize(("settings", "match"), [
    ({"proposer": "oracle"}, "proposer"), ({"split": "test"}, "split"), ({"selection": "best"}, "selection"),
    ({"max_examples": 0}, "max_examples"), ({"edit_kinds": ("teleport",)}, "unknown edit kinds"),
])
def test_stage_settings_are_checked(settings, match):
    with pytest.raises(ConfigError, match=match):
        StructureSearch(**settings)


class _ScriptedOptimizer:
    """An optimizer LM that answers a fixed list of edit objects, one per call, and records prompts."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests = []

    def __call__(self, req):
        self.requests.append(req)
        return {"edit": json.dumps(self.answers[min(len(self.requests), len(self.answers)) - 1])}


def test_lm_proposer_rejects_invalid_proposals_with_reasons_then_accepts():
    wf, _ = _task()
    script = _ScriptedOptimizer([{"kind": "swap_operator", "node": "nope", "op": "ChainOfThought"},
                                 {"kind": "teleport", "node": "solve"},
                                 {"kind": "wrap_ensemble", "node": "solve", "n": 3}])
    proposer = LMProposer(scripted_lm(script, cache=False), max_attempts=3, fallback=None)
    context = ProposalContext(score=0.25, failures=[{"question": "What is 40 + 30?", "answer": "70"}],
                              tried=[{"edit": {"kind": "swap_operator", "node": "solve", "op": "ChainOfThought"},
                                      "delta": 0.1}])
    proposal = proposer.propose(wf, context, random.Random(0))
    assert proposal.edit.to_dict() == {"kind": "wrap_ensemble", "node": "solve", "n": 3}
    assert type(proposal.workflow.nodes["solve"]).op_name == "ScEnsemble"
    assert [r["reason"][:20] for r in proposal.rejected] == ["no node 'nope' (node", "unknown kind 'telepo"]
    first, last = script.requests[0], script.requests[-1]
    assert "What is 40 + 30?" in first.inputs["failing_examples"]
    assert '"delta": 0.1' in first.inputs["tried_edits"]
    assert "wrap_ensemble(node, n)" in first.inputs["vocabulary"]
    assert "unknown kind" in last.inputs["rejected"]  # the LM is told why its last answers were refused


def test_lm_proposer_gives_up_after_bounded_attempts():
    wf, _ = _task()
    tried = {"kind": "swap_operator", "node": "solve", "op": "ChainOfThought"}
    script = _ScriptedOptimizer([tried])
    proposer = LMProposer(scripted_lm(script, cache=False), max_attempts=2, fallback=None)
    with pytest.raises(NoProposal, match="2 attempts"):
        proposer.propose(wf, ProposalContext(score=0.0, tried=[{"edit": tried, "delta": 0.0}]), random.Random(0))
    assert len(script.requests) == 2
    fallback = LMProposer(scripted_lm(_ScriptedOptimizer([tried]), cache=False), max_attempts=1,
                          vocabulary=Vocabulary(kinds=("wrap_ensemble",)))
    proposal = fallback.propose(wf, ProposalContext(score=0.0, tried=[{"edit": tried, "delta": 0.0}]),
                                random.Random(0))
    assert proposal.edit.kind == "wrap_ensemble"
    assert "already tried" in proposal.rejected[0]["reason"]


def test_lm_proposer_drives_the_stage():
    wf, train = _task()
    script = _ScriptedOptimizer([{"kind": "swap_operator", "node": "solve", "op": "ChainOfThought"}])
    with dspy.context(lm=scripted_lm(_adder)):
        best = flowopt.compile(wf, train, _metric, quiet=True, stages=[
            "labeled", ("structure", {"proposer": "lm", "optimizer_lm": scripted_lm(script, cache=False),
                                      "max_rounds": 2})])
    info = best.report.stage("structure").info
    assert info["edit_descriptions"][0] == "swap solve to ChainOfThought"
    assert best.report.best_score == 1.0


def test_the_stage_holds_its_search_settings_and_takes_them_by_name_too():
    from flowopt.optimizers.structure import SearchSettings

    by_name = StructureSearch(max_rounds=7, selection="uct", proposer="rule")
    assert by_name.search == SearchSettings(max_rounds=7, selection="uct", final_top=3)  # the stage's default finals
    assert StructureSearch(search=SearchSettings(max_rounds=7, selection="uct", final_top=3)) == by_name
    assert StructureSearch(search={"max_rounds": 7, "selection": "uct"}) == by_name
    assert StructureSearch(**by_name.settings()).settings() == by_name.settings()  # flat and JSON-able, as passed
    assert by_name.max_rounds == 7 and by_name.selection == "uct"  # and read by name
    with pytest.raises(AttributeError):
        by_name.rounds  # noqa: B018
    with pytest.raises(ConfigError, match="SearchSettings"):
        StructureSearch(search=5)
    with pytest.raises(ConfigError, match="max_rounds"):
        StructureSearch(max_rounds=0)
    with pytest.raises(TypeError, match="unexpected settings"):
        StructureSearch(rounds=3)
