"""Helpers that derive internal predictor signatures from a node's declared signature."""

from __future__ import annotations

from typing import Any

from flowopt.signature import FieldSpec, SignatureSpec


def extend(spec: SignatureSpec, *, instructions: str, inputs: tuple[FieldSpec, ...] = (),
           outputs: tuple[FieldSpec, ...] | None = None) -> SignatureSpec:
    """The node's inputs plus ``inputs``, with ``outputs`` (default: the node's outputs)."""
    return SignatureSpec(instructions, spec.inputs + inputs, spec.outputs if outputs is None else outputs)


def render_outputs(spec: SignatureSpec, prediction: Any) -> str:
    """The node's output fields of a prediction as ``name: value`` lines (for review/selection prompts)."""
    return "\n".join(f"{f.name}: {prediction[f.name]}" for f in spec.outputs)
