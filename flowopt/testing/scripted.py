"""Scripted language models for tests, notebooks and benchmarks: DSPy engines, not mocks.

A :class:`ScriptedEngine` implements DSPy 3.4's engine contract (``complete(Request) -> Response``),
so wrapped in ``dspy.LM(..., engine=...)`` it goes through DSPy's real adapters, cache, history and
usage accounting. A user function decides each answer from the parsed request.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dspy
from dspy.lm15 import Message, Response, TextPart, Usage

_FIELD = re.compile(r"\[\[ ## (\w+) ## \]\]\n(.*?)(?=\n\n\[\[ ## |\n\nRespond with the corresponding|\Z)", re.S)
_OUTPUTS = re.compile(r"Your output fields are:\n(.*?)(?:\n\n|\Z)", re.S)
_NUMBERED = re.compile(r"^\d+\. `(\w+)`", re.M)


@dataclass
class ScriptedRequest:
    """What a scripted answer function sees: the parsed prompt of one LM call."""

    system: str
    messages: list[dict[str, str]]
    inputs: dict[str, str]
    output_fields: list[str]
    temperature: float | None
    demos: list[dict[str, str]] = field(default_factory=list)  # few-shot demos in the prompt, fields merged

    @property
    def prompt(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


AnswerFn = Callable[[ScriptedRequest], "dict[str, Any] | str"]


class ScriptedEngine:
    """A DSPy engine whose answers come from ``answer(request)``; counts calls and tokens.

    ``answer`` returns a dict of output field values (rendered in DSPy's chat format) or raw text.
    ``latency_s`` sleeps per call to model a remote LM.

    Example:
        >>> import dspy
        >>> from flowopt.testing import scripted_lm
        >>> lm = scripted_lm(lambda req: {"answer": req.inputs["question"].upper()})
        >>> with dspy.context(lm=lm):
        ...     dspy.Predict("question -> answer")(question="hi").answer
        'HI'
    """

    def __init__(self, answer: AnswerFn, *, latency_s: float = 0.0) -> None:
        self.answer = answer
        self.latency_s = latency_s
        self.calls = 0
        self._lock = threading.Lock()

    def complete(self, request: Any) -> Response:
        return self.answer_request(request, sleep=True)

    def answer_request(self, request: Any, *, sleep: bool) -> Response:
        """The answer to one request; ``sleep`` waits ``latency_s`` first (the async engine awaits it)."""
        system = request.system if isinstance(request.system, str) else "".join(
            p.text for p in (request.system or []))
        messages = [{"role": m.role, "content": m.text or ""} for m in request.messages]
        parsed = ScriptedRequest(
            system=system,
            messages=messages,
            inputs=_fields(messages[-1]["content"]) if messages else {},
            output_fields=_output_fields(system),
            temperature=request.config.temperature,
            demos=_demo_pairs(messages[:-1]),
        )
        if self.latency_s and sleep:
            time.sleep(self.latency_s)
        result = self.answer(parsed)
        text = result if isinstance(result, str) else _render(result)
        with self._lock:
            self.calls += 1
        prompt_tokens = len((system + parsed.prompt).split())
        completion_tokens = len(text.split())
        return Response(id=None, model="scripted", message=Message.assistant([TextPart(text)]),
                        finish_reason="stop",
                        usage=Usage(input_tokens=prompt_tokens, output_tokens=completion_tokens,
                                    total_tokens=prompt_tokens + completion_tokens))

    def stream(self, request: Any) -> Any:
        """The answer as stream events, its text split into word-sized deltas as a server sends them."""
        from dspy.lm15 import StreamDeltaEvent, TextDelta, response_to_events

        for event in response_to_events(self.complete(request)):
            delta = getattr(event, "delta", None)
            if isinstance(delta, TextDelta) and delta.text and not delta.logprobs:
                for piece in re.findall(r"\s*\S+", delta.text) or [delta.text]:
                    yield StreamDeltaEvent(delta=TextDelta(text=piece, part_index=delta.part_index))
            else:
                yield event

    def close(self) -> None:
        pass


class AsyncScriptedEngine:
    """The async counterpart DSPy awaits in ``acall``: the same answers and call count as ``sync``,
    with ``latency_s`` awaited on the event loop; ``peak_in_flight`` counts calls that overlapped.

    Example:
        >>> import asyncio, dspy
        >>> lm = scripted_lm(lambda req: {"answer": "yes"})
        >>> asyncio.run(dspy.Predict("question -> answer").acall(question="ok?", lm=lm)).answer
        'yes'
    """

    def __init__(self, sync: ScriptedEngine) -> None:
        self.sync = sync
        self.in_flight = 0
        self.peak_in_flight = 0

    async def complete(self, request: Any) -> Response:
        import asyncio

        self.in_flight += 1  # one event loop: no lock needed
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.sync.latency_s)
            return self.sync.answer_request(request, sleep=False)
        finally:
            self.in_flight -= 1

    async def stream(self, request: Any) -> Any:
        for event in self.sync.stream(request):
            yield event

    async def aclose(self) -> None:
        pass


def scripted_lm(answer: AnswerFn, *, latency_s: float = 0.0, cache: bool = True,
                model: str = "scripted/lm", **kwargs: Any) -> dspy.LM:
    """A ``dspy.LM`` backed by a :class:`ScriptedEngine` (reach the engine as ``lm.engine``) and its
    :class:`AsyncScriptedEngine` for ``acall``."""
    engine = ScriptedEngine(answer, latency_s=latency_s)
    return dspy.LM(model, engine=engine, async_engine=AsyncScriptedEngine(engine), cache=cache, **kwargs)


def _fields(text: str) -> dict[str, str]:
    return {name: value.strip() for name, value in _FIELD.findall(text) if name != "completed"}


def _demo_pairs(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Few-shot demos arrive as (user, assistant) message pairs; merge each pair's fields."""
    demos = []
    for i in range(0, len(messages) - 1, 2):
        demos.append({**_fields(messages[i]["content"]), **_fields(messages[i + 1]["content"])})
    return demos


def _output_fields(system: str) -> list[str]:
    match = _OUTPUTS.search(system)
    return _NUMBERED.findall(match.group(1)) if match else []


def _render(values: dict[str, Any]) -> str:
    parts = [f"[[ ## {name} ## ]]\n{value}" for name, value in values.items()]
    return "\n\n".join([*parts, "[[ ## completed ## ]]"])
