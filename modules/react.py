"""``ReAct``: think, call a registered tool, read its result, repeat (at most ``max_steps``), then answer.

DSPy's ReAct pattern, written so the tool choice is an ordinary output field (``next_tool``, a name)
with its argument in another (``tool_input``): any adapter can produce it, including the local
model's completion-style adapter, and no native tool-calling API is needed. Tools are named in the
node's settings and resolved through :mod:`flowopt.tools`; a workflow file never holds their code.
"""

from __future__ import annotations

import re
from typing import Any

import dspy

from flowopt.errors import ConfigError
from flowopt.modules.derived_signatures import extend
from flowopt.operator import Operator
from flowopt.registry import register_operator
from flowopt.settings import TEMPERATURE, between, check_settings
from flowopt.signature import FieldSpec, SignatureSpec
from flowopt.tools import Tool, ToolCall, get_tool, record_tool_call

FINISH = "finish"
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
DEFAULT_INSTRUCTIONS = (
    "Solve the task step by step. In each step write your next thought, then choose next_tool: the name of "
    f"one of the available tools, or '{FINISH}' when the trajectory holds what you need to answer; "
    "tool_input is the argument for that tool.")


@register_operator
class ReAct(Operator):
    """A tool-using node: a loop of (thought, tool, result) steps, then the declared outputs.

    Each step is one LM call of the ``act`` predictor (outputs ``next_thought``, ``next_tool``,
    ``tool_input``); the tool's result (or error) is appended to the trajectory the next step reads.
    ``extract`` then writes the node's outputs from the trajectory. The prediction also carries
    ``trajectory`` (text) and ``tool_calls``: one dict per call with the tool, its argument, its result
    or error, its status (``ok``, ``error``, ``unknown_tool``) and the index of the LM call that chose it
    inside a GRPO rollout.

    Example:
        >>> from flowopt.modules import ReAct
        >>> ReAct("question -> answer: float", tools=["calculator"], max_steps=4).config()
        {'tools': ['calculator'], 'max_steps': 4}
    """

    op_name = "ReAct"

    def __init__(self, signature: str | type[dspy.Signature] | SignatureSpec, instructions: str | None = None,
                 *, tools: list[str] | tuple[str, ...] = ("calculator",), max_steps: int = 5,
                 temperature: float | None = None) -> None:
        """``instructions``: the task description the act steps read (default: think, pick a tool or finish).
        ``tools``: registered tool names (:mod:`flowopt.tools`). ``max_steps``: tool calls at most, 1..20.
        ``temperature``: sampling temperature in [0, 2] (``None``: the LM's own)."""
        check_settings("ReAct", {"tools": tools, "max_steps": max_steps, "temperature": temperature},
                       hints=ReAct.__init__, bounds={"max_steps": between(1, 20), **TEMPERATURE})
        super().__init__(signature, instructions)
        if not tools:
            raise ConfigError("ReAct needs at least one tool", fix='pass tools=["calculator"]')
        if len(set(tools)) != len(tools) or FINISH in tools:
            raise ConfigError(f"ReAct tools must be distinct and none named {FINISH!r}, got {list(tools)}",
                              fix="list each registered tool once")
        self.tools: dict[str, Tool] = {name: get_tool(name) for name in tools}
        self.max_steps, self.temperature = max_steps, temperature
        lm_config = {} if temperature is None else {"temperature": temperature}
        self.act = dspy.Predict(extend(
            self._spec, instructions=self._spec.instructions or DEFAULT_INSTRUCTIONS,
            inputs=(FieldSpec("available_tools", "str"), FieldSpec("trajectory", "str")),
            outputs=(FieldSpec("next_thought", "str"), FieldSpec("next_tool", "str"), FieldSpec("tool_input", "str")),
        ).to_dspy(), **lm_config)
        self.extract = dspy.Predict(extend(
            self._spec, instructions="Give the final outputs, using the results in the trajectory.",
            inputs=(FieldSpec("trajectory", "str"),),
        ).to_dspy(), **lm_config)

    def config(self) -> dict[str, Any]:
        settings: dict[str, Any] = {"tools": list(self.tools), "max_steps": self.max_steps}
        if self.temperature is not None:
            settings["temperature"] = self.temperature
        return settings

    def catalogue(self) -> str:
        """The tools as the LM reads them: ``name(argument): description`` lines, then ``finish``."""
        lines = [f"{t.name}({t.argument}): {t.description}" for t in self.tools.values()]
        return "\n".join([*lines, f"{FINISH}: stop calling tools and give the answer"])

    def forward(self, **inputs: Any) -> dspy.Prediction:
        catalogue = self.catalogue()
        steps: list[str] = []
        calls: list[ToolCall] = []
        for step in range(1, self.max_steps + 1):
            choice = self.act(**inputs, available_tools=catalogue, trajectory=_render(steps))
            name, argument = _tool_choice(str(choice.next_tool), str(choice.tool_input))
            if name.lower() == FINISH:
                break
            call = self._call(name, argument)
            record_tool_call(call)
            calls.append(call)
            steps.append(f"Thought {step}: {str(choice.next_thought).strip()}\n"
                         f"Action {step}: {name}[{argument}]\nObservation {step}: {call.observation()}")
        trajectory = _render(steps)
        final = self.extract(**inputs, trajectory=trajectory)
        outputs = {name: final[name] for name in self._spec.output_names}
        return dspy.Prediction(**outputs, trajectory=trajectory, tool_calls=[c.to_dict() for c in calls])

    def _call(self, name: str, argument: str) -> ToolCall:
        tool = self.tools.get(name) or self.tools.get(name.lower())
        if tool is None:
            return ToolCall(name, argument, None, f"there is no tool {name!r}; choose one of "
                                                  f"{[*self.tools, FINISH]}", "unknown_tool")
        return tool(argument)


def _tool_choice(next_tool: str, tool_input: str) -> tuple[str, str]:
    """The tool's name and argument; ``calculator(2+3)`` written in ``next_tool`` counts as both."""
    text = next_tool.strip().strip("`'\" ")
    match = _NAME.match(text)
    name = match.group(0) if match else text
    rest = text[len(name):].strip()
    argument = tool_input.strip()
    if not argument and len(rest) >= 2 and rest[0] in "([" and rest[-1] in ")]":
        argument = rest[1:-1].strip()
    return name, argument


def _render(steps: list[str]) -> str:
    return "\n\n".join(steps) if steps else "(no steps yet)"
