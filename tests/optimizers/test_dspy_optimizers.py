"""The ``mipro`` and ``gepa`` stages: DSPy's optimizers inside compile(), counted and capped by the budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dspy
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "compiler"))
from fakes import exact, examples, reverse_answer

import flowopt
from flowopt import ConfigError
from flowopt.compiler import Budget, BudgetTracker
from flowopt.optimizers.dspy_optimizers import GEPAStage, MIPROStage
from flowopt.testing import scripted_lm

TRAIN, VAL = examples(12), examples(10, 100)
KEY = "Reverse the question and prefix it with #."


def _answer(req):
    """Task calls are right only under the key instruction; any other prompt (MIPRO's proposer,
    GEPA's reflection) gets the key instruction back."""
    if req.output_fields == ["answer"] and "question" in req.inputs:
        q = req.inputs["question"]
        return {"answer": reverse_answer(q) if KEY in req.system else q}
    if "JSON" in req.system:  # GEPA's reflection goes through DSPy's JSONAdapter
        return json.dumps({name: KEY for name in req.output_fields})
    return {name: KEY for name in req.output_fields}


def _compile(stage, lm, **kwargs):
    with dspy.context(lm=lm):
        return flowopt.compile(dspy.Predict("question -> answer"), TRAIN, exact, valset=VAL, stages=[stage],
                               quiet=True, num_threads=2, **kwargs)


def test_dspy_threads_keep_counting_into_the_budget():
    # DSPy's ParallelExecutor deep-copies the usage tracker per thread; the copy must still count
    # into the same budget and must not break the call (it made every Evaluate score 0 before).
    lm = scripted_lm(lambda req: {"answer": reverse_answer(req.inputs["question"])}, cache=False)
    tracker = BudgetTracker(Budget(max_lm_calls=1000))
    with tracker.activate(), dspy.context(lm=lm):
        result = dspy.Evaluate(devset=VAL, metric=exact, num_threads=4)(dspy.Predict("question -> answer"))
    assert result.score == 100.0
    assert tracker.usage()["lm_calls"] == lm.engine.calls == len(VAL)


def test_gepa_stage_finds_the_instruction_and_counts_every_call():
    lm = scripted_lm(_answer, cache=False, model="scripted/gepa")
    out = _compile(GEPAStage(max_metric_calls=40, use_merge=False), lm)
    row = out.report.stage("gepa")
    assert out.report.baseline_score == 0.0 and row.score == 1.0 and row.kept
    assert KEY in out.signature.instructions
    assert out.report.total["lm_calls"] == lm.engine.calls  # reflection calls included


def test_mipro_stage_runs_and_counts_every_call():
    lm = scripted_lm(_answer, cache=False, model="scripted/mipro")
    out = _compile(MIPROStage(auto=None, num_trials=3, max_bootstrapped_demos=0, max_labeled_demos=0), lm)
    row = out.report.stage("mipro")
    assert row.candidates_tried >= 1 and row.info["dspy_lm_calls"] > 0
    assert row.score == 1.0 and KEY in out.signature.instructions  # the proposer's instruction won
    assert out.report.total["lm_calls"] == lm.engine.calls


@pytest.mark.parametrize("stage", [MIPROStage(auto=None, num_trials=3), GEPAStage(max_metric_calls=200)])
def test_budget_caps_dspy_optimizers(stage):
    lm = scripted_lm(_answer, cache=False, model=f"scripted/cap-{stage.name}")
    out = _compile(stage, lm, budget=Budget(max_lm_calls=25))
    assert lm.engine.calls <= 25
    assert out.report.stage(stage.name).stop_reason.startswith("budget")


def test_stages_are_registered_by_name():
    from flowopt.compiler.stages import resolve_stages

    mipro, gepa = resolve_stages([("mipro", {"auto": "light"}), ("gepa", {"max_metric_calls": 50})])
    assert isinstance(mipro, MIPROStage) and isinstance(gepa, GEPAStage)


@pytest.mark.parametrize("make, match", [
    (lambda: MIPROStage(auto="huge"), "auto must be one of"),
    (lambda: MIPROStage(auto=None), "needs auto or num_trials"),
    (lambda: GEPAStage(auto="light", max_metric_calls=10), "takes one of"),
    (lambda: GEPAStage(max_metric_calls=0), "max_metric_calls must be an int >= 1"),
])
def test_bad_settings_say_how_to_fix(make, match):
    with pytest.raises(ConfigError, match=match):
        make()
