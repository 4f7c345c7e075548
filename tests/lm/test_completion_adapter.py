"""CompletionAdapter: the prompt it writes, lenient parsing, continuation of missing fields."""

from __future__ import annotations

import dspy
import pytest
from dspy.lm15 import Message, Response, Usage
from dspy.utils.exceptions import AdapterParseError

from flowopt.lm import AutoAdapter, CompletionAdapter


class TextEngine:
    """A DSPy engine that continues a prompt with a scripted function of the prompt text."""

    def __init__(self, continue_fn):
        self.continue_fn = continue_fn
        self.prompts: list[str] = []
        self.stops: list[tuple[str, ...]] = []

    def complete(self, request):
        prompt = request.messages[-1].text
        self.prompts.append(prompt)
        self.stops.append(tuple(request.config.stop))
        text = self.continue_fn(prompt)
        return Response(id=None, model=request.model, message=Message.assistant(text), finish_reason="stop",
                        usage=Usage(input_tokens=len(prompt), output_tokens=len(text)))

    def stream(self, request):  # pragma: no cover - not used
        raise NotImplementedError

    def close(self):
        pass


def _lm(fn):
    engine = TextEngine(fn)
    return dspy.LM("local/scripted", engine=engine, cache=False), engine


def test_prompt_has_instructions_demos_and_ends_at_the_first_output_label():
    signature = dspy.Signature("question -> reasoning, answer: int", "Solve the problem.")
    demos = [{"question": "1 + 1?", "reasoning": "One and one.", "answer": 2}, {"question": "only an input"}]
    prompt = CompletionAdapter().format(signature, demos, {"question": "2 + 3?"})[0]["content"]
    assert prompt == ("Solve the problem.\n\n---\n\n"
                      "Question: 1 + 1?\nReasoning: One and one.\nAnswer: 2\n\n---\n\n"
                      "Question: 2 + 3?\nReasoning:")


def test_lenient_parsing_of_labels_and_typed_values():
    adapter = CompletionAdapter()
    signature = dspy.Signature("question -> reasoning, answer: int, ok: bool")
    parsed = adapter.parse(signature, " Add them up.\nThen carry.\n**ANSWER**: $1,250 dollars\nOk: yes, it is")
    assert parsed == {"reasoning": "Add them up.\nThen carry.", "answer": 1250, "ok": True}
    with pytest.raises(AdapterParseError):
        adapter.parse(signature, " no labels here at all")


def test_generation_stops_at_the_next_example_and_predict_parses():
    lm, engine = _lm(lambda prompt: " Paris\n")
    with dspy.context(lm=lm, adapter=CompletionAdapter()):
        result = dspy.Predict("question -> answer")(question="Capital of France?")
    assert result.answer == "Paris"
    assert "\n---" in engine.stops[0] and "\nQuestion:" in engine.stops[0]


def test_missing_fields_are_asked_for_by_continuing_the_document():
    def continuation(prompt):
        return " 42" if prompt.endswith("Answer:") else " six times seven"

    lm, engine = _lm(continuation)
    with dspy.context(lm=lm, adapter=CompletionAdapter()):
        result = dspy.ChainOfThought("question -> answer: int")(question="What is 6 * 7?")
    assert (result.reasoning, result.answer) == ("six times seven", 42)
    assert len(engine.prompts) == 2
    assert engine.prompts[1] == engine.prompts[0] + " six times seven\nAnswer:"


def test_an_unparseable_answer_is_a_parse_error_not_a_guess():
    lm, _ = _lm(lambda prompt: " lots" if prompt.endswith("Answer:") else " thinking")
    with dspy.context(lm=lm, adapter=CompletionAdapter()), pytest.raises(AdapterParseError):
        dspy.ChainOfThought("question -> answer: int")(question="How many?")


def test_auto_adapter_uses_the_chat_adapter_for_other_models():
    seen = []

    def chat_answer(prompt):
        seen.append(prompt)
        return "[[ ## answer ## ]]\nhi\n\n[[ ## completed ## ]]"

    lm, _ = _lm(chat_answer)
    with dspy.context(lm=lm, adapter=AutoAdapter()):
        assert dspy.Predict("question -> answer")(question="hello?").answer == "hi"
    assert "[[ ## question ## ]]" in seen[0]


def test_auto_adapter_picks_completion_for_a_base_local_model(tiny_local):
    adapter = AutoAdapter()
    assert isinstance(adapter.pick(tiny_local.lm), CompletionAdapter)
