"""When to stop scoring a candidate: the minibatch schedule and the rung pruners.

Example:
    >>> from flowopt.optimizers.search.pruning import rungs
    >>> rungs(100, 13)
    [13, 26, 52, 100]
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def rungs(n: int, first: int) -> list[int]:
    """Cumulative minibatch ends: first, 2*first, 4*first, ..., n."""
    out, size = [], max(1, first)
    while size < n:
        out.append(size)
        size *= 2
    return [*out, n] if n else [0]


def rung_pruner(rule: str, reduction_factor: int = 3) -> Any:
    """An optuna pruner for ``rule`` ``"halving"`` or ``"median"``."""
    import optuna

    class RungPruner(optuna.pruners.BasePruner):
        """Judge a trial against every trial scored on the same examples so far (running, pruned or
        complete; trials cut short are left out), once at least 3 have been.

        ``"halving"`` keeps the best ``1/reduction_factor`` (ties go to the lower candidate number, so the verdict
        does not depend on timing); ``"median"`` prunes a trial strictly below the median.
        """

        def prune(self, study: Any, trial: Any) -> bool:
            step = trial.last_step
            if step is None:
                return False
            rivals = [t for t in study.get_trials(deepcopy=False)
                      if step in t.intermediate_values
                      and t.state not in (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.FAIL)]
            if len(rivals) < 3:
                return False
            value = trial.intermediate_values[step]
            if rule == "median":
                return value < statistics.median(t.intermediate_values[step] for t in rivals)
            ranked = sorted(rivals, key=lambda t: (-t.intermediate_values[step],
                                                   t.user_attrs.get("candidate", t.number)))
            keep = {t.number for t in ranked[: math.ceil(len(ranked) / reduction_factor)]}
            return trial.number not in keep

    return RungPruner()
