"""Out of memory in a weights stage: stop with the settings to lower, not a raw allocator error.

A CUDA ``torch.OutOfMemoryError``, a CPU allocator failure (``RuntimeError: ... can't allocate memory``,
e.g. under a container's memory limit or ``RLIMIT_AS``) and Python's ``MemoryError`` all become one
:class:`~flowopt.errors.OutOfMemoryError` naming the stage's memory settings with their values. The
settings listed first (micro-batch size, gradient checkpointing) trade time for memory without changing
what is trained, so a stage may change them on resume (``Stage.memory_settings``); the others (batch size,
group size, sequence length) change the training and start the stage over.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from typing import Any

from flowopt.errors import OutOfMemoryError

logger = logging.getLogger(__name__)

# How allocators word it: torch's CPU allocator ("can't allocate memory"), CUDA's caching allocator ("out of
# memory"), and oneDNN, whose kernels report a failed workspace allocation only as a primitive it could not
# create (seen under RLIMIT_AS in a LoRA backward pass).
_ALLOCATOR_MESSAGES = ("can't allocate memory", "out of memory", "not enough memory", "could not create a primitive")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure (CPU or GPU)."""
    if isinstance(err, MemoryError):
        return True
    import torch

    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _ALLOCATOR_MESSAGES)


@contextlib.contextmanager
def out_of_memory_errors(stage: str, free_settings: dict[str, Any], other_settings: dict[str, Any], *,
                         resume_note: str) -> Iterator[None]:
    """Turn an allocation failure inside the block into an :class:`OutOfMemoryError` for ``stage``.

    ``free_settings`` may change on resume (micro-batch size, gradient checkpointing); ``other_settings``
    change the training (batch size, group size, sequence length). ``resume_note`` says what a resumed
    run keeps.

    Example:
        >>> with out_of_memory_errors("finetune", {"micro_batch_size": 8}, {"batch_size": 8},
        ...                           resume_note="nothing is lost"):
        ...     pass
    """
    try:
        yield
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        _release_memory()
        lower = [f"{k}={v} -> {max(1, v // 2)}" for k, v in free_settings.items()
                 if k in ("micro_batch_size", "micro_batch_tokens") and isinstance(v, int) and v > 1]
        if free_settings.get("gradient_checkpointing") is False:
            lower.append("gradient_checkpointing=True")
        changes = [f"{k} (now {v})" for k, v in other_settings.items()]
        fix = (f"rerun with resume after lowering {' or '.join(lower)} (same training, less memory)"
               if lower else "rerun with resume on a machine with more memory")
        if changes:
            fix += f"; if that is not enough, lower {', '.join(changes)}, which changes the training"
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise OutOfMemoryError(f"{stage} ran out of memory ({detail}); {resume_note}",
                               settings={**free_settings, **other_settings}, fix=fix) from err


def _release_memory() -> None:
    """Drop what the failed step allocated, so the process can write its report and exit cleanly."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
