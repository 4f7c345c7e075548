"""A DSPy adapter that small and base models can follow: field-prefixed plain text to be continued.

DSPy's ChatAdapter asks the model to write ``[[ ## answer ## ]]`` markers and a completion marker;
a base 270M model never has seen that convention, so most of its outputs do not parse. This adapter
writes the prompt as a document the model only has to continue, the way DSPy 2 templates did::

    Given the fields `question`, produce the fields `answer`.

    ---

    Question: What is 2 + 2?
    Answer: 4

    ---

    Question: What is 3 + 5?
    Answer:

Generation stops at the next example separator or input-field line. Parsing is lenient: field labels
are matched case-insensitively at line starts, typed values are pulled out of surrounding words
(``"$18 per day"`` parses as the int 18), and when the model stops before writing every output field
the adapter continues the document with the next field's label and asks again (at most once per
field), as DSPy 2 did. Every call goes through the ``dspy.LM``, so cache, history and usage apply.

``adapter_for(lm)`` picks this adapter for base-model LocalLMs and DSPy's ChatAdapter otherwise;
``AutoAdapter`` makes that choice per call, for programs mixing models.
"""

from __future__ import annotations

import asyncio
import enum
import re
import textwrap
from typing import Any, Literal, get_args, get_origin

import dspy
from dspy.adapters.base import Adapter
from dspy.adapters.utils import format_field_value, parse_value
from dspy.clients._deprecation import adapter_message_call
from dspy.clients.capabilities import with_capability_planning
from dspy.signatures.signature import Signature
from dspy.utils.callback import BaseCallback
from dspy.utils.exceptions import AdapterParseError

SEPARATOR = "---"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def field_label(name: str, field: Any) -> str:
    """The text a field is written under: its DSPy prefix without the colon, or its name in words."""
    extra = getattr(field, "json_schema_extra", None) or {}
    prefix = str(extra.get("prefix") or "").strip()
    if prefix.endswith(":"):
        prefix = prefix[:-1].strip()
    return prefix or name.replace("_", " ").strip().capitalize()


def _lenient_value(value: str, annotation: Any) -> Any:
    """parse_value, then small-model repairs: a number inside words, a yes/no, a case-folded choice."""
    text = value.strip()
    try:
        return parse_value(text, annotation)
    except (ValueError, TypeError, AssertionError) as exc:
        error = exc
    if annotation in (int, float):
        for match in _NUMBER.finditer(text):
            number = match.group().replace(",", "")
            try:
                as_float = float(number)
            except ValueError:
                continue
            if annotation is float:
                return as_float
            if as_float.is_integer():
                return int(as_float)
    if annotation is bool:
        lowered = text.lower()
        if re.match(r"^(yes|true|correct)\b", lowered):
            return True
        if re.match(r"^(no|false|incorrect)\b", lowered):
            return False
    if get_origin(annotation) is Literal or isinstance(annotation, enum.EnumMeta):
        members: list[Any] = list(annotation) if isinstance(annotation, enum.EnumMeta) else []
        choices = [m.value for m in members] if members else list(get_args(annotation))
        lowered = text.lower()
        for choice in choices:
            if isinstance(choice, str) and re.search(rf"\b{re.escape(choice.lower())}\b", lowered):
                return parse_value(choice, annotation)
    raise ValueError(str(error))


