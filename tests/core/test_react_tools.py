"""The tool-using ReAct node: JSON round-trip, tools by registered name only, a scripted run of several
calculator calls, the tool records, and the calculator's refusal of anything but arithmetic."""

from __future__ import annotations

import json

import dspy
import pytest

import flowopt
from flowopt import ConfigError
from flowopt.modules import ReAct
from flowopt.modules.tools import MAX_EXPONENT, evaluate_arithmetic
from flowopt.testing import scripted_lm
from flowopt.tools import ToolCall, ToolError, get_tool, tool_log, tool_names


def calculator_agent(request):
    """Plays the LM: computes (3 + 4) * 6 in two calculator calls, then finishes and answers."""
    if "next_tool" in request.output_fields:
        trajectory = request.inputs["trajectory"]
        if "Observation 1" not in trajectory:
            return {"next_thought": "add first", "next_tool": "calculator", "tool_input": "3 + 4"}
        if "Observation 2" not in trajectory:
            first = trajectory.split("Observation 1: ")[1].split("\n")[0]
            return {"next_thought": "now multiply", "next_tool": "calculator", "tool_input": f"{first} * 6"}
        return {"next_thought": "done", "next_tool": "finish", "tool_input": ""}
    answer = request.inputs["trajectory"].split("Observation 2: ")[1].split("\n")[0]
    return {"answer": answer}


def workflow(**settings) -> flowopt.Workflow:
    return flowopt.Workflow("question -> answer", name="agent").add(
        "solve", ReAct("question -> answer", tools=settings.pop("tools", ["calculator", "python"]), **settings))


def test_a_react_node_round_trips_with_tools_by_name():
    wf = workflow(max_steps=3)
    text = wf.to_json()
    node = json.loads(text)["nodes"][0]
    assert node["op"] == "ReAct" and node["config"] == {"tools": ["calculator", "python"], "max_steps": 3}
    loaded = flowopt.Workflow.from_json(text)
    assert loaded.to_json() == text
    assert loaded.nodes["solve"].tools["calculator"] is get_tool("calculator")


def test_loading_refuses_an_unknown_tool_naming_it_and_the_registered_ones():
    document = json.loads(workflow().to_json())
    document["nodes"][0]["config"]["tools"] = ["calculator", "shell"]
    with pytest.raises(ConfigError) as err:
        flowopt.Workflow.from_json(json.dumps(document))
    message = str(err.value)
    assert "'shell'" in message and "solve" in message
    assert all(name in message for name in tool_names())


