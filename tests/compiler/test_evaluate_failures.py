"""Failed examples: an unparseable answer is a wrong answer (score 0); other failures stop past max_errors."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import dspy
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fakes import exact, examples, reverse_answer

import flowopt
from flowopt.compiler import Evaluator
from flowopt.errors import LMError
from flowopt.optimizers.search import RandomSearch
from flowopt.testing import scripted_lm

NO_FIELDS = "I think the answer might be"  # a small model's rambling: no field the adapter can read


def _evaluate(answer, n=30):
    with dspy.context(lm=scripted_lm(answer, cache=False)):
        return Evaluator(exact, num_threads=2, quiet=True).evaluate(dspy.Predict("question -> answer"), examples(n))


def test_unparseable_answers_score_zero_and_never_stop_the_evaluation():
    # 20 of 30 unparseable: twice the default limit (max(10, n // 2) = 15) of other failures.
    def answer(req):
        question = re.match(r"word\d+", req.inputs["question"]).group()  # DSPy's JSON retry adds text
        return NO_FIELDS if int(question[4:]) % 3 else {"answer": reverse_answer(question)}

    result = _evaluate(answer)
    assert len(result.scores) == 30 and result.errors == 20
    assert result.scores == [1.0 if i % 3 == 0 else 0.0 for i in range(30)]


def test_other_failures_past_max_errors_stop_the_evaluation():
    def broken(req):
        raise ConnectionError("the server went away")

    with pytest.raises(LMError, match=r"evaluation stopped: 1[6-7] examples failed \(max_errors=15\)") as info:
        _evaluate(broken)
    assert "raise max_errors" in info.value.fix


def test_a_candidate_a_small_model_cannot_parse_does_not_fail_the_search(tmp_path):
    """The zero-shot candidate gets no parseable answer on the first look's 20 examples (the bug: the
    whole search stopped with 'evaluation stopped'); with demos the answers parse and are right."""

    def answer(req):
        if not req.demos:
            return NO_FIELDS
        return {"answer": reverse_answer(req.inputs["question"])}

    stage = RandomSearch(n_candidates=4, seeded=1, max_demos=2, max_labeled_demos=2)
    with dspy.context(lm=scripted_lm(answer, cache=False)):
        out = flowopt.compile(dspy.Predict("question -> answer"), examples(15), exact, valset=examples(40, 100),
                              stages=[stage], quiet=True, num_threads=2, run_dir=tmp_path)
    search = out.report.stage("search")
    assert not search.stop_reason.startswith("error"), search.stop_reason
    assert out.report.baseline_score == 0.0 and out.report.best_score == 1.0
