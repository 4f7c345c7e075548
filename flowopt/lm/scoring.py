"""The one scorer: log-probabilities of completion tokens, computed in chunks of the vocabulary's logits.

A 262k-token vocabulary makes the logits the largest tensor of a training step: ``[batch, time,
vocab]`` in float32 is 8 GiB for 8 x 1024 tokens. Here the decoder's hidden states are taken at the
completion tokens only (prompt and padding columns are never projected), and the output projection,
float32 log-softmax and gather run on ``chunk_elements // vocab`` tokens at a time. When gradients
are on and there is more than one chunk, each chunk is checkpointed: its logits are freed after the
forward pass and recomputed in the backward pass, so at most one chunk of float32 logits is alive
at any time (the price: the output projection runs twice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowopt.lm.forward import Halves, halves
from flowopt.lm.packing import PackedBatch

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_ELEMENTS = 1 << 24  # float32 logits per chunk: 64 MiB (64 tokens of a 262k vocabulary)


def completion_logprobs(model: object, batch: PackedBatch, temperature: float = 1.0, *,
                        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """``log softmax(logits / temperature)`` of each completion token, float32 ``[N, C]``, 0.0 on padding.

    Gradients flow when enabled (the training forward divides by the sampling temperature, so its
    log-probs are those of the distribution the completions were drawn from).

    Example:
        >>> from flowopt.lm.packing import pack
        >>> logps = completion_logprobs(model, pack([[2, 5]], [[6, 3]], pad_id=0))  # doctest: +SKIP
    """
    import torch

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    parts = halves(model)
    width = batch.completion_width
    hidden, _ = parts.hidden(batch.input_ids, batch.attention_mask, batch.position_ids)
    # Column t predicts token t + 1: the completion tokens are predicted by the C columns before them.
    mask = batch.completion_mask.bool()
    picked = hidden[:, -(width + 1):-1, :][mask]  # [M, H]: real completion tokens only
    targets = batch.completion_ids[mask]
    step = max(1, chunk_elements // parts.vocab_size)
    recompute = torch.is_grad_enabled() and picked.requires_grad and len(targets) > step
    pieces = []
    for start in range(0, len(targets), step):
        h, t = picked[start:start + step], targets[start:start + step]
        if recompute:
            from torch.utils.checkpoint import checkpoint

            pieces.append(checkpoint(_chunk_logprobs, parts, h, t, temperature, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(parts, h, t, temperature))
    out = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
    if pieces:
        out = out.masked_scatter(mask, torch.cat(pieces))
    return out


def _chunk_logprobs(parts: Halves, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    import torch

    logits = parts.logits(hidden)
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
