"""AdamW over the adapter's parameters with a warm-up then constant / linear / cosine learning rate, and
the guard that skips an optimizer step whose gradient is not finite."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from flowopt.errors import ConfigError, NonFiniteGradientError
from flowopt.optimizers.weights.distributed import SINGLE, World

logger = logging.getLogger(__name__)

NONFINITE_LIMIT = 3  # consecutive batches with a non-finite gradient norm before training stops

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


def count_skipped_step(scheduler: Any) -> None:
    """Advance the learning-rate schedule for a step not taken (the schedule counts steps, taken or skipped)."""
    with warnings.catch_warnings():  # torch warns when the scheduler steps before any optimizer step
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


class StepGuard:
    """Takes an optimizer step only when the (clipped, all-reduced) gradient norm is finite, and stops
    training with a :class:`~flowopt.errors.NonFiniteGradientError` after ``limit`` batches in a row had
    a non-finite one.

    AdamW would turn a NaN gradient into NaN weights and every later sample into garbage; a skipped step
    keeps the weights and the optimizer's moments as they were. Every rank takes the same decision
    (``world.any``); the norm, computed from gradients already summed over the ranks, is the same on each.
    ``settings`` (name: current value) are named in the warning and the error as the ones to change.

    Example:
        >>> guard = StepGuard("grpo", settings={"learning_rate": 5e-5})
        >>> guard.step(float("nan"), optimizer, scheduler)  # doctest: +SKIP
        False
    """

    def __init__(self, stage: str, *, settings: Mapping[str, object], world: World = SINGLE,
                 limit: int = NONFINITE_LIMIT) -> None:
        self.stage, self.settings, self.world, self.limit = stage, dict(settings), world, limit
        self.in_a_row = 0

    def step(self, norm: Any, optimizer: Any, scheduler: Any) -> bool:
        """``optimizer.step()`` and ``scheduler.step()`` when ``norm`` is finite on every rank (True); else
        drop the gradients, count the step in the schedule and return False."""
        if not self.world.any(not math.isfinite(float(norm))):
            optimizer.step()
            scheduler.step()
            return True
        optimizer.zero_grad(set_to_none=True)
        count_skipped_step(scheduler)
        return False

    def record(self, finite: bool, where: str) -> None:
        """After each batch (``where`` names it, e.g. ``"update 4"``): warn about a skipped one and raise on
        the ``limit``-th in a row."""
        if finite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        settings = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        fix = (f"lower learning_rate or max_grad_norm, or load the model in float32 (LocalLM(dtype='float32')), "
               f"or turn gradient_checkpointing off (now {settings})")
        logger.warning("%s %s: the gradient norm is not finite; the optimizer step was skipped and the weights "
                       "kept (%d in a row, training stops at %d). If it repeats: %s",
                       self.stage, where, self.in_a_row, self.limit, fix)
        if self.in_a_row >= self.limit:
            raise NonFiniteGradientError(
                f"{self.stage}: the gradient norm was NaN or infinite on {self.in_a_row} batches in a row (the last: "
                f"{where}); each step was skipped, so the weights are those of the last finite step",
                steps=self.in_a_row, settings=self.settings,
                fix=f"{fix}; a resumed run continues from the last checkpoint")
