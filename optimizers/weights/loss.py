"""The GRPO objective, token by token: clipped surrogate, k3 KL to the reference, and aggregation.

All tensors are ``[N, T]`` over completion tokens (N sequences = transitions, T = longest completion);
``mask`` is 1 on real completion tokens and 0 on padding, so prompt and padding tokens never count.

- ratio ``r = exp(logp - old_logp)``; surrogate ``-min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)``
  (the clip acts on both sides: below for negative advantages, above for positive ones);
- KL (when ``beta > 0``): the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (Schulman), unbiased
  for KL(pi || ref) and always >= 0, added per token as ``beta * kl``;
- aggregation ``"grpo"``: mean over each sequence's tokens, then mean over sequences (DeepSeekMath);
  ``"dapo"``: sum over all tokens divided by the number of tokens (DAPO's token-level loss, so long
  completions are not down-weighted).

For gradient accumulation pass the whole optimiser batch's counts (``total_sequences`` /
``total_tokens``): the micro-batch losses then sum to exactly the loss of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Aggregation = Literal["grpo", "dapo"]
AGGREGATIONS: tuple[str, ...] = ("grpo", "dapo")


def selective_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[targets]`` in float32, without keeping a ``[N, T, V]`` log-softmax.

    The training forward divides by the sampling temperature so that its log-probabilities are those
    of the distribution the completions were drawn from.
    """
    import torch

    rows = []
    # One sequence at a time: the float32 copy of [T, V] stays small even with a 262k vocabulary.
    for row_logits, row_targets in zip(logits, targets):
        row = row_logits.float()
        if temperature != 1.0:
            row = row / temperature
        picked = row.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row, dim=-1))
    return torch.stack(rows)


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) from samples of pi: ``exp(d) - d - 1`` with ``d = ref - logp``."""
    import torch

    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


@dataclass
class TokenLoss:
    """Per-token loss and what happened to each token (for the report)."""

    loss: torch.Tensor  # [N, T]
    ratio: torch.Tensor  # [N, T], detached
    clipped_low: torch.Tensor  # [N, T] bool: ratio < 1 - epsilon with a negative advantage
    clipped_high: torch.Tensor  # [N, T] bool: ratio > 1 + epsilon_high with a positive advantage
    kl: torch.Tensor | None  # [N, T], detached, when beta > 0


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, *,
               epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
               ref_logps: torch.Tensor | None = None) -> TokenLoss:
    """Clipped surrogate (plus ``beta`` * k3 KL) for every token; ``advantages`` is ``[N]`` or ``[N, T]``."""
    import torch

    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        kl_tokens = kl_k3(logps, ref_logps)
        loss = loss + beta * kl_tokens
        kl = kl_tokens.detach()
    r = ratio.detach()
    return TokenLoss(loss=loss, ratio=r, clipped_low=(r < 1 - epsilon) & (advantages < 0),
                     clipped_high=(r > 1 + epsilon_high) & (advantages > 0), kl=kl)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation = "grpo", *,
              total_sequences: int | None = None, total_tokens: int | None = None) -> torch.Tensor:
    """Reduce ``[N, T]`` per-token values to the scalar loss, counting only tokens where ``mask`` is 1.

    Example:
        >>> import torch
        >>> per_token = torch.tensor([[1.0, 3.0], [2.0, 0.0]]); mask = torch.tensor([[1, 1], [1, 0]])
        >>> float(aggregate(per_token, mask, "grpo")), float(aggregate(per_token, mask, "dapo"))
        (2.0, 2.0)
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if aggregation == "grpo":
        per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_sequence.sum() / (total_sequences if total_sequences is not None else per_token.shape[0])
    denominator = total_tokens if total_tokens is not None else mask.sum().clamp(min=1.0)
    return masked.sum() / denominator
