"""Every class of bad input gets a flowopt error naming the node, the field and the fix."""

import copy
import json

import pytest

import flowopt
from flowopt import SchemaError, UnknownOperatorError, WorkflowError
from flowopt.modules import ChainOfThought, Predict, Retrieve


def base() -> flowopt.Workflow:
    return (flowopt.Workflow("question -> answer", name="qa")
            .add("draft", Predict("question -> draft"))
            .add("final", Predict("question, draft -> answer")))


def base_dict() -> dict:
    return base().to_dict()


def assert_names(err: WorkflowError, *, node: str | None, field: str | None = None) -> None:
    message = str(err)
    assert isinstance(err, flowopt.FlowoptError)
    assert "Fix:" in message
    if node is not None:
        assert err.node == node and f"node '{node}'" in message
    if field is not None:
        assert err.field == field and f"field '{field}'" in message


def test_cycle_is_refused_when_building():
    wf = base()
    with pytest.raises(WorkflowError, match="cycle") as info:
        wf.connect("final", "draft", {"answer": "question"})
    assert "Refine" in str(info.value)


def test_cycle_is_refused_when_loading():
    data = base_dict()
    data["nodes"][0]["signature"]["inputs"].append({"name": "hint", "type": "str", "desc": ""})
    data["edges"].append({"src": "final", "dst": "draft", "map": {"answer": "hint"}})
    with pytest.raises(WorkflowError, match="cycle"):
        flowopt.Workflow.from_dict(data)


def test_input_fed_twice():
    wf = base()
    wf.add("alt", Predict("question -> hint"))
    before = wf.to_json()
    with pytest.raises(WorkflowError, match="fed 2 times") as info:
        wf.connect("alt", "final", {"hint": "draft"})
    assert_names(info.value, node="final", field="draft")
    assert wf.to_json() == before  # the refused edge left nothing behind
    with pytest.raises(WorkflowError, match="already feeds") as info:
        wf.connect("$input", "final", {"question": "draft"})
    assert_names(info.value, node="final", field="draft")


def test_input_not_fed():
    data = base_dict()
    data["edges"] = [e for e in data["edges"] if not (e["dst"] == "final" and "draft" in e["map"].values())]
    with pytest.raises(WorkflowError, match="not fed") as info:
        flowopt.Workflow.from_dict(data)
    assert_names(info.value, node="final", field="draft")


def test_input_without_any_source_when_adding():
    with pytest.raises(WorkflowError, match="no source") as info:
        flowopt.Workflow("question -> answer").add("solve", Predict("question, hint -> answer"))
    assert_names(info.value, node="solve", field="hint")


def test_mapped_source_field_must_exist():
    data = base_dict()
    for edge in data["edges"]:
        if edge["src"] == "draft":
            edge["map"] = {"summary": "draft"}
    with pytest.raises(WorkflowError, match="does not produce") as info:
        flowopt.Workflow.from_dict(data)
    assert_names(info.value, node="draft", field="summary")


def test_mapped_target_field_must_exist():
    wf = base()
    with pytest.raises(WorkflowError, match="does not take") as info:
        wf.add("alt", Predict("question -> hint")).connect("alt", "final", {"hint": "notes"})
    assert_names(info.value, node="final", field="notes")


def test_explicit_inputs_must_name_operator_fields():
    with pytest.raises(WorkflowError) as info:
        flowopt.Workflow("question -> answer").add("solve", Predict("question -> answer"), inputs={"q": "$input.x"})
    assert_names(info.value, node="solve", field="q")


def test_types_must_be_compatible():
    wf = flowopt.Workflow("question -> answer")
    wf.add("count", Predict("question -> n: int"))
    wf.add("final", Predict("question, n: float -> answer"))  # int -> float is allowed
    with pytest.raises(WorkflowError, match="type mismatch") as info:
        wf.add("bad", Predict("question, passages: list[str] -> answer"), inputs={"passages": "count.n"})
    assert_names(info.value, node="bad", field="passages")
    assert "bad" not in wf.nodes  # a refused node leaves the graph as it was


