"""Bad input gets a clear flowopt error, before LM calls where possible, and run_dir stays sound."""

from __future__ import annotations

import json

import dspy
import pytest
from fakes import demo_task_lm, exact, examples

import flowopt
from flowopt import Budget, BudgetExhausted, ConfigError, DataError, MetricError
from flowopt.modules import Predict


def _run_dir_is_sound(path):
    assert not [p for p in path.rglob("*.tmp")], "half-written files left behind"
    for p in path.rglob("*.json"):
        json.loads(p.read_text())


def test_empty_trainset():
    with pytest.raises(DataError, match="trainset is empty"):
        flowopt.compile(dspy.Predict("question -> answer"), [], exact, quiet=True)


def test_single_example_without_valset():
    with pytest.raises(DataError, match="nothing is left to validate"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(1), exact, quiet=True)


def test_example_missing_a_program_input(tmp_path):
    wf = flowopt.chain("question -> answer", Predict("question -> answer"))
    bad = [*examples(3), dspy.Example(query="x", answer="y").with_inputs("query")]
    lm = demo_task_lm()
    with dspy.context(lm=lm), pytest.raises(DataError, match=r"trainset\[3\] has no field 'question'"):
        flowopt.compile(wf, bad, exact, quiet=True, run_dir=tmp_path / "r")
    assert lm.engine.calls == 0


def test_examples_without_inputs_for_a_plain_module():
    with pytest.raises(DataError, match="with_inputs"):
        flowopt.compile(dspy.Predict("question -> answer"), [dspy.Example(question="q", answer="a")] * 3, exact)


def test_metric_that_raises_names_the_example(tmp_path):
    def metric(example, pred, trace=None):
        return example.label == pred.answer  # no 'label' field

    with dspy.context(lm=demo_task_lm()), pytest.raises(MetricError, match=r"example #\d+ \(.*word"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), metric, quiet=True, run_dir=tmp_path / "r")
    _run_dir_is_sound(tmp_path / "r")


def test_metric_returning_a_non_number():
    with dspy.context(lm=demo_task_lm()), pytest.raises(MetricError, match="returned 'yes'"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), lambda e, p, t=None: "yes", quiet=True)


def test_unknown_stage_name_lists_known_ones():
    with pytest.raises(ConfigError, match=r"unknown stage 'demoz'.*'demos'"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(4), exact, stages=["demoz"])


@pytest.mark.parametrize("spec, match", [
    (("demos", {"max_bootstrapped_demos": -1}), "max_bootstrapped_demos must be an int >= 0"),
    (("search", {"sampler": "grid"}), "sampler must be one of"),
    (("demos", {"nonsense": 1}), "bad settings for stage 'demos'"),
])
def test_bad_stage_settings(spec, match):
    with pytest.raises(ConfigError, match=match):
        flowopt.compile(dspy.Predict("question -> answer"), examples(4), exact, stages=[spec])


def test_bad_budget_values():
    with pytest.raises(ConfigError, match="max_lm_calls must be a number >= 0"):
        Budget(max_lm_calls=-1)
    with pytest.raises(ConfigError, match="whole number"):
        Budget(max_tokens=1.5)


def test_budget_already_exhausted_raises_and_leaves_run_dir_sound(tmp_path):
    lm = demo_task_lm()
    with dspy.context(lm=lm), pytest.raises(BudgetExhausted, match="max_lm_calls used 0 of 0"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, budget=Budget(max_lm_calls=0),
                        quiet=True, run_dir=tmp_path / "r")
    assert lm.engine.calls == 0
    _run_dir_is_sound(tmp_path / "r")


def test_run_dir_reuse_needs_resume_and_same_settings(tmp_path):
    lm = demo_task_lm()
    with dspy.context(lm=lm):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, stages=["labeled"], quiet=True,
                        run_dir=tmp_path)
        with pytest.raises(ConfigError, match="resume=True"):
            flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, stages=["labeled"],
                            run_dir=tmp_path)
        with pytest.raises(ConfigError, match="differs in: seed"):
            flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, stages=["labeled"],
                            run_dir=tmp_path, resume=True, seed=1)
    _run_dir_is_sound(tmp_path)
