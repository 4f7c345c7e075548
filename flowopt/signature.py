"""Typed signatures as plain data: the IR's view of a ``dspy.Signature``.

A :class:`SignatureSpec` is what a node declares (instructions, typed input and output fields). It
converts to and from ``dspy.Signature`` so operators can use DSPy predictors, and to and from JSON so
a workflow file never stores Python objects. Types are looked up in a fixed table: loading a file
never evaluates a type expression.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field
from typing import Any

import dspy

from flowopt.errors import WorkflowError

# The closed set of field types the IR knows. Names are what the JSON stores.
TYPES: dict[str, Any] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": bool,
    "list[str]": list[str],
    "list[int]": list[int],
    "list[float]": list[float],
    "dict": dict,
    "Any": Any,
}
_TYPE_NAMES = {repr(v): k for k, v in TYPES.items()}


def type_name(annotation: Any) -> str:
    """Return the IR name of a Python annotation, e.g. ``list[str] -> "list[str]"``."""
    for name, value in TYPES.items():
        if annotation is value or annotation == value:
            return name
    if annotation is list:
        return "list[str]"
    if typing.get_origin(annotation) is dict:
        return "dict"
    raise WorkflowError(
        f"field type {annotation!r} cannot be stored in a workflow",
        fix=f"use one of {sorted(TYPES)}",
    )


def types_compatible(source: str, target: str) -> bool:
    """Whether a value of IR type ``source`` may feed an input of IR type ``target``."""
    if source == target or "Any" in (source, target):
        return True
    # An int is a valid float; everything else must match exactly, so an edit that would feed
    # a list into a str input is refused before any LM call.
    return source == "int" and target == "float"


@dataclass(frozen=True)
class FieldSpec:
    """One typed field of a signature."""

    name: str
    type: str = "str"
    desc: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "type": self.type, "desc": self.desc}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, node: str | None = None) -> FieldSpec:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            raise WorkflowError(
                f"a signature field must be an object with a non-empty 'name', got {data!r}",
                node=node, fix='write fields as {"name": "question", "type": "str", "desc": ""}',
            )
        ftype = data.get("type", "str")
        if ftype not in TYPES:
            raise WorkflowError(
                f"unknown type {ftype!r}", node=node, field=data["name"],
                fix=f"use one of {sorted(TYPES)}",
            )
        return cls(name=data["name"], type=ftype, desc=str(data.get("desc", "")))


@dataclass(frozen=True)
class SignatureSpec:
    """Instructions plus typed inputs and outputs of a node.

    Example:
        >>> spec = SignatureSpec.parse("question -> answer: int")
        >>> [f.name for f in spec.inputs], spec.outputs[0].type
        (['question'], 'int')
        >>> spec.to_dspy().output_fields["answer"].annotation
        <class 'int'>
    """

    instructions: str = ""
    inputs: tuple[FieldSpec, ...] = field(default_factory=tuple)
    outputs: tuple[FieldSpec, ...] = field(default_factory=tuple)

    @property
    def input_names(self) -> list[str]:
        return [f.name for f in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [f.name for f in self.outputs]

    def input(self, name: str) -> FieldSpec | None:
        return next((f for f in self.inputs if f.name == name), None)

    def output(self, name: str) -> FieldSpec | None:
        return next((f for f in self.outputs if f.name == name), None)

    @classmethod
    def parse(cls, signature: str | type[dspy.Signature] | SignatureSpec, instructions: str | None = None
              ) -> SignatureSpec:
        """Build from a DSPy signature string (``"a, b: int -> c"``), class, or another spec."""
        if isinstance(signature, SignatureSpec):
            spec = signature
        else:
            try:
                sig = dspy.Signature(signature) if isinstance(signature, str) else signature
            except Exception as err:  # dspy raises ValueError/SyntaxError/TypeError for bad strings
                raise WorkflowError(
                    f"cannot parse signature {signature!r}: {err}",
                    fix="write it as 'input1, input2: int -> output'",
                ) from err
            spec = cls.from_dspy(sig)
        if instructions is not None:
            spec = cls(instructions, spec.inputs, spec.outputs)
        return spec

    @classmethod
    def from_dspy(cls, sig: type[dspy.Signature]) -> SignatureSpec:
        def fields(items: dict[str, Any]) -> tuple[FieldSpec, ...]:
            out = []
            for name, info in items.items():
                extra = info.json_schema_extra or {}
                desc = extra.get("desc", "")
                # dspy fills a placeholder desc "${name}"; the IR stores only what the user wrote.
                if desc == f"${{{name}}}":
                    desc = ""
                out.append(FieldSpec(name, type_name(info.annotation), desc))
            return tuple(out)

        spec = cls("", fields(sig.input_fields), fields(sig.output_fields))
        instructions = sig.instructions or ""
        # dspy invents "Given the fields ..., produce the fields ..." when none were given; keep the IR
        # free of it so an untouched node serialises as it was written.
        if instructions == default_instructions(spec):
            instructions = ""
        return cls(instructions, spec.inputs, spec.outputs)

    def to_dspy(self) -> type[dspy.Signature]:
        """The ``dspy.Signature`` class of this spec, built once per distinct spec (building one is a
        pydantic model, about 10 ms; loading a workflow builds one per node). Signature classes are
        never changed in place (``with_instructions`` and the like return new ones), so equal specs
        share one.

        Example:
            >>> SignatureSpec.parse("q -> a").to_dspy() is SignatureSpec.parse("q -> a").to_dspy()
            True
        """
        return _dspy_signature(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "instructions": self.instructions,
            "inputs": [f.to_dict() for f in self.inputs],
            "outputs": [f.to_dict() for f in self.outputs],
        }

    @classmethod
    def from_dict(cls, data: Any, *, node: str | None = None) -> SignatureSpec:
        if not isinstance(data, dict):
            raise WorkflowError("'signature' must be an object", node=node,
                                fix='write {"instructions": "", "inputs": [...], "outputs": [...]}')
        inputs = tuple(FieldSpec.from_dict(f, node=node) for f in data.get("inputs", []))
        outputs = tuple(FieldSpec.from_dict(f, node=node) for f in data.get("outputs", []))
        names = [f.name for f in inputs + outputs]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise WorkflowError("field declared twice in the signature", node=node, field=dup,
                                fix="give every input and output field a distinct name")
        return cls(str(data.get("instructions", "")), inputs, outputs)


@functools.lru_cache(maxsize=4096)
def _dspy_signature(spec: SignatureSpec) -> type[dspy.Signature]:
    fields: dict[str, tuple[Any, Any]] = {}
    for f in spec.inputs:
        fields[f.name] = (TYPES[f.type], dspy.InputField(desc=f.desc) if f.desc else dspy.InputField())
    for f in spec.outputs:
        fields[f.name] = (TYPES[f.type], dspy.OutputField(desc=f.desc) if f.desc else dspy.OutputField())
    return dspy.make_signature(fields, spec.instructions or None)


def default_instructions(spec: SignatureSpec) -> str:
    """The text DSPy generates for a signature without instructions (stored as "" in the IR)."""
    inputs = ", ".join(f"`{f.name}`" for f in spec.inputs)
    outputs = ", ".join(f"`{f.name}`" for f in spec.outputs)
    return f"Given the fields {inputs}, produce the fields {outputs}."
