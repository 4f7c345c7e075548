"""Every edit applies, validates and round-trips through JSON; invalid edits are refused with a reason."""

from __future__ import annotations

import json

import pytest

from flowopt import Workflow
from flowopt.optimizers.structure import (
    AddProgrammer,
    AddRefine,
    AddRetrieve,
    InvalidEdit,
    RemoveNode,
    SetConfig,
    SwapOperator,
    WrapEnsemble,
    edit_from_dict,
    edit_kinds,
    replay,
)


def _roundtrip(wf: Workflow) -> None:
    again = Workflow.from_json(wf.to_json())
    assert again.canonical_json() == wf.canonical_json()
    again.validate()


def _demos(wf: Workflow, node: str) -> list[dict]:
    state = wf.to_dict()
    entry = next(n for n in state["nodes"] if n["id"] == node)
    return [d for p in entry["predictors"].values() for d in p["demos"]]


def _instructions(wf: Workflow, node: str) -> str:
    return wf.nodes[node].spec.instructions


EDITS = [
    ("single", SwapOperator("solve", "ChainOfThought"), ["solve"]),
    ("single", WrapEnsemble("solve", 3), ["solve"]),
    ("single", AddRefine("solve", 2), ["solve", "solve_refine"]),
    ("single", AddProgrammer("solve"), ["solve", "solve_code", "solve_select"]),
    ("single", SetConfig("solve", "temperature", 0.7), ["solve"]),
    ("with_context", AddRetrieve("read", 2), ["read_retrieve", "read"]),
    ("two_step", SwapOperator("final", "Predict"), ["draft", "final"]),
    ("two_step", AddRefine("draft"), ["draft", "draft_refine", "final"]),
]


@pytest.mark.parametrize(("base", "edit", "order"), EDITS, ids=[e.describe() for _, e, _ in EDITS])
def test_edit_applies_validates_and_roundtrips(toys, base, edit, order):
    wf = getattr(toys, base)()
    before = wf.canonical_json()
    new = edit.apply(wf)
    assert wf.canonical_json() == before, "the input workflow must not change"
    new.validate()
    assert new.topological_order() == order
    _roundtrip(new)
    assert edit_from_dict(json.loads(json.dumps(edit.to_dict()))) == edit
    assert edit.describe() and "\n" not in edit.describe()


def test_every_kind_is_covered():
    covered = {e.kind for _, e, _ in EDITS} | {"remove_node"}
    assert covered == set(edit_kinds())


def test_untouched_nodes_keep_demos_and_instructions(toys):
    wf = toys.two_step()
    for edit in (AddRefine("final"), WrapEnsemble("draft", 3), AddProgrammer("final")):
        new = edit.apply(wf)
        untouched = "draft" if edit.node == "final" else "final"
        assert _demos(new, untouched) == _demos(wf, untouched)
        assert _instructions(new, untouched) == _instructions(wf, untouched)


def test_swap_and_wrap_carry_the_nodes_own_demos_and_instructions(toys):
    wf = toys.two_step()
    assert _demos(SwapOperator("final", "Predict").apply(wf), "final") == _demos(wf, "final")
    wrapped = WrapEnsemble("draft", 5).apply(wf)
    assert _demos(wrapped, "draft") == _demos(wf, "draft")
    assert _instructions(wrapped, "draft") == "Write a first draft."
    assert wrapped.nodes["draft"].config()["n"] == 5


def test_edits_rewire_readers(toys):
    refined = AddRefine("solve").apply(toys.single())
    assert refined.sources("$output") == {"answer": ("solve_refine", "answer")}
    assert refined.sources("solve_refine") == {"question": ("$input", "question"),
                                               "draft_answer": ("solve", "answer")}
    branched = AddProgrammer("solve").apply(toys.single())
    assert branched.sources("solve_select") == {"question": ("$input", "question"),
                                                "candidate_answer": ("solve", "answer"),
                                                "program_answer": ("solve_code", "answer")}
    assert branched.nodes["solve_code"].config()["on_failure"] == "empty"
    retrieved = AddRetrieve("read").apply(toys.with_context())
    assert retrieved.sources("read")["context"] == ("read_retrieve", "passages")


def test_remove_undoes_inserted_nodes(toys):
    wf = toys.single()
    assert RemoveNode("solve_refine").apply(AddRefine("solve").apply(wf)).canonical_json() == wf.canonical_json()
    # Removing the selector drops the programmer branch it alone read.
    branched = AddProgrammer("solve").apply(wf)
    assert RemoveNode("solve_select").apply(branched).canonical_json() == wf.canonical_json()
    ctx = toys.with_context()
    assert RemoveNode("read_retrieve").apply(AddRetrieve("read").apply(ctx)).canonical_json() == ctx.canonical_json()