@pytest.mark.parametrize("bad", [{"max_steps": 0}, {"max_steps": 21}, {"max_steps": 2.5}, {"tools": []},
                                 {"tools": ["calculator", "calculator"]}, {"tools": "calculator"}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        ReAct("question -> answer", **bad)


def test_a_scripted_lm_drives_several_calculator_calls_to_the_answer():
    lm = scripted_lm(calculator_agent, cache=False)
    with dspy.context(lm=lm), tool_log(lm_calls=lambda: lm.engine.calls) as log:
        prediction = workflow()(question="What is (3 + 4) * 6?")
    assert prediction.answer == "42"
    assert lm.engine.calls == 4  # three act steps (two tools, then finish) and the final extract
    assert [(c.tool, c.argument, c.result, c.status) for c in log.calls] == [
        ("calculator", "3 + 4", "7", "ok"), ("calculator", "7 * 6", "42", "ok")]
    assert [c.transition for c in log.calls] == [0, 1]  # the LM call that chose each tool


def test_the_prediction_records_each_call_with_its_status():
    def answer(request):
        if "next_tool" in request.output_fields:
            step = request.inputs["trajectory"].count("Observation")
            return [{"next_thought": "t", "next_tool": "calculator", "tool_input": "1 / 0"},
                    {"next_thought": "t", "next_tool": "abacus", "tool_input": "2"},
                    {"next_thought": "t", "next_tool": "calculator(2 ** 5)", "tool_input": ""}][step]
        return {"answer": "32"}

    with dspy.context(lm=scripted_lm(answer, cache=False)):
        prediction = ReAct("question -> answer", tools=["calculator"], max_steps=3)(question="q")
    calls = prediction.tool_calls
    assert [c["status"] for c in calls] == ["error", "unknown_tool", "ok"]
    assert calls[0]["error"] == "division by zero" and calls[0]["result"] is None
    assert "abacus" in calls[1]["error"] and "calculator" in calls[1]["error"]
    assert calls[2]["argument"] == "2 ** 5" and calls[2]["result"] == "32"
    assert "Observation 1: Error: division by zero" in prediction.trajectory
    assert len(calls) == 3  # max_steps bounds the loop: no fourth step was asked for


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("-2 ** 2", "-4"), ("2^10", "1024"),
    ("10 // 3", "3"), ("10 % 4", "2"), ("1,234 ", "1234"), ("0.1 + 0.2", "0.3"), ("6 / 3 =", "2")])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize("expression, problem", [
    ("__import__('os').system('echo hi')", "not Call"), ("x + 1", "not Name"), ("'a' * 3", "not Constant"),
    ("(1).__class__", "not Attribute"), ("[1, 2]", "not List"), ("True + 1", "not Constant"),
    ("1 if 1 else 2", "not IfExp"), ("lambda: 1", "not Lambda"), ("1 < 2", "not Compare"),
    (f"2 ** {MAX_EXPONENT + 1}", "out of range"), ("9 ** 9 ** 9", "out of range"), ("10.0 ** 60", "exceeds"),
    ("1 / 0", "division by zero"), ("1 +", "not an arithmetic expression"), ("", "empty"),
    ("1+" * 200 + "1", "characters"), ("(-8) ** 0.5", "no real value"), ("1e400", "exceeds"), ("2 & 3", "not BitAnd")])
def test_calculator_refuses_everything_else(expression, problem):
    with pytest.raises(ToolError, match=problem):
        evaluate_arithmetic(expression)


def test_a_tool_error_is_a_call_with_status_error_not_an_exception():
    call = get_tool("calculator")("2 ** 1000")
    assert call == ToolCall("calculator", "2 ** 1000", None, call.error, "error") and "out of range" in call.error


def test_python_tool_runs_in_the_sandbox():
    from flowopt.modules.sandbox import check_sandbox

    try:
        check_sandbox()
    except flowopt.FlowoptError:
        pytest.skip("the sandbox cannot be built on this machine")
    ok = get_tool("python")("print(sum(range(10)))")
    assert (ok.status, ok.result) == ("ok", "45")
    failed = get_tool("python")("import socket; socket.socket()")
    assert failed.status == "error" and failed.result is None


def test_the_local_models_completion_adapter_carries_the_tool_choice_as_fields():
    """The completion-style adapter (what the local base model gets): the act step is a document to continue,
    ending at ``Next Thought:`` with the tool catalogue among its inputs; the tool and its argument come back
    as labelled lines, no native tool-calling API involved."""
    from flowopt.lm import CompletionAdapter
    from tests.lm.test_completion_adapter import _lm

    def continue_document(prompt):
        if prompt.endswith("Answer:"):
            return " " + prompt.split("Observation 1: ")[1].split("\n")[0]
        if "Observation 1" in prompt:
            return " I have it.\nNext Tool: finish\nTool Input: none\n"
        return " Add them.\nNext Tool: calculator\nTool Input: 17 * 3 + 4\n"

    lm, engine = _lm(continue_document)
    with dspy.context(lm=lm, adapter=CompletionAdapter()):
        prediction = workflow(tools=["calculator"])(question="What is 17 * 3 + 4?")
    assert prediction.answer == "55"
    act_prompt = engine.prompts[0]
    assert act_prompt.endswith("Next Thought:") and "calculator(expression): Evaluates" in act_prompt
    assert "finish: stop calling tools" in act_prompt
    assert len(engine.prompts) == 3  # act (calculator), act (finish), extract
