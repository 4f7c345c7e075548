"""Timing on a shared machine: the sides of a comparison interleaved over repeats, medians reported.

Running side A's repeats and then side B's lets a burst of load from another job fall on one side only;
interleaving (A, B, A, B, ...) spreads it over both, and the median ignores a single disturbed repeat.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``(fn(), seconds it took)``."""
    began = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - began


def interleaved(cases: Mapping[str, Callable[[], T]], repeats: int, *, warmup: int = 0) -> dict[str, list[T]]:
    """Call every case once per round, in order, for ``warmup`` untimed rounds then ``repeats`` rounds.

    Returns each case's results of the kept rounds, in round order. The cases measure what they need
    (wrap them in :func:`timed`, or return a count and the seconds).

    Example:
        >>> runs = interleaved({"a": lambda: timed(lambda: sum(range(10)))[1], "b": lambda: 0.0}, repeats=3)
        >>> [len(v) for v in runs.values()]
        [3, 3]
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    results: dict[str, list[T]] = {name: [] for name in cases}
    for round_index in range(warmup + repeats):
        for name, case in cases.items():
            value = case()
            if round_index >= warmup:
                results[name].append(value)
    return results


def median_seconds(fn: Callable[[], Any], repeats: int, *, warmup: int = 1) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn)[1] for _ in range(max(1, repeats)))


def spread(values: Sequence[float], digits: int = 6) -> dict[str, Any]:
    """``{"median", "min", "max", "n", "values"}`` of the repeats, rounded, for the results file."""
    if not values:
        raise ValueError("spread() needs at least one value")
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "n": len(values), "values": [round(v, digits) for v in values]}
