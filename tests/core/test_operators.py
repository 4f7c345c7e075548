"""Each operator's behaviour with a scripted LM, and the registry."""

import dspy
import pytest

import flowopt
from flowopt import ConfigError, SandboxError
from flowopt.modules import ChainOfThought, Custom, Predict, Programmer, Refine, Retrieve, ScEnsemble
from flowopt.registry import get_operator, operator_names
from flowopt.testing import scripted_lm


def test_registry_finds_builtins_and_user_operators():
    assert {"Predict", "ChainOfThought", "ScEnsemble", "Refine", "Programmer", "Retrieve", "Custom"} <= set(
        operator_names())

    @flowopt.register_operator
    class Upper(flowopt.Operator):
        op_name = "Upper"

        def __init__(self, signature="text -> loud", instructions=None):
            super().__init__(signature, instructions)

        def forward(self, text):
            return dspy.Prediction(loud=text.upper())

    assert get_operator("Upper") is Upper
    wf = flowopt.Workflow("text -> loud").add("up", Upper())
    assert flowopt.Workflow.from_json(wf.to_json())(text="hi").loud == "HI"


def test_predict_and_chain_of_thought_pass_temperature_and_reasoning():
    seen = []

    def answer(request):
        seen.append((request.temperature, request.output_fields))
        return {"reasoning": "because", "answer": "4"}

    dspy.configure(lm=scripted_lm(answer, cache=False))
    assert Predict("question -> answer", temperature=0.3)(question="2+2").answer == "4"
    cot = ChainOfThought("question -> answer")(question="2+2")
    assert cot.answer == "4" and cot.reasoning == "because"
    assert seen == [(0.3, ["answer"]), (None, ["reasoning", "answer"])]


def test_custom_requires_an_instruction_and_sends_it():
    with pytest.raises(ConfigError, match="instruction"):
        Custom("question -> answer")
    systems = []
    dspy.configure(lm=scripted_lm(lambda r: systems.append(r.system) or {"answer": "ok"}))
    Custom("question -> answer", instruction="Answer like a pirate.")(question="hi")
    assert "Answer like a pirate." in systems[0]


def test_sc_ensemble_majority_vote():
    votes = iter(["7", "8", "8", "7", "8"])
    dspy.configure(lm=scripted_lm(lambda r: {"reasoning": "r", "answer": next(votes)}, cache=False))
    op = ScEnsemble("question -> answer", n=5)
    assert op(question="q").answer == "8"


def test_sc_ensemble_lm_selection_uses_the_selector():
    labels = iter(["x", "y", "z"])
    listings = []

    def answer(request):
        if "best_index" in request.output_fields:
            listings.append(request.inputs["candidates"])
            return {"best_index": 2}
        return {"reasoning": "r", "answer": next(labels)}

    dspy.configure(lm=scripted_lm(answer, cache=False))
    out = ScEnsemble("question -> answer", n=3, select="lm")(question="q")
    # Samples run concurrently, so which label lands at index 2 varies; the selector's pick is returned.
    assert out.answer == listings[0].split("[2]\nanswer: ")[1].split()[0]
    assert all(f"[{i}]" in listings[0] for i in range(3))
    with pytest.raises(ConfigError, match="select"):
        ScEnsemble("question -> answer", select="vote")
    with pytest.raises(ConfigError, match="n must be"):
        ScEnsemble("question -> answer", n=0)


def test_refine_stops_when_accepted_and_is_bounded():
    calls = {"review": 0, "revise": 0}

    def answer(request):
        if "is_correct" in request.output_fields:
            calls["review"] += 1
            return {"feedback": "wrong", "is_correct": accept_after <= calls["review"]}
        if "feedback" in request.inputs:
            calls["revise"] += 1
            return {"reasoning": "r", "answer": f"rev{calls['revise']}"}
        return {"reasoning": "r", "answer": "draft"}

    dspy.configure(lm=scripted_lm(answer, cache=False))
    accept_after = 1
    assert Refine("question -> answer", max_rounds=3)(question="q").answer == "draft"
    calls.update(review=0, revise=0)
    accept_after = 99
    assert Refine("question -> answer", max_rounds=3)(question="q2").answer == "rev3"
    assert calls == {"review": 3, "revise": 3}
    with pytest.raises(ConfigError, match="max_rounds"):
        Refine("question -> answer", max_rounds=0)


def test_programmer_runs_code_and_retries_with_the_error():
    errors = []

    def answer(request):
        errors.append(request.inputs.get("previous_error", ""))
        code = "print(1/0)" if len(errors) == 1 else "print(sum(range(10)))"
        return {"reasoning": "r", "code": f"```python\n{code}\n```"}

    dspy.configure(lm=scripted_lm(answer, cache=False))
    out = Programmer("question -> answer")(question="sum 0..9")
    assert out.answer == "45"
    assert errors[0] == "" and "ZeroDivisionError" in errors[1]


def test_programmer_failure_modes():
    dspy.configure(lm=scripted_lm(lambda r: {"reasoning": "r", "code": "raise SystemExit(3)"}, cache=False))
    with pytest.raises(SandboxError, match="no attempt of 2"):
        Programmer("question -> answer")(question="q")
    out = Programmer("question -> answer", max_attempts=1, on_failure="empty")(question="q")
    assert out.answer == "" and out.error
    with pytest.raises(ConfigError, match="exactly one output"):
        Programmer("question -> answer, unit")


def test_retrieve_ranks_context_and_corpus():
    context = ["Bananas are yellow.", "The Eiffel Tower is in Paris.", "Paris hosts the Louvre museum."]
    out = Retrieve(k=2)(question="Which museum is in Paris?", context=context).passages
    assert out == ["Paris hosts the Louvre museum.", "The Eiffel Tower is in Paris."]
    corpus_op = Retrieve(k=1, corpus=context)
    assert corpus_op(question="yellow fruit bananas").passages == ["Bananas are yellow."]
    assert Retrieve(k=5)(question="the", context=context).passages == context  # stopword-only query
    with pytest.raises(ConfigError, match="does not fit"):
        Retrieve("question -> passages")
