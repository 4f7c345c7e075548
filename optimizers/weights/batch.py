"""Pack (prompt ids, completion ids) pairs into padded tensors and score completions with the model.

Layout (as in TRL and :mod:`flowopt.lm.generation`): prompts are left-padded to a common width and
completions right-padded after them, so completion token ``j`` of every row sits in the same column and
the model only has to produce logits for the completion columns. ``completion_mask`` is 1 on real
completion tokens; prompt and padding tokens are never scored.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowopt.optimizers.weights.loss import selective_logprobs

if TYPE_CHECKING:
    import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [N, P + C]
    attention_mask: torch.Tensor  # [N, P + C]
    position_ids: torch.Tensor  # [N, P + C]
    completion_ids: torch.Tensor  # [N, C]
    completion_mask: torch.Tensor  # [N, C], float: 1 on real completion tokens

    @property
    def completion_width(self) -> int:
        return int(self.completion_ids.shape[1])

    def to(self, device: Any) -> PackedBatch:
        return PackedBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids,
                                                     self.completion_ids, self.completion_mask)))


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int) -> PackedBatch:
    """Left-pad prompts, right-pad completions; every prompt needs at least one token."""
    import torch

    if len(prompts) != len(completions) or not prompts:
        raise ValueError("pack needs one completion per prompt and at least one pair")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt has no tokens")
    n = len(prompts)
    p_width = max(len(p) for p in prompts)
    c_width = max(1, max(len(c) for c in completions))
    ids = torch.full((n, p_width + c_width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, p_width + c_width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        start = p_width - len(prompt)
        ids[i, start:p_width] = torch.as_tensor(list(prompt), dtype=torch.long)
        if completion:
            ids[i, p_width:p_width + len(completion)] = torch.as_tensor(list(completion), dtype=torch.long)
        attention[i, start:p_width + len(completion)] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding shifts positions, as in generate()
    completion_mask = attention[:, p_width:].float()
    return PackedBatch(ids, attention, positions, ids[:, p_width:].clone(), completion_mask)


def _accepts_logits_to_keep(model: Any) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _forward_takes_logits_to_keep(base.__class__)


@functools.lru_cache(maxsize=64)
def _forward_takes_logits_to_keep(cls: Any) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def completion_logprobs(model: Any, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities ``[N, C]`` of each completion token under ``model`` (gradients flow if enabled).

    Padding columns hold garbage; multiply by ``batch.completion_mask``.
    """
    width = batch.completion_width
    kwargs: dict[str, Any] = {}
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = width + 1  # only the columns that predict completion tokens
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, use_cache=False, **kwargs).logits
    logits = logits[:, -(width + 1):-1, :]
    return selective_logprobs(logits, batch.completion_ids, temperature)
