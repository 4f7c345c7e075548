"""LabeledFewShot and BootstrapFewShot: demos, DSPy parity, pool checkpoint reuse, budget stop."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dspy
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "compiler"))
from fakes import category_lm, demo_task_lm, exact, examples

import flowopt
from flowopt import Budget, ConfigError
from flowopt.optimizers.demos import BootstrapFewShot, LabeledFewShot


def _compile(lm, stages, **kwargs):
    kwargs.setdefault("valset", examples(6, 100))
    with dspy.context(lm=lm):
        return flowopt.compile(dspy.Predict("question -> answer"), examples(12), exact, stages=stages, quiet=True,
                               **kwargs)


def test_labeled_few_shot_puts_k_training_examples_as_demos():
    out = _compile(demo_task_lm(), [LabeledFewShot(k=3)])
    assert len(out.demos) == 3 and all(d.answer.startswith("#") for d in out.demos)
    assert {d.question for d in out.demos} <= {e.question for e in examples(12)}
    assert out.report.best_score == 1.0


def test_labeled_few_shot_matches_dspy_for_seed_0():
    train = examples(12)
    dspy_out = dspy.LabeledFewShot(k=4).compile(dspy.Predict("question -> answer"), trainset=train)
    out = _compile(demo_task_lm(), [LabeledFewShot(k=4)])
    assert [d.toDict() for d in out.demos] == [d.toDict() for d in dspy_out.demos]


def test_bootstrap_matches_dspy_bootstrap_few_shot_for_seed_0():
    train = examples(15, categories=True)
    lm = category_lm(cache=False)
    with dspy.context(lm=lm):
        ref = dspy.BootstrapFewShot(metric=exact, max_bootstrapped_demos=2, max_labeled_demos=4).compile(
            dspy.Predict("question -> answer"), trainset=train)
        out = flowopt.compile(dspy.Predict("question -> answer"), train, exact,
                              valset=examples(6, 100, categories=True),
                              stages=[BootstrapFewShot(max_bootstrapped_demos=2, max_labeled_demos=4)], quiet=True)
    assert [d.toDict() for d in out.demos] == [d.toDict() for d in ref.demos]
    assert out.report.stage("demos").info["bootstrapped"] == 2


def test_bootstrap_pays_only_for_the_examples_dspy_would_try():
    lm = demo_task_lm(cache=False)
    out = _compile(lm, [BootstrapFewShot(max_bootstrapped_demos=3, max_labeled_demos=4)], num_threads=8)
    row = out.report.stage("demos")
    assert row.info["attempts"] == 3  # every teacher run succeeds: 3 tries for 3 traces, not a batch of 8
    assert [d.get("augmented") for d in out.demos] == [True, True, True, None]


def test_bootstrap_pool_checkpoint_is_reused_on_resume(tmp_path):
    stages = [BootstrapFewShot(max_bootstrapped_demos=3, max_labeled_demos=4)]
    _compile(demo_task_lm(cache=False), stages, run_dir=tmp_path)
    pool = json.loads((tmp_path / "stages" / "00-demos" / "pool.json").read_text())
    assert sum(r["success"] for r in pool["records"]) == 3
    (tmp_path / "stages" / "00-demos" / "output.json").unlink()  # as if killed before the stage ended
    lm = demo_task_lm(cache=False)
    out = _compile(lm, stages, run_dir=tmp_path, resume=True)
    assert out.report.stage("demos").lm_calls == 6 == lm.engine.calls  # only the valset, no bootstrapping
    assert len(out.demos) == 4


def test_bootstrap_stops_cleanly_on_the_budget():
    lm = demo_task_lm(cache=False)
    out = _compile(lm, [BootstrapFewShot(max_bootstrapped_demos=4, max_labeled_demos=4)],
                   budget=Budget(max_lm_calls=8), num_threads=1)
    row = out.report.stage("demos")
    assert row.stop_reason.startswith("budget: max_lm_calls")
    assert lm.engine.calls <= 8


@pytest.mark.parametrize("make, match", [
    (lambda: LabeledFewShot(k=0), "k must be an int >= 1"),
    (lambda: BootstrapFewShot(max_bootstrapped_demos=-1), "max_bootstrapped_demos must be an int >= 0"),
    (lambda: BootstrapFewShot(max_labeled_demos=2.5), "max_labeled_demos must be an int"),
    (lambda: BootstrapFewShot(metric_threshold="high"), "metric_threshold must be a number"),
])
def test_settings_checks_say_how_to_fix(make, match):
    with pytest.raises(ConfigError, match=match) as info:
        make()
    assert "pass" in str(info.value)
