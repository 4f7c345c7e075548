"""Building and serialising workflows: what the speed of structure search rests on.

Serialising must not rebuild operators, ``add`` must only look at the new node's edges, and the IR
module must build workflows through Workflow's public methods (no writes to its private fields).
"""

import ast
from pathlib import Path

import dspy
import pytest

import flowopt
from flowopt import WorkflowError
from flowopt.modules import ChainOfThought, Predict, Refine, ScEnsemble
from flowopt.operator import Operator


def six_nodes() -> flowopt.Workflow:
    return (flowopt.Workflow("question -> answer")
            .add("draft", Predict("question -> draft"))
            .add("notes", ChainOfThought("question, draft -> notes"))
            .add("vote", ScEnsemble("question, notes -> answer", n=3))
            .add("check", Refine("question, draft_answer -> answer", max_rounds=1),
                 inputs={"draft_answer": "vote.answer"})
            .add("extra", Predict("question -> hint"))
            .add("final", Predict("question, hint, answer -> verdict")))


def test_to_dict_builds_no_operator(monkeypatch):
    wf = six_nodes()
    built: list[str] = []
    original = Operator.from_config.__func__

    def counting(cls, spec, config, *, node=None):
        built.append(cls.__name__)
        return original(cls, spec, config, node=node)

    monkeypatch.setattr(Operator, "from_config", classmethod(counting))
    data = wf.to_dict()
    wf.canonical_json()
    assert built == []
    assert [n["id"] for n in data["nodes"]] == ["draft", "notes", "vote", "check", "extra", "final"]
    assert all("signature" not in state for n in data["nodes"] for state in n["predictors"].values())


def test_changed_predictor_signature_is_still_saved_and_restored():
    wf = six_nodes()
    predictor = wf.nodes["check"].named_predictors()[-1][1]
    predictor.signature = predictor.signature.with_instructions("Review harshly.")
    data = wf.to_dict()
    saved = next(n for n in data["nodes"] if n["id"] == "check")["predictors"]
    assert any(s.get("signature", {}).get("instructions") == "Review harshly." for s in saved.values())
    loaded = flowopt.Workflow.from_dict(data)
    assert loaded.nodes["check"].named_predictors()[-1][1].signature.instructions == "Review harshly."
    assert loaded.to_dict()["nodes"] == data["nodes"]


def test_add_wires_the_latest_producer_and_remove_forgets_it():
    wf = (flowopt.Workflow("question -> answer")
          .add("a", Predict("question -> draft"))
          .add("b", Predict("question -> draft")))
    wf.add("c", Predict("question, draft -> answer"))
    assert wf.sources("c")["draft"] == ("b", "draft")
    wf.remove("c").remove("b")
    wf.add("d", Predict("question, draft -> answer"))
    assert wf.sources("d")["draft"] == ("a", "draft")


def test_refused_add_leaves_the_workflow_unchanged():
    wf = flowopt.Workflow("question -> answer").add("solve", Predict("question -> answer"))
    before = wf.to_dict()
    with pytest.raises(WorkflowError):
        wf.add("bad", Predict("question, context -> answer"))  # context has no source
    with pytest.raises(WorkflowError):
        wf.add("typed", Predict("question -> answer: int"))  # int cannot feed the str program output
    assert wf.to_dict() == before
    wf.add("next", Predict("question, answer -> answer2"))  # the producer index is still right
    assert wf.sources("next")["answer"] == ("solve", "answer")


def test_large_workflow_builds_through_add():
    op = Predict("question -> answer")
    wf = flowopt.Workflow("question -> answer")
    for i in range(3000):
        wf.add(f"n{i}", op)
    assert wf.sources("$output") == {"answer": ("n2999", "answer")}
    assert wf.validate() is wf


def test_from_graph_keeps_the_given_wiring_and_validates():
    nodes = {"a": Predict("question -> answer"), "b": Predict("question -> answer")}
    edges = [("$input", "a", {"question": "question"}), ("$input", "b", {"question": "question"}),
             ("a", "$output", {"answer": "answer"})]
    wf = flowopt.Workflow.from_graph("question -> answer", nodes, edges, name="pinned", meta={"k": 1})
    assert wf.sources("$output") == {"answer": ("a", "answer")}  # not the latest producer, as given
    assert wf.name == "pinned" and wf.meta == {"k": 1}
    with pytest.raises(WorkflowError, match="not fed"):
        flowopt.Workflow.from_graph("question -> answer", nodes, edges[:1] + edges[2:])
    with pytest.raises(WorkflowError, match="does not exist"):
        flowopt.Workflow.from_graph("question -> answer", nodes, [*edges, ("ghost", "b", {"x": "y"})])
    with pytest.raises(WorkflowError, match="cycle"):
        cyc = {"a": Predict("question, back -> answer"), "b": Predict("answer -> back")}
        flowopt.Workflow.from_graph("question -> answer", cyc,
                                    [("$input", "a", {"question": "question"}), ("a", "b", {"answer": "answer"}),
                                     ("b", "a", {"back": "back"}), ("a", "$output", {"answer": "answer"})])


def test_ir_module_does_not_touch_workflow_private_fields():
    source = Path(flowopt.__file__).with_name("ir.py").read_text(encoding="utf-8")
    private = [node.attr for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert private == []


def test_deepcopy_keeps_building_independent():
    import copy

    wf = flowopt.Workflow("question -> answer").add("a", Predict("question -> draft"))
    clone = copy.deepcopy(wf)
    clone.add("b", Predict("question, draft -> answer"))
    wf.add("c", Predict("question -> draft")).add("d", Predict("question, draft -> answer"))
    assert clone.sources("b")["draft"] == ("a", "draft")
    assert wf.sources("d")["draft"] == ("c", "draft")
    assert isinstance(wf.nodes["a"], dspy.Module)
