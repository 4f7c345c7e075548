"""The settings and result of one completion: :class:`RowSettings` in, :class:`Sample` out.

Kept apart from the decode loop so that every layer (the loop, the engine, servers, training code) can
name them without importing the loop.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RowSettings:
    """Decoding settings of one row (one completion); ``logprobs`` asks for per-token log-probs."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Sample:
    """One generated completion.

    ``completion_ids`` are exactly the tokens the model produced (a final EOS included when it ended
    that way; tokens of a stop string included), which is what training code scores. ``text`` is their
    decoding with special tokens dropped and the text cut before the first stop string (OpenAI's rule).
    ``logprobs`` (float32 CPU tensor, one per completion token) is filled when asked for.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "cancelled" (its on_tokens said stop)
    logprobs: torch.Tensor | None = None
    prompt_index: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def derive_seed(seed: int, index: int) -> int:
    """A distinct, reproducible seed for the ``index``-th sample drawn under ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logprobs`` ``[rows, vocab]``, drawn with the row's uniform in ``[0, 1)``.

    Example:
        >>> import torch
        >>> inverse_cdf(torch.tensor([[0.25, 0.75]]).log(), torch.tensor([0.5])).tolist()
        [1]
    """
    import torch

    cdf = logprobs.exp().cumsum(-1)
    # right=True: the first token whose cumulative mass exceeds the target, so a zero-probability
    # token is never drawn, even for a uniform of exactly 0.
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return picked.clamp(max=cdf.shape[-1] - 1)
