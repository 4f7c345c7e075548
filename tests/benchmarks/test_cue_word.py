"""The cue -> word toy task shared by the weights tests and the perf scripts."""

import dspy

from flowopt.benchmarks import cue_word
from flowopt.testing import ScriptedRequest


def test_examples_are_seeded_and_labelled_by_the_code_book():
    first, again = cue_word.make_examples(20, seed=3), cue_word.make_examples(20, seed=3)
    assert [ex.toDict() for ex in first] == [ex.toDict() for ex in again]
    assert [ex.toDict() for ex in first] != [ex.toDict() for ex in cue_word.make_examples(20, seed=4)]
    for ex in first:
        assert ex.word == cue_word.ANIMALS[cue_word.COLORS.index(ex.cue)]
        assert set(ex.inputs().keys()) == {"noise", "cue"}
        assert all(w in cue_word.NOISE for w in ex.noise.split())
    wide = cue_word.make_examples(50, seed=0, noise=cue_word.NOISE + cue_word.MORE_NOISE)
    assert any(w in cue_word.MORE_NOISE for ex in wide for w in ex.noise.split())


def test_strict_and_loose_metrics():
    ex = dspy.Example(noise="sun moon", cue="blue", word="dog").with_inputs("noise", "cue")
    assert cue_word.metric(ex, dspy.Prediction(word="dog cat")) == 1.0
    assert cue_word.metric(ex, dspy.Prediction(word="Dog.")) == 0.0
    assert cue_word.loose_metric(ex, dspy.Prediction(word="Dog.")) == 1.0
    assert cue_word.loose_metric(ex, dspy.Prediction(word=". dog")) == 1.0
    assert cue_word.metric(ex, dspy.Prediction(word=". dog")) == 0.0
    assert cue_word.metric(ex, dspy.Prediction(word="")) == 0.0 == cue_word.loose_metric(ex, dspy.Prediction())


def test_oracle_answers_the_cue():
    request = ScriptedRequest(system="", messages=[], inputs={"cue": "gold", "noise": "x y"}, output_fields=["word"],
                              temperature=None)
    assert cue_word.oracle(request) == {"word": "bee"}
