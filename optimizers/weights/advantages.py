"""Group-relative advantages: each rollout's reward against the other rollouts of the same example.

``rewards`` has shape ``[B, G]`` (B examples, G rollouts each). The baseline is always the group mean;
``scaling`` picks the divisor:

- ``"group"``: the group's standard deviation (GRPO, DeepSeekMath);
- ``"batch"``: one standard deviation over the whole batch (more robust when a group is near-constant);
- ``"none"``: no division (Dr. GRPO: avoids favouring questions that are too easy or too hard).

Standard deviations are unbiased (Bessel-corrected) with ``eps`` added, as in TRL, so results compare
one to one. A group of identical rewards gets advantage 0 under every scaling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Scaling = Literal["group", "batch", "none"]
SCALINGS: tuple[str, ...] = ("group", "batch", "none")


def _std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    import torch

    n = values.numel() if dim is None else values.shape[dim]
    if n < 2:  # one sample has no spread; 0 keeps the advantage at 0 instead of NaN
        return torch.zeros(()) if dim is None else torch.zeros(values.shape[0], dtype=values.dtype)
    return values.std() if dim is None else values.std(dim=dim)


def group_advantages(rewards: torch.Tensor, scaling: Scaling = "group", eps: float = 1e-4) -> torch.Tensor:
    """Advantages ``[B, G]`` for rewards ``[B, G]``.

    Example:
        >>> import torch
        >>> group_advantages(torch.tensor([[1.0, 0.0], [0.5, 0.5]]), "none").tolist()
        [[0.5, -0.5], [0.0, 0.0]]
    """
    import torch

    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [B, G], got {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scaling == "none":
        return centred
    std = _std(rewards, dim=1).unsqueeze(1) if scaling == "group" else _std(rewards)
    return centred / (std + eps)