class CompletionAdapter(Adapter):
    """Prompts as field-prefixed plain text for base and small models; lenient parsing.

    Example:
        >>> import dspy
        >>> from flowopt.lm import CompletionAdapter
        >>> adapter = CompletionAdapter()
        >>> messages = adapter.format(dspy.Signature("question -> answer"), [], {"question": "2 + 2?"})
        >>> print(messages[0]["content"])
        Given the fields `question`, produce the fields `answer`.
        <BLANKLINE>
        ---
        <BLANKLINE>
        Question: 2 + 2?
        Answer:
    """

    def __init__(self, callbacks: list[BaseCallback] | None = None, *, continue_missing: bool = True) -> None:
        super().__init__(callbacks=callbacks)
        self.continue_missing = continue_missing

    # -- prompt ------------------------------------------------------------------------------------

    def _field_lines(self, fields: dict[str, Any], values: dict[str, Any]) -> list[str]:
        lines = []
        for name, field in fields.items():
            if name in values and values[name] is not None:
                raw = values[name]
                # Plain text and numbers format as themselves; DSPy's general path builds a pydantic
                # TypeAdapter per value (about 0.1 ms), which a GRPO step pays for every rollout.
                value = str(raw) if type(raw) in (str, int) else format_field_value(field_info=field, value=raw)
                lines.append(f"{field_label(name, field)}: {value}".rstrip())
        return lines

    def format(self, signature: type[Signature], demos: list[dict[str, Any]],
               inputs: dict[str, Any]) -> list[dict[str, Any]]:
        blocks = [textwrap.dedent(signature.instructions).strip()]
        for demo in demos:
            has_input = any(demo.get(k) is not None for k in signature.input_fields)
            has_output = any(demo.get(k) is not None for k in signature.output_fields)
            if has_input and has_output:  # a demo without both teaches nothing about the mapping
                lines = self._field_lines(signature.input_fields, demo)
                lines += self._field_lines(signature.output_fields, demo)
                blocks.append("\n".join(lines))
        query = self._field_lines(signature.input_fields, inputs)
        first_name, first_field = next(iter(signature.output_fields.items()))
        query.append(f"{field_label(first_name, first_field)}:")
        blocks.append("\n".join(query))
        return [{"role": "user", "content": f"\n\n{SEPARATOR}\n\n".join(blocks)}]

    def stop_sequences(self, signature: type[Signature]) -> list[str]:
        """Where a completion ends: an example separator or a line starting the next example."""
        stops = [f"\n{SEPARATOR}"]
        stops += [f"\n{field_label(n, f)}:" for n, f in signature.input_fields.items()]
        return stops

    # -- parsing -----------------------------------------------------------------------------------

    def _sections(self, signature: type[Signature], completion: str) -> dict[str, str]:
        """Split a completion (which starts inside the first output field) into raw field texts."""
        names = list(signature.output_fields)
        labels = {n: field_label(n, signature.output_fields[n]) for n in names}
        text = completion
        # The model sometimes repeats the label it was given ("Answer: Answer: 4").
        first = re.match(rf"\s*\**{re.escape(labels[names[0]])}\**\s*:", text, re.IGNORECASE)
        if first:
            text = text[first.end():]
        found: list[tuple[str, int, int]] = [(names[0], 0, 0)]
        position = 0
        for name in names[1:]:
            pattern = rf"(?im)^[ \t>*#_-]*{re.escape(labels[name])}[ \t*_]*:"
            match = re.compile(pattern).search(text, position)
            if match:
                found.append((name, match.start(), match.end()))
                position = match.end()
        sections = {}
        for i, (name, _, start) in enumerate(found):
            end = found[i + 1][1] if i + 1 < len(found) else len(text)
            sections[name] = text[start:end].strip()
        return sections

    def parse_partial(self, signature: type[Signature], completion: str) -> tuple[dict[str, Any], list[str]]:
        """Parsed fields and the names still missing (absent, empty or not of the field's type)."""
        sections = self._sections(signature, completion)
        fields: dict[str, Any] = {}
        for name, field in signature.output_fields.items():
            raw = sections.get(name, "")
            if not raw:
                continue
            try:
                fields[name] = _lenient_value(raw, field.annotation)
            except ValueError:
                continue
        missing = [n for n in signature.output_fields if n not in fields]
        return fields, missing

    def parse(self, signature: type[Signature], completion: str) -> dict[str, Any]:
        fields, missing = self.parse_partial(signature, completion)
        if missing:
            raise AdapterParseError(adapter_name=type(self).__name__, signature=signature, lm_response=completion,
                                    parsed_result=fields,
                                    message=f"the completion has no usable value for {missing}")
        return fields

    # -- calling -----------------------------------------------------------------------------------

    def _continue(self, lm: Any, lm_kwargs: dict[str, Any], signature: type[Signature], prompt: str,
                  text: str) -> str:
        """Ask for output fields the model did not write, continuing the same document with their label.

        Only absent fields are asked for: a present but unparseable value would come back the same.
        """
        names = list(signature.output_fields)
        kwargs = {k: v for k, v in lm_kwargs.items() if k not in ("n", "num_generations")}
        for _ in range(len(names) - 1):
            sections = self._sections(signature, text)
            absent = [n for n in names[1:] if not sections.get(n)]
            if not self.continue_missing or not absent or not sections.get(names[0]):
                break
            target = absent[0]
            head = " " + sections[names[0]]
            for name in names[1:names.index(target)]:
                head += f"\n{field_label(name, signature.output_fields[name])}: {sections[name]}"
            head += f"\n{field_label(target, signature.output_fields[target])}:"
            messages = [{"role": "user", "content": prompt + head}]
            with adapter_message_call(lm, messages):
                outputs = lm(messages=messages, **kwargs)
            extra = (outputs[0].get("text") if isinstance(outputs[0], dict) else outputs[0]) or ""
            text = head + extra
            if not extra.strip():
                break
        return text

    @with_capability_planning
    def __call__(self, lm: Any, lm_kwargs: dict[str, Any], signature: type[Signature],
                 demos: list[dict[str, Any]], inputs: dict[str, Any]) -> list[dict[str, Any]]:
        processed = self._call_preprocess(lm, lm_kwargs, signature, inputs)
        messages = self.format(processed, demos, inputs)
        lm_kwargs = dict(lm_kwargs)
        stops = list(lm_kwargs.get("stop") or [])
        lm_kwargs["stop"] = stops + [s for s in self.stop_sequences(processed) if s not in stops]
        with adapter_message_call(lm, messages):
            outputs = lm(messages=messages, **lm_kwargs)
        prompt = messages[0]["content"]
        completed = []
        for output in outputs:
            text = output.get("text") if isinstance(output, dict) else output
            text = self._continue(lm, lm_kwargs, processed, prompt, text or "")
            completed.append({**output, "text": text} if isinstance(output, dict) else text)
        return self._call_postprocess(processed, signature, completed, lm, lm_kwargs)

    async def acall(self, lm: Any, lm_kwargs: dict[str, Any], signature: type[Signature],
                    demos: list[dict[str, Any]], inputs: dict[str, Any]) -> list[dict[str, Any]]:
        # Local generation blocks anyway; run the synchronous path off the event loop.
        return await asyncio.to_thread(self.__call__, lm, lm_kwargs, signature, demos, inputs)

    def format_field_description(self, signature: type[Signature]) -> str:
        return ", ".join(f"`{n}`" for n in signature.fields)

    def format_field_structure(self, signature: type[Signature]) -> str:
        return "\n".join(f"{field_label(n, f)}: ..." for n, f in signature.fields.items())

    def format_task_description(self, signature: type[Signature]) -> str:
        return textwrap.dedent(signature.instructions).strip()

    def format_user_message_content(self, signature: type[Signature], inputs: dict[str, Any], prefix: str = "",
                                    suffix: str = "", main_request: bool = False) -> str:
        return "\n".join([prefix, *self._field_lines(signature.input_fields, inputs), suffix]).strip()

    def format_assistant_message_content(self, signature: type[Signature], outputs: dict[str, Any],
                                         missing_field_message: str | None = None) -> str:
        return "\n".join(self._field_lines(signature.output_fields, outputs))


