"""A Workflow is a dspy.Module: DSPy's own optimizers compile it unchanged."""

import dspy
from dspy.utils import DummyLM

import flowopt
from flowopt.modules import ChainOfThought, Predict


def two_node_workflow() -> flowopt.Workflow:
    return (flowopt.Workflow("question -> answer")
            .add("draft", Predict("question -> draft"))
            .add("final", ChainOfThought("question, draft -> answer")))


def test_named_predictors_cover_every_node():
    names = [name for name, _ in two_node_workflow().named_predictors()]
    assert names == ["nodes['draft'].predict", "nodes['final'].cot.predict"]


def test_dspy_bootstrap_few_shot_compiles_a_workflow():
    lm = DummyLM([{"draft": "d", "reasoning": "r", "answer": "blue"}] * 100)
    dspy.configure(lm=lm)
    trainset = [dspy.Example(question=f"q{i}", answer="blue").with_inputs("question") for i in range(4)]
    student = two_node_workflow()
    optimizer = dspy.BootstrapFewShot(metric=lambda ex, pred, trace=None: ex.answer == pred.answer,
                                      max_bootstrapped_demos=2, max_labeled_demos=0)
    compiled = optimizer.compile(student, trainset=trainset)

    assert isinstance(compiled, flowopt.Workflow)
    draft_demos = compiled.nodes["draft"].predict.demos
    final_demos = compiled.nodes["final"].cot.predict.demos
    assert len(draft_demos) == 2 and len(final_demos) == 2
    assert final_demos[0]["answer"] == "blue" and draft_demos[0]["draft"] == "d"
    # The student is untouched and the compiled program keeps its demos through JSON.
    assert student.nodes["draft"].predict.demos == []
    reloaded = flowopt.Workflow.from_json(compiled.to_json())
    assert [d.toDict() for d in reloaded.nodes["final"].cot.predict.demos] == [d.toDict() for d in final_demos]
    assert compiled(question="new").answer == "blue"
