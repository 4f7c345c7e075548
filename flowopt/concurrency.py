"""Threads that see the caller's ``dspy.context`` (LM, trace, adapter)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def map_in_context(fn: Callable[..., T], arg_lists: Sequence[Sequence[Any]], *, max_workers: int) -> list[T]:
    """``[fn(*args) for args in arg_lists]`` on up to ``max_workers`` threads, results in order.

    Every call runs in its own copy of the caller's context variables, which is where DSPy keeps
    ``dspy.context`` overrides, so settings and traces apply in the workers as in the caller.
    """
    if max_workers <= 1 or len(arg_lists) <= 1:
        return [fn(*args) for args in arg_lists]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(arg_lists))) as pool:
        futures = [pool.submit(contextvars.copy_context().run, fn, *args) for args in arg_lists]
        return [f.result() for f in futures]
