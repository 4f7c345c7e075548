"""``Predict``: one LM call from inputs to outputs (wraps ``dspy.Predict``)."""

from __future__ import annotations

from typing import Any

import dspy

from flowopt.operator import Operator
from flowopt.registry import register_operator
from flowopt.settings import TEMPERATURE, check_settings
from flowopt.signature import SignatureSpec


@register_operator
class Predict(Operator):
    """A single prediction.

    Example:
        >>> from flowopt.modules import Predict
        >>> op = Predict("question -> answer", temperature=0.0)
        >>> op.config()
        {'temperature': 0.0}
    """

    op_name = "Predict"

    def __init__(self, signature: str | type[dspy.Signature] | SignatureSpec, instructions: str | None = None,
                 *, temperature: float | None = None) -> None:
        """``instructions``: the task description given to the LM (default: the signature's own).
        ``temperature``: sampling temperature in [0, 2] (``None``: the LM's own)."""
        check_settings("Predict", {"temperature": temperature}, hints=Predict.__init__, bounds=TEMPERATURE)
        super().__init__(signature, instructions)
        self.temperature = temperature
        self.predict = dspy.Predict(self._spec.to_dspy(), **self._lm_config())

    def _lm_config(self) -> dict[str, Any]:
        return {} if self.temperature is None else {"temperature": self.temperature}

    def config(self) -> dict[str, Any]:
        return self._lm_config()

    def forward(self, **inputs: Any) -> dspy.Prediction:
        return self.predict(**inputs)

    async def aforward(self, **inputs: Any) -> dspy.Prediction:
        return await self.predict.acall(**inputs)
