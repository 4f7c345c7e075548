"""``Refine``: answer, then review and revise for at most ``max_rounds`` rounds."""

from __future__ import annotations

from typing import Any

import dspy

from flowopt.modules.derived_signatures import extend, render_outputs
from flowopt.operator import Operator
from flowopt.registry import register_operator
from flowopt.settings import between, check_settings
from flowopt.signature import FieldSpec, SignatureSpec


@register_operator
class Refine(Operator):
    """Draft with chain of thought, then loop review -> revise until the reviewer accepts.

    The loop is bounded by ``max_rounds`` (the IR never has cycles; bounded loops live here).

    Example:
        >>> from flowopt.modules import Refine
        >>> Refine("question -> answer", max_rounds=2).config()
        {'max_rounds': 2}
    """

    op_name = "Refine"

    def __init__(self, signature: str | type[dspy.Signature] | SignatureSpec, instructions: str | None = None,
                 *, max_rounds: int = 1) -> None:
        """``instructions``: the task description given to the LM (default: the signature's own).
        ``max_rounds``: review-and-revise rounds after the draft (1..10)."""
        super().__init__(signature, instructions)
        check_settings("Refine", {"max_rounds": max_rounds}, hints=Refine.__init__,
                       bounds={"max_rounds": between(1, 10)})
        self.max_rounds = max_rounds
        attempt = (FieldSpec("attempt", "str"),)
        self.generate = dspy.ChainOfThought(self._spec.to_dspy())
        self.review = dspy.Predict(extend(
            self._spec, inputs=attempt,
            instructions="Check the attempt step by step. Say whether it is correct and, if not, what to fix.",
            outputs=(FieldSpec("feedback", "str"), FieldSpec("is_correct", "bool")),
        ).to_dspy())
        self.revise = dspy.ChainOfThought(extend(
            self._spec, inputs=(*attempt, FieldSpec("feedback", "str")),
            instructions="Revise the attempt using the feedback and give the corrected outputs.",
        ).to_dspy())

    def config(self) -> dict[str, Any]:
        return {"max_rounds": self.max_rounds}

    def forward(self, **inputs: Any) -> dspy.Prediction:
        current = self.generate(**inputs)
        for _ in range(self.max_rounds):
            attempt = render_outputs(self._spec, current)
            review = self.review(**inputs, attempt=attempt)
            if review.is_correct is True:
                break
            current = self.revise(**inputs, attempt=attempt, feedback=review.feedback)
        return dspy.Prediction(**{name: current[name] for name in self._spec.output_names})

    async def aforward(self, **inputs: Any) -> dspy.Prediction:
        current = await self.generate.acall(**inputs)
        for _ in range(self.max_rounds):
            attempt = render_outputs(self._spec, current)
            review = await self.review.acall(**inputs, attempt=attempt)
            if review.is_correct is True:
                break
            current = await self.revise.acall(**inputs, attempt=attempt, feedback=review.feedback)
        return dspy.Prediction(**{name: current[name] for name in self._spec.output_names})
