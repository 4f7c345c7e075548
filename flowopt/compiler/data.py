"""Checks and splits of the compile data, before any LM call."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from flowopt.errors import DataError

VAL_FRACTION = 0.3


def _program_inputs(program: Any) -> list[str] | None:
    io = getattr(program, "io", None)
    names = getattr(io, "input_names", None)
    return list(names) if names else None


def check_examples(program: Any, examples: Sequence[Any], what: str) -> list[Any]:
    """Return the examples as a list; raise :class:`DataError` naming the first bad one."""
    import dspy

    if examples is None:
        raise DataError(f"{what} is None", fix=f"pass a list of dspy.Example as {what}")
    examples = list(examples)
    needed = _program_inputs(program)
    out = []
    for i, ex in enumerate(examples):
        if isinstance(ex, dict):
            ex = dspy.Example(**ex)
        if not isinstance(ex, dspy.Example):
            raise DataError(f"{what}[{i}] is a {type(ex).__name__}, not a dspy.Example",
                            fix="build examples as dspy.Example(question=..., answer=...).with_inputs('question')")
        if needed is not None:
            missing = [f for f in needed if f not in ex]
            if missing:
                raise DataError(f"{what}[{i}] has no field {missing[0]!r}, which the program takes as input "
                                f"(it has {sorted(ex.keys())})",
                                fix=f"give every example the program's inputs {needed}")
            if ex._input_keys is None:
                ex = ex.with_inputs(*needed)
        elif ex._input_keys is None:
            raise DataError(f"{what}[{i}] does not say which fields are inputs",
                            fix="call .with_inputs('question', ...) on every example")
        out.append(ex)
    return out


def split_trainset(trainset: list[Any], seed: int) -> tuple[list[Any], list[Any], str]:
    """Deterministic split when no valset is given: a seeded shuffle, 30% to validation."""
    n = len(trainset)
    if n < 2:
        raise DataError(f"the trainset has {n} example and no valset was given, so nothing is left to validate on",
                        fix="pass valset=..., or at least 2 training examples")
    order = list(range(n))
    random.Random(f"flowopt-split:{seed}").shuffle(order)
    n_val = min(n - 1, max(1, round(n * VAL_FRACTION)))
    val = [trainset[i] for i in sorted(order[:n_val])]
    train = [trainset[i] for i in sorted(order[n_val:])]
    return train, val, f"split from the trainset ({n_val} of {n} examples, seed {seed}) since no valset was given"
