"""Every edit has an inverse: no state of the search is a dead end.

For several workflows, every valid edit of the rule proposer's vocabulary is applied, and one valid edit
of the result must give back the original workflow exactly (same canonical JSON: operators, settings,
wiring, demos).
"""

import pytest

from flowopt import Workflow
from flowopt.optimizers.structure import (
    AddProgrammer,
    AddRefine,
    AddRetrieve,
    RuleProposer,
    SetConfig,
    SwapOperator,
    Vocabulary,
    WrapEnsemble,
)

from .conftest import single, two_step, with_context

VOCABULARY = Vocabulary(ensemble_sizes=(3, 5), refine_rounds=(1, 2), max_nodes=8)


def states() -> dict[str, Workflow]:
    base = single()
    ensemble = WrapEnsemble("solve", 3).apply(base)
    programmer = AddProgrammer("solve").apply(ensemble)
    refined = SetConfig("solve_select_refine", "max_rounds", 2).apply(AddRefine("solve_select", 1).apply(programmer))
    return {
        "single": base,
        "ensemble": ensemble,
        "ensemble+programmer": programmer,
        "programmer+refine(2)": refined,
        "cot+refine": AddRefine("solve", 1).apply(SwapOperator("solve", "ChainOfThought").apply(base)),
        "two_step": two_step(),
        "reader+retrieve": AddRetrieve("read", 3).apply(with_context()),
    }


@pytest.mark.parametrize("name", list(states()))
def test_every_valid_edit_is_undone_by_one_edit(name):
    proposer = RuleProposer(VOCABULARY)
    original = states()[name]
    key = original.canonical_json()
    edits = proposer.valid_edits(original)
    assert len(edits) >= 3
    for edit, edited in edits:
        inverses = [back for back, restored in proposer.valid_edits(edited) if restored.canonical_json() == key]
        assert inverses, f"{name}: nothing undoes {edit.describe()}"


def test_ensemble_unwraps_to_the_operator_it_wrapped_with_its_demos():
    base = single()
    wrapped = WrapEnsemble("solve", 5).apply(base)
    back = SwapOperator("solve", "Predict").apply(wrapped)
    assert type(back.nodes["solve"]).op_name == "Predict"
    assert back.nodes["solve"].predict.demos[0].answer == "2"
    assert back.canonical_json() == base.canonical_json()


def test_canonical_json_ignores_the_order_nodes_were_added_in():
    from flowopt.modules import Predict

    a = Workflow("question -> answer").add("x", Predict("question -> hint")).add("y", Predict("question -> note"))
    a.add("z", Predict("question, hint, note -> answer"))
    b = Workflow("question -> answer").add("y", Predict("question -> note")).add("x", Predict("question -> hint"))
    b.add("z", Predict("question, hint, note -> answer"))
    assert a.to_dict()["nodes"] != b.to_dict()["nodes"]
    assert a.canonical_json() == b.canonical_json()