def _is_base_local(lm: Any) -> bool:
    from flowopt.lm.engine import local_of

    local = local_of(lm)
    return local is not None and local.is_base


def adapter_for(lm: Any) -> Adapter:
    """The adapter ``lm`` follows best: :class:`CompletionAdapter` for base-model LocalLMs, else ChatAdapter."""
    return CompletionAdapter() if _is_base_local(lm) else dspy.ChatAdapter()


class AutoAdapter(Adapter):
    """Chooses per call: the completion adapter for base-model LocalLMs, ``fallback`` for the rest.

    Example:
        >>> import dspy
        >>> from flowopt.lm import AutoAdapter
        >>> dspy.configure(adapter=AutoAdapter())
    """

    def __init__(self, fallback: Adapter | None = None, completion: CompletionAdapter | None = None) -> None:
        super().__init__()
        self.fallback = fallback or dspy.ChatAdapter()
        self.completion = completion or CompletionAdapter()

    def pick(self, lm: Any) -> Adapter:
        return self.completion if _is_base_local(lm) else self.fallback

    def __call__(self, lm: Any, lm_kwargs: dict[str, Any], signature: type[Signature],
                 demos: list[dict[str, Any]], inputs: dict[str, Any]) -> list[dict[str, Any]]:
        return self.pick(lm)(lm, lm_kwargs, signature, demos, inputs)

    async def acall(self, lm: Any, lm_kwargs: dict[str, Any], signature: type[Signature],
                    demos: list[dict[str, Any]], inputs: dict[str, Any]) -> list[dict[str, Any]]:
        return await self.pick(lm).acall(lm, lm_kwargs, signature, demos, inputs)

    def format(self, signature: type[Signature], demos: list[dict[str, Any]],
               inputs: dict[str, Any]) -> list[dict[str, Any]]:
        # Without an LM at hand (e.g. DSPy's inspect helpers), show the fallback's format.
        return self.fallback.format(signature, demos, inputs)

    def parse(self, signature: type[Signature], completion: str) -> dict[str, Any]:
        return self.fallback.parse(signature, completion)
