"""The one sampler: batched completions with per-row settings and, when asked, per-token log-probs.

A KV-cache loop of its own rather than ``model.generate``: every row carries its own settings (greedy or
temperature, top-k/top-p, seed, stop strings, token limit), GRPO needs the log-probability of every
sampled token under the distribution it was drawn from (``softmax(logits / T)``, which the training
forward reproduces), and with small models the Python around each step costs as much as the step.
The loop itself (static KV cache, prefill apart, optionally compiled step, rows leaving as they end)
is :mod:`flowopt.lm.decoder`; how tokens are drawn is :mod:`flowopt.lm.decode`. :func:`sample` runs one
round of rows admitted together; :mod:`flowopt.lm.continuous` lets rows join a running batch.

Layout as in :mod:`flowopt.lm.packing`: prompts left-padded, completion tokens after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flowopt.lm.decode import Row
from flowopt.lm.decoder import Decoder, DecodeRun
from flowopt.lm.settings import RowSettings, Sample, derive_seed, inverse_cdf

if TYPE_CHECKING:
    import torch

__all__ = ["RowSettings", "Sample", "derive_seed", "inverse_cdf", "sample"]


def sample(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], rows: Sequence[RowSettings], *,
           generator: torch.Generator | None = None, decoder: Decoder | None = None) -> list[Sample]:
    """One completion per prompt, in one round (no gradients); ``rows[i]`` are prompt ``i``'s settings.

    ``generator`` draws every sampled token from one seeded stream (see :mod:`flowopt.lm.decode`);
    ``decoder`` reuses a :class:`~flowopt.lm.decoder.Decoder` (its cache and compiled steps) of ``model``.

    Example:
        >>> samples = sample(model, tokenizer, [[2, 17, 18]], [RowSettings(max_new_tokens=8)])  # doctest: +SKIP
    """
    if len(prompts) != len(rows):
        raise ValueError("one RowSettings per prompt")
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt has no tokens")
    decoder = decoder or Decoder(lambda: model, tokenizer)
    run = DecodeRun(generator=generator, round_size=len(prompts))
    items = [Row(list(p), r, index=i) for i, (p, r) in enumerate(zip(prompts, rows))]
    decoder.admit(run, items)
    decoder.harvest(run)
    while run.rows:
        decoder.step(run)
        decoder.harvest(run)
    return [item.sample(tokenizer, decoder.eos) for item in items]