def test_replay_of_a_sequence_is_the_same_graph(toys):
    edits = [WrapEnsemble("solve", 3), AddProgrammer("solve"), AddRefine("solve_select"),
             SetConfig("solve_select_refine", "max_rounds", 2)]
    direct = toys.single()
    for e in edits:
        direct = e.apply(direct)
    replayed = replay(toys.single(), [e.to_dict() for e in edits])
    assert replayed.canonical_json() == direct.canonical_json()
    assert len(replayed.nodes) == 4


@pytest.mark.parametrize(("base", "edit", "reason"), [
    ("single", RemoveNode("solve"), "only node"),
    ("single", SwapOperator("missing"), "no node 'missing'"),
    ("single", SwapOperator("solve", "Predict"), "already Predict"),
    ("single", AddRetrieve("solve"), "list[str] context"),
    ("single", SetConfig("solve", "n", 3), "has no setting 'n'"),
    ("single", WrapEnsemble("solve", 1), "n must be an int in 2..15"),
    ("two_step", RemoveNode("draft"), "nothing can replace its output 'draft'"),
    ("two_step", AddProgrammer("draft"), None),
])
def test_invalid_edits_are_refused_with_a_reason(toys, base, edit, reason):
    wf = getattr(toys, base)()
    if reason is None:  # valid in general; here it must pass since draft has one str output
        edit.apply(wf)
        return
    with pytest.raises(InvalidEdit) as info:
        edit.apply(wf)
    assert reason in info.value.reason
    assert info.value.edit == edit.to_dict()
    assert "Fix:" in str(info.value)


def test_settings_are_validated_by_the_operator(toys):
    refined = AddRefine("solve").apply(toys.single())
    with pytest.raises(InvalidEdit, match="max_rounds"):
        SetConfig("solve_refine", "max_rounds", 0).apply(refined)
    with pytest.raises(InvalidEdit, match="already"):
        AddRefine("solve").apply(refined)
    ensemble = WrapEnsemble("solve", 3).apply(toys.single())
    with pytest.raises(InvalidEdit, match="only"):
        WrapEnsemble("solve", 5).apply(ensemble)


def test_remove_never_feeds_a_list_into_a_str_input(toys):
    # A retriever's list[str] passages cannot replace a str answer: RemoveNode refuses rather than
    # produce a graph that feeds a list into a str input.
    wf = Workflow("question, context: list[str] -> answer").add(
        "pick", toys.with_context().nodes["read"].__class__("question, context: list[str] -> answer"))
    wf = AddRetrieve("pick").apply(wf)
    with pytest.raises(InvalidEdit):
        RemoveNode("pick").apply(wf)


@pytest.mark.parametrize("data", [
    {"kind": "teleport", "node": "solve"},
    {"kind": "wrap_ensemble"},
    {"kind": "wrap_ensemble", "node": "solve", "size": 3},
    {"node": "solve"},
])
def test_malformed_edit_data_is_refused(data):
    with pytest.raises(InvalidEdit):
        edit_from_dict(data)


def test_apply_with_a_given_ir_matches_apply_and_keys_agree(toys):
    from flowopt.optimizers.structure import WrapEnsemble
    from flowopt.optimizers.structure.tree import ir_key, workflow_key

    wf = toys.two_step()
    ir = wf.to_dict()
    before = json.dumps(ir, sort_keys=True)
    edit = WrapEnsemble("draft", 3)
    assert edit.apply(wf, ir=ir).canonical_json() == edit.apply(wf).canonical_json()
    assert json.dumps(ir, sort_keys=True) == before  # the given IR is not modified
    assert ir_key(ir) == workflow_key(wf.canonical_json())


def test_an_edit_over_the_size_limit_is_refused_before_the_workflow_is_built(monkeypatch):
    from flowopt.optimizers.structure import Vocabulary

    from .conftest import single

    wf = single()

    def no_build(data):
        raise AssertionError("an over-limit edit must be refused on its IR data")

    monkeypatch.setattr(Workflow, "from_dict", staticmethod(no_build))
    with pytest.raises(InvalidEdit, match="over the limit 1"):
        Vocabulary(max_nodes=1).check(AddRefine("solve"), wf)
