"""The GRPO objective, token by token: clipped surrogate, k3 KL to the reference, and aggregation.

All tensors are ``[N, T]`` over completion tokens (N sequences = transitions, T = longest completion);
``mask`` is 1 on real completion tokens and 0 on padding, so prompt and padding tokens never count.
Padding columns are masked *before* anything is exponentiated: a padding column may hold any value
(e.g. log-prob -100 against a reference 0), and ``exp(100)`` is inf in float32, whose product with a
0 mask is NaN.

- ratio ``r = exp(logp - old_logp)``; surrogate ``-min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)``
  (the clip acts on both sides: below for negative advantages, above for positive ones);
- KL (when ``beta > 0``): the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (Schulman), unbiased
  for KL(pi || ref) and always >= 0, added per token as ``beta * kl``;
- aggregation ``"grpo"``: mean over each *rollout's* tokens, then mean over rollouts (DeepSeekMath's
  ``1/G sum_i 1/|o_i| sum_t``, where the output ``o_i`` of a program rollout is all of its LM calls).
  Every rollout weighs the same however many LM calls it made, so one that failed after its first
  call is not down-weighted (a per-call mean would give a rollout of k calls k times the weight).
  When every sequence is its own rollout this is the per-sequence mean;
  ``"dapo"``: sum over all tokens divided by the number of tokens (DAPO's token-level loss, so long
  completions are not down-weighted).

For gradient accumulation pass the whole optimiser batch's counts (``total_sequences`` /
``total_tokens``, or :func:`sequence_weights` of the whole batch): the micro-batch losses then sum to
exactly the loss of the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Aggregation = Literal["grpo", "dapo"]
AGGREGATIONS: tuple[str, ...] = ("grpo", "dapo")


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) from samples of pi: ``exp(d) - d - 1`` with ``d = ref - logp``;
    0 where ``mask`` is 0 (masked before ``exp``)."""
    import torch

    delta = ref_logps - logps
    if mask is not None:
        delta = torch.where(mask.bool(), delta, torch.zeros_like(delta))
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
               ref_logps: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> TokenLoss:
    """Clipped surrogate (plus ``beta`` * k3 KL) for every token; ``advantages`` is ``[N]`` or ``[N, T]``.

    Where ``mask`` is 0 the log-ratios are set to 0 before ``exp``, so padding never yields inf or NaN.
    """
    import torch

    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logps.dtype)
    log_ratio = logps - old_logps
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        kl_tokens = kl_k3(logps, ref_logps, mask)
        loss = loss + beta * kl_tokens
        kl = kl_tokens.detach()
    r = ratio.detach()
    return TokenLoss(loss=loss, ratio=r, clipped_low=(r < 1 - epsilon) & (advantages < 0),
                     clipped_high=(r > 1 + epsilon_high) & (advantages > 0), kl=kl)


def sequence_weights(token_counts: Sequence[int], rollouts: Sequence[int], aggregation: Aggregation, *,
                     batch_tokens: int | None = None, batch_rollouts: int | None = None) -> list[float]:
    """The weight of each sequence's token sum in the loss of a whole batch.

    ``rollouts[i]`` names the rollout sequence ``i`` (one LM call) belongs to. ``"grpo"``: 1 / (tokens of
    its rollout x number of rollouts); ``"dapo"``: 1 / (tokens of the batch). When the sequences are one
    process's share of the batch (whole rollouts each), ``batch_tokens`` / ``batch_rollouts`` give the
    whole batch's counts.

    Example:
        >>> sequence_weights([2, 2, 4], [0, 0, 1], "grpo")  # rollout 0: two calls of 2 tokens; rollout 1: one of 4
        [0.125, 0.125, 0.125]
        >>> sequence_weights([2, 2, 4], [0, 1, 2], "grpo")
        [0.16666666666666666, 0.16666666666666666, 0.08333333333333333]
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "dapo":
        total = max(1, sum(token_counts) if batch_tokens is None else batch_tokens)
        return [1.0 / total] * len(token_counts)
    per_rollout: dict[int, int] = {}
    for count, rollout in zip(token_counts, rollouts):
        per_rollout[rollout] = per_rollout.get(rollout, 0) + count
    n_rollouts = len(per_rollout) if batch_rollouts is None else batch_rollouts
    return [1.0 / (max(1, per_rollout[r]) * n_rollouts) for r in rollouts]


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation = "grpo", *,
              total_sequences: int | None = None, total_tokens: int | None = None,
              weights: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce ``[N, T]`` per-token values to the scalar loss, counting only tokens where ``mask`` is 1.

    Without ``weights`` each sequence is its own rollout; ``weights`` (``[N]``, from
    :func:`sequence_weights`) weigh each sequence's token sum instead.

    Example:
        >>> import torch
        >>> per_token = torch.tensor([[1.0, 3.0], [2.0, 0.0]]); mask = torch.tensor([[1, 1], [1, 0]])
        >>> float(aggregate(per_token, mask, "grpo")), float(aggregate(per_token, mask, "dapo"))
        (2.0, 2.0)
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    import torch

    mask = mask.to(per_token.dtype)
    masked = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    if weights is not None:
        return (masked.sum(-1) * weights.to(per_token.dtype)).sum()
    if aggregation == "grpo":
        per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_sequence.sum() / (total_sequences if total_sequences is not None else per_token.shape[0])
    denominator = total_tokens if total_tokens is not None else mask.sum().clamp(min=1.0)
    return masked.sum() / denominator