def test_retrieve_output_type_checked_against_str_input():
    wf = flowopt.Workflow("question, context: list[str] -> answer")
    wf.add("retrieve", Retrieve(k=2))
    with pytest.raises(WorkflowError, match="type mismatch"):
        wf.add("answer", Predict("question, passages -> answer"))


def test_unknown_operator_on_load():
    data = base_dict()
    data["nodes"][1]["op"] = "Telepathy"
    with pytest.raises(UnknownOperatorError) as info:
        flowopt.Workflow.from_dict(data)
    assert_names(info.value, node="final")
    assert "ChainOfThought" in str(info.value)  # the fix lists the known operators


def test_duplicate_ids_when_building_and_loading():
    with pytest.raises(WorkflowError, match="duplicate") as info:
        base().add("draft", Predict("question -> draft"))
    assert_names(info.value, node="draft")
    data = base_dict()
    data["nodes"].append(copy.deepcopy(data["nodes"][0]))
    with pytest.raises(WorkflowError, match="duplicate"):
        flowopt.Workflow.from_dict(data)


@pytest.mark.parametrize("bad_id", ["", "$x", "a.b", 7])
def test_invalid_node_ids(bad_id):
    with pytest.raises(WorkflowError, match="invalid node id"):
        flowopt.Workflow("question -> answer").add(bad_id, Predict("question -> answer"))


def test_schema_version_is_checked():
    data = base_dict()
    data["schema"] = "flowopt.workflow/v9"
    with pytest.raises(SchemaError, match="unsupported schema") as info:
        flowopt.Workflow.from_dict(data)
    assert_names(info.value, node=None, field="schema")


def test_malformed_json_and_documents():
    with pytest.raises(SchemaError, match="not valid JSON"):
        flowopt.Workflow.from_json("{not json")
    with pytest.raises(SchemaError, match="JSON object"):
        flowopt.Workflow.from_json("[1, 2]")
    data = base_dict()
    data["nodes"][0]["prompt"] = "x"
    with pytest.raises(SchemaError, match="unknown node keys") as info:
        flowopt.Workflow.from_dict(data)
    assert_names(info.value, node="draft", field="prompt")
    data = base_dict()
    data["nodes"][0]["signature"]["outputs"][0]["type"] = "tuple"
    with pytest.raises(WorkflowError, match="unknown type") as info:
        flowopt.Workflow.from_dict(data)
    assert_names(info.value, node="draft", field="draft")


def test_bad_operator_settings_on_load():
    data = base_dict()
    data["nodes"][0]["config"] = {"temperature": 0.1, "wings": 2}
    with pytest.raises(WorkflowError, match="bad settings") as info:
        flowopt.Workflow.from_dict(data)
    assert_names(info.value, node="draft")


def test_program_output_must_be_produced():
    data = base_dict()
    data["edges"] = [e for e in data["edges"] if e["dst"] != "$output"]
    with pytest.raises(WorkflowError, match="not fed") as info:
        flowopt.Workflow.from_dict(data)
    assert_names(info.value, node="$output", field="answer")


def test_missing_program_input_at_call_time():
    with pytest.raises(WorkflowError, match="without this input") as info:
        base()(query="hi")
    assert_names(info.value, node="$input", field="question")


def test_loading_a_missing_file(tmp_path):
    with pytest.raises(SchemaError, match="no workflow file"):
        flowopt.load(tmp_path / "nope.json")


def test_node_lm_must_be_defined():
    data = base_dict()
    data["nodes"][0]["lm"] = "teacher"
    with pytest.raises(WorkflowError, match="'teacher'") as info:
        flowopt.Workflow.from_dict(data)
    assert_names(info.value, node="draft", field="lm")


def test_loading_never_evaluates_code(tmp_path):
    data = base_dict()
    data["nodes"][0]["signature"]["outputs"][0]["type"] = "__import__('os').system('touch pwned')"
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(data))
    with pytest.raises(WorkflowError, match="unknown type"):
        flowopt.load(path)
    assert not (tmp_path / "pwned").exists()


def test_chain_operators_must_be_operators():
    with pytest.raises(WorkflowError, match="not a flowopt Operator"):
        flowopt.chain("question -> answer", ChainOfThought("question -> answer"), "oops")
