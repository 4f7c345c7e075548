"""The search's answer to the winner's curse: the finalists the valset cannot tell apart, re-scored on
fresh training examples (demos of none of them), a chunk at a time while their order is uncertain.

Example:
    >>> from flowopt.optimizers.search.finalists import FRESH_CHUNKS, FRESH_CHUNK_MIN
    >>> FRESH_CHUNKS, FRESH_CHUNK_MIN
    (4, 8)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import dspy

from flowopt.compiler import StageContext
from flowopt.errors import BudgetExhausted
from flowopt.optimizers.search.pruning import worse_than
from flowopt.optimizers.search.space import CandidateSource
from flowopt.optimizers.search.study import SCORES, candidate_number

FRESH_CHUNKS, FRESH_CHUNK_MIN = 4, 8  # the finalists' fresh examples come in about 4 chunks of at least 8


def close_finalists(complete: list[Any], count: int, alpha: float) -> list[Any]:
    """The fully scored trials (at most ``count``) the valset cannot tell from the leader at one-sided
    ``alpha``, best first."""
    ranked = sorted(complete, key=lambda t: (-t.value, t.user_attrs.get("candidate", t.number)))
    leader = ranked[0].user_attrs[SCORES]
    return [t for t in ranked[: max(1, count)]
            if t is ranked[0] or not worse_than(t.user_attrs[SCORES], leader, alpha)]


def fresh_examples(programs: list[dspy.Module], ctx: StageContext) -> list[Any]:
    """The training examples the finalists are re-scored on: demos of none of ``programs``."""
    shown = [d for p in programs for _, pred in p.named_predictors() for d in pred.demos]
    return [e for e in ctx.trainset if not _is_shown(e, shown)][: max(1, len(ctx.valset) // 2)]


def rescore_finalists(close: list[Any], space: CandidateSource, program: dspy.Module, ctx: StageContext,
                      alpha: float) -> list[dict[str, Any]]:
    """Re-score the ``close`` finalists on training examples that are demos of none of them, a chunk at
    a time, only while their order is uncertain: after each chunk a finalist shown worse (valset + fresh
    so far, the confidence test at ``alpha``) than the best one stops. One report row per finalist; the
    winner is the best by valset + fresh mean of those left (``in_final``)."""
    programs = [space.apply(program, t) for t in close]
    fresh = fresh_examples(programs, ctx)
    fresh_scores: list[list[float]] = [[] for _ in close]
    left = list(range(len(close)))
    stopped: dict[int, str] = {}
    chunk = max(FRESH_CHUNK_MIN, math.ceil(len(fresh) / FRESH_CHUNKS))
    try:
        while len(left) > 1 and (done := len(fresh_scores[left[0]])) < len(fresh):
            batch = fresh[done:done + chunk]
            results = ctx.evaluate_many([(programs[i], batch) for i in left],
                                        desc=f"{len(left)} finalists, fresh {done + len(batch)}/{len(fresh)}")
            for i, result in zip(left, results):
                fresh_scores[i].extend(result.scores)
            both = {i: [*close[i].user_attrs[SCORES], *fresh_scores[i]] for i in left}
            best = max(left, key=lambda i: (sum(both[i]), -i))
            for i in left:
                if i != best and worse_than(both[i], both[best], alpha):
                    stopped[i] = (f"worse than candidate {candidate_number(close[best])} on valset + "
                                  f"{len(fresh_scores[i])} fresh examples at one-sided {alpha:.0%}")
            left = [i for i in left if i not in stopped]
    except BudgetExhausted:  # nothing fair to compare on: fall back to the valset alone
        fresh_scores, left, stopped = [[] for _ in close], list(range(len(close))), {}
    rows = []
    for i, (trial, extra) in enumerate(zip(close, fresh_scores)):
        val = trial.user_attrs[SCORES]
        rows.append({"candidate": candidate_number(trial), "kind": trial.user_attrs.get("kind"),
                     "val": round(_mean(val), 6), "fresh": round(_mean(extra), 6) if extra else None,
                     "fresh_n": len(extra), "combined": round(_mean([*val, *extra]), 6), "in_final": i in left,
                     **({"stopped": stopped[i]} if i in stopped else {}), "trial": trial})
    return rows


def _is_shown(example: Any, demos: list[Any]) -> bool:
    """Is ``example`` (its input fields) one of the ``demos``?"""
    inputs = example.inputs().toDict()
    return any(all(demo.get(k) == v for k, v in inputs.items()) for demo in demos)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0
