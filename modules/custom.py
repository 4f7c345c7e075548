"""``Custom``: one LM call driven by a free-form instruction (AFlow's Custom operator)."""

from __future__ import annotations

import dspy

from flowopt.errors import ConfigError
from flowopt.modules.predict import Predict
from flowopt.registry import register_operator
from flowopt.settings import TEMPERATURE, check_settings
from flowopt.signature import SignatureSpec


@register_operator
class Custom(Predict):
    """A ``Predict`` whose behaviour is set by a required free-text ``instruction``.

    Example:
        >>> from flowopt.modules import Custom
        >>> op = Custom("question, answer -> critique", instruction="Point out the weakest step.")
        >>> op.spec.instructions
        'Point out the weakest step.'
    """

    op_name = "Custom"

    def __init__(self, signature: str | type[dspy.Signature] | SignatureSpec, instructions: str | None = None,
                 *, instruction: str | None = None, temperature: float | None = None) -> None:
        """``instructions``: the task description given to the LM (default: the signature's own).
        ``instruction``: a free-form instruction that replaces it. ``temperature``: sampling
        temperature in [0, 2] (``None``: the LM's own)."""
        check_settings("Custom", {"instruction": instruction, "temperature": temperature},
                       hints=Custom.__init__, bounds=TEMPERATURE)
        text = instruction if instruction is not None else instructions
        if text is None:
            text = SignatureSpec.parse(signature).instructions
        if not text or not text.strip():
            raise ConfigError("Custom needs a non-empty instruction",
                              fix='pass Custom("a -> b", instruction="What to do ...")')
        super().__init__(signature, text, temperature=temperature)
