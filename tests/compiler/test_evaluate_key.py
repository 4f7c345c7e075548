"""The evaluation memo keys on everything that changes behaviour, including the LMs behind the program."""

import dspy

from flowopt.compiler.evaluate import Evaluator, program_key
from flowopt.testing import scripted_lm


def test_program_key_changes_with_the_lms_behind_the_program():
    program = dspy.Predict("question -> answer")
    first, second = scripted_lm(lambda r: {"answer": "a"}, model="scripted/a"), scripted_lm(
        lambda r: {"answer": "b"}, model="scripted/b")
    with dspy.context(lm=first):
        ambient_first = program_key(program)
    with dspy.context(lm=second):
        ambient_second = program_key(program)
    assert ambient_first != ambient_second
    program.lm = first
    bound = program_key(program)
    assert bound not in (ambient_first, ambient_second)


def test_evaluator_does_not_reuse_a_score_across_lms():
    examples = [dspy.Example(question="q", answer="b").with_inputs("question")]
    evaluator = Evaluator(lambda ex, pred, trace=None: float(pred.answer == ex.answer), num_threads=1)
    program = dspy.Predict("question -> answer")
    with dspy.context(lm=scripted_lm(lambda r: {"answer": "a"}, model="scripted/a")):
        assert evaluator.evaluate(program, examples).score == 0.0
    with dspy.context(lm=scripted_lm(lambda r: {"answer": "b"}, model="scripted/b")):
        assert evaluator.evaluate(program, examples).score == 1.0
