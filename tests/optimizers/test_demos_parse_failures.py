"""An unparseable answer from a small model is a failed trace (score 0), not a bootstrap abort."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import dspy

sys.path.insert(0, str(Path(__file__).parents[1] / "compiler"))
from fakes import exact, examples, reverse_answer

import flowopt
from flowopt.optimizers.demos import BootstrapFewShot
from flowopt.testing import scripted_lm


def _mostly_unparseable_lm(parseable: set[str]):
    """Right (and well-formed) on the questions in ``parseable``; free text without fields elsewhere."""

    def answer(req):
        q = req.inputs.get("question", "")
        return {"answer": reverse_answer(q)} if q in parseable else "I think the answer is maybe something"

    return scripted_lm(answer, model=f"scripted/{uuid.uuid4().hex[:10]}")


def test_parse_failures_are_failed_traces_and_counted():
    train = examples(24)
    lm = _mostly_unparseable_lm({train[3].question, train[17].question})
    with dspy.context(lm=lm):
        out = flowopt.compile(dspy.Predict("question -> answer"), train, exact, valset=examples(4, 100),
                              stages=[BootstrapFewShot(max_bootstrapped_demos=4, max_labeled_demos=4)], quiet=True)
    stage = out.report.stages[-1]
    assert stage.name == "demos" and stage.stop_reason == "done", stage
    # 22 of 24 answers did not parse: all 24 were tried, the two good ones were bootstrapped.
    assert stage.info["attempts"] == 24 and stage.info["parse_failures"] == 22
    assert stage.info["bootstrapped"] == 2
