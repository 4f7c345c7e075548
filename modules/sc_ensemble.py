"""``ScEnsemble``: sample n solutions, then keep the majority answer or let the LM pick one."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import dspy

from flowopt.concurrency import map_in_context
from flowopt.errors import ConfigError
from flowopt.modules.derived_signatures import extend, render_outputs
from flowopt.operator import Operator
from flowopt.registry import register_operator
from flowopt.settings import TEMPERATURE, between, check_settings, one_of
from flowopt.signature import FieldSpec, SignatureSpec

logger = logging.getLogger(__name__)

SELECT_MODES = ("majority", "lm")
MAX_SAMPLES = 64  # each sample is an LM call run in its own thread


@register_operator
class ScEnsemble(Operator):
    """Self-consistency ensemble over ``n`` chain-of-thought samples.

    ``select="majority"`` returns the sample whose ``vote_field`` (default: first output) is most
    common, ties going to the earliest sample; ``select="lm"`` asks a selector predictor for the index
    of the most consistent sample. Samples use distinct rollout ids at ``temperature`` so that DSPy's
    cache keeps them apart.

    Example:
        >>> from flowopt.modules import ScEnsemble
        >>> ScEnsemble("question -> answer", n=3).config()
        {'n': 3, 'select': 'majority', 'temperature': 0.7, 'vote_field': 'answer'}
    """

    op_name = "ScEnsemble"

    def __init__(self, signature: str | type[dspy.Signature] | SignatureSpec, instructions: str | None = None,
                 *, n: int = 5, select: str = "majority", temperature: float = 0.7,
                 vote_field: str | None = None) -> None:
        """``instructions``: the task description given to the LM (default: the signature's own).
        ``n``: samples (1..64); ``select``: ``"majority"`` vote or ``"lm"`` selection;
        ``temperature``: the samples' temperature; ``vote_field``: the output field voted on (default: the first)."""
        check_settings("ScEnsemble", {"n": n, "select": select, "temperature": temperature, "vote_field": vote_field},
                       hints=ScEnsemble.__init__,
                       bounds={"n": between(1, MAX_SAMPLES), "select": one_of(*SELECT_MODES), **TEMPERATURE})
        super().__init__(signature, instructions)
        self.n, self.select, self.temperature = n, select, float(temperature)
        self.vote_field = vote_field or self._spec.output_names[0]
        if self._spec.output(self.vote_field) is None:
            raise ConfigError(f"vote_field {self.vote_field!r} is not an output",
                              fix=f"use one of {self._spec.output_names}")
        self.generate = dspy.ChainOfThought(self._spec.to_dspy(), temperature=self.temperature)
        if select == "lm":
            selector = extend(
                self._spec,
                instructions="Several candidate solutions follow, numbered from 0. Choose the index of the "
                             "one most consistent with the others and most likely correct.",
                inputs=(FieldSpec("candidates", "str"),),
                outputs=(FieldSpec("best_index", "int"),),
            )
            self.selector = dspy.Predict(selector.to_dspy())

    def config(self) -> dict[str, Any]:
        return {"n": self.n, "select": self.select, "temperature": self.temperature,
                "vote_field": self.vote_field}

    def forward(self, **inputs: Any) -> dspy.Prediction:
        def sample(i: int) -> dspy.Prediction:
            return self.generate(**inputs, config={"rollout_id": i})

        samples = map_in_context(sample, [(i,) for i in range(self.n)], max_workers=self.n)
        picked = self.selector(**inputs, candidates=self._listing(samples)).best_index if self.select == "lm" else None
        return self._chosen(samples, picked)

    async def aforward(self, **inputs: Any) -> dspy.Prediction:
        samples = list(await asyncio.gather(*(self.generate.acall(**inputs, config={"rollout_id": i})
                                              for i in range(self.n))))
        picked = None
        if self.select == "lm":
            picked = (await self.selector.acall(**inputs, candidates=self._listing(samples))).best_index
        return self._chosen(samples, picked)

    def _listing(self, samples: list[dspy.Prediction]) -> str:
        return "\n\n".join(f"[{i}]\n{render_outputs(self._spec, s)}" for i, s in enumerate(samples))

    def _chosen(self, samples: list[dspy.Prediction], picked: Any) -> dspy.Prediction:
        """The LM selector's pick if it named a sample (``picked``), else the majority answer."""
        index = picked
        if picked is not None and (not isinstance(picked, int) or not 0 <= picked < len(samples)):
            logger.info("selector chose %r, outside 0..%d; falling back to majority", picked, self.n - 1)
            index = None
        chosen = samples[self._majority_index(samples) if index is None else index]
        return dspy.Prediction(**{name: chosen[name] for name in self._spec.output_names})

    def _majority_index(self, samples: list[dspy.Prediction]) -> int:
        keys = [str(s[self.vote_field]).strip().lower() for s in samples]
        winner, _ = Counter(keys).most_common(1)[0]
        return keys.index(winner)
