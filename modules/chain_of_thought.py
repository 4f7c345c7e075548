"""``ChainOfThought``: reason step by step, then answer (wraps ``dspy.ChainOfThought``)."""

from __future__ import annotations

from typing import Any

import dspy

from flowopt.operator import Operator
from flowopt.registry import register_operator
from flowopt.settings import TEMPERATURE, check_settings
from flowopt.signature import SignatureSpec


@register_operator
class ChainOfThought(Operator):
    """A prediction preceded by a ``reasoning`` field (not part of the node's outputs).

    Example:
        >>> from flowopt.modules import ChainOfThought
        >>> ChainOfThought("question -> answer").spec.output_names
        ['answer']
    """

    op_name = "ChainOfThought"

    def __init__(self, signature: str | type[dspy.Signature] | SignatureSpec, instructions: str | None = None,
                 *, temperature: float | None = None) -> None:
        """``instructions``: the task description given to the LM (default: the signature's own).
        ``temperature``: sampling temperature in [0, 2] (``None``: the LM's own)."""
        check_settings("ChainOfThought", {"temperature": temperature}, hints=ChainOfThought.__init__,
                       bounds=TEMPERATURE)
        super().__init__(signature, instructions)
        self.temperature = temperature
        config = {} if temperature is None else {"temperature": temperature}
        self.cot = dspy.ChainOfThought(self._spec.to_dspy(), **config)

    def config(self) -> dict[str, Any]:
        return {} if self.temperature is None else {"temperature": self.temperature}

    def forward(self, **inputs: Any) -> dspy.Prediction:
        return self.cot(**inputs)

    async def aforward(self, **inputs: Any) -> dspy.Prediction:
        return await self.cot.acall(**inputs)
