"""AdamW over the adapter's parameters with a warm-up then constant / linear / cosine learning rate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from flowopt.errors import ConfigError

Schedule = Literal["constant", "linear", "cosine"]
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")


def lr_factor(step: int, *, total: int, warmup: int, schedule: Schedule) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based).

    Example:
        >>> [round(lr_factor(s, total=4, warmup=1, schedule="linear"), 2) for s in range(4)]
        [0.5, 1.0, 0.67, 0.33]
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(params: Sequence[Any], *, lr: float, weight_decay: float, total_steps: int, warmup: int,
                   schedule: Schedule) -> tuple[Any, Any]:
    """``(optimizer, scheduler)``; call ``scheduler.step()`` after each ``optimizer.step()``."""
    import torch

    params = list(params)
    if not params:
        raise ConfigError("the student has no trainable parameters", fix="train a LoRA adapter (start_adapter)")
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total=total_steps, warmup=warmup, schedule=schedule))
    return optimizer, scheduler
