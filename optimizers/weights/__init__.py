"""Weights stages: ``BootstrapFinetune`` (LoRA SFT on teacher traces) and ``GRPO`` (RL on whole-program
rollouts), trained in process on a local transformers model (CPU for small models, CUDA bf16 when present),
or data parallel on N launched processes (``accelerate launch -m flowopt.optimizers.weights``, :mod:`.distributed`).

Importing this package is cheap: torch, transformers and peft load when a stage runs.

Example:
    >>> from flowopt.optimizers.weights import GRPO, BootstrapFinetune
    >>> stages = [BootstrapFinetune(epochs=3), GRPO(steps=50, group_size=8)]
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GRPO", "BootstrapFinetune", "InferenceServer", "LoraSettings", "Policy", "group_advantages",
           "run_rollouts"]

_LAZY = {
    "GRPO": "flowopt.optimizers.weights.grpo",
    "BootstrapFinetune": "flowopt.optimizers.weights.sft",
    "InferenceServer": "flowopt.optimizers.weights.served",
    "LoraSettings": "flowopt.optimizers.weights.policy",
    "Policy": "flowopt.optimizers.weights.policy",
    "group_advantages": "flowopt.optimizers.weights.advantages",
    "run_rollouts": "flowopt.optimizers.weights.rollout",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flowopt.optimizers.weights' has no attribute {name!r}")
