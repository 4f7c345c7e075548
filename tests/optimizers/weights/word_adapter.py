"""A DSPy adapter for the tiny word-level test models: ``"field : value"`` lines, then ``"output :"``.

The completion is the first output field's value (its first line; the other outputs are empty), so a
random word model always produces a parseable prediction; an empty completion is a parse failure.
"""

from __future__ import annotations

from typing import Any

import dspy
from dspy.utils.exceptions import AdapterParseError


class WordAdapter(dspy.Adapter):
    """Short prompts of whole words, for models whose tokenizer knows only a few words.

    Example:
        >>> WordAdapter().parse(dspy.Signature("cue -> word"), "cat\\nmore")
        {'word': 'cat'}
    """

    def format(self, signature: Any, demos: list[dict[str, Any]], inputs: dict[str, Any]) -> list[dict[str, Any]]:
        out = next(iter(signature.output_fields))
        lines = [f"{k} : {inputs[k]}" for k in signature.input_fields if k in inputs]
        return [{"role": "user", "content": " ".join([*lines, f"{out} :"])}]

    def format_assistant_message_content(self, signature: Any, outputs: dict[str, Any],
                                         missing_field_message: str | None = None) -> str:
        return str(outputs.get(next(iter(signature.output_fields)), missing_field_message or ""))

    def parse(self, signature: Any, completion: str) -> dict[str, Any]:
        text = completion.strip().split("\n")[0].strip()
        if not text:
            raise AdapterParseError("WordAdapter", signature, completion, "empty completion")
        values = {name: "" for name in signature.output_fields}
        values[next(iter(signature.output_fields))] = text
        return values
