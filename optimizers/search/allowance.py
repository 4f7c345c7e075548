"""How many candidates the search races: the planned set under a call budget, and the extras' allowance.

Without a budget the extras are paid for by what pruning saved: the allowance is what BFRS pays for as
many programs (every planned candidate scored on the whole valset; the incumbent's scores are the
compiler's baseline), less every call the search made (bootstraps, proposals, pruned and full scores)
and half a valset kept for the finalists' fresh examples. Under a ``Budget(max_lm_calls=...)`` the
planned set is cut to half of what the budget pays for (the other half goes to extras of the kinds
that win), raced 4 at a time, and a wave starts only while the budget pays for it.

Example:
    >>> from flowopt.optimizers.search import RandomSearch
    >>> planned_count(RandomSearch(), 100, None), planned_count(RandomSearch(), 100, 700)
    (19, 7)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowopt.optimizers.search.pruning import first_look
from flowopt.optimizers.search.study import SCORES

if TYPE_CHECKING:
    from flowopt.compiler import StageContext
    from flowopt.optimizers.search.stage import RandomSearch

STAGE_CALLS = "stage_calls"  # study user attr: the LM calls the search has made, over runs (for the allowance)


def planned_count(stage: RandomSearch, n_val: int, remaining: int | None) -> int:
    """How many of the ``n_candidates`` planned candidates to race: all of them, or under a call budget
    half of what it pays for at about a third of the valset each (what a pruned candidate costs on
    average) after one valset for the finalists and the final check (at least 3)."""
    if remaining is None or stage.pruner == "none":
        return stage.n_candidates
    per_candidate = max(first_look(n_val, stage.minibatch_size), n_val / 3) + 2 * stage.max_demos
    return max(min(3, stage.n_candidates), min(stage.n_candidates, int((remaining - n_val) // per_candidate) // 2))


def _per_candidate(study: Any) -> float:
    """What a candidate cost so far, on average: its valset scores."""
    trials = [t for t in study.get_trials(deepcopy=False) if SCORES in t.user_attrs]
    return sum(len(t.user_attrs[SCORES]) for t in trials) / max(1, len(trials))


def wave_affordable(study: Any, n_val: int, count: int, ctx: StageContext) -> bool:
    """Does the call budget pay for ``count`` more candidates at what one cost so far, keeping half a
    valset for the finalists' fresh examples (the pick's valset scores are memoised for the final check)?"""
    remaining = ctx.budget.remaining_calls()
    return remaining is None or remaining - n_val // 2 >= count * _per_candidate(study)


def extras_affordable(stage: RandomSearch, study: Any, planned: int, n_val: int, done: int, width: int,
                      ctx: StageContext, start_calls: int) -> int:
    """How many extra candidates to try next (0: stop); ``start_calls``: the call count the search started
    at (less the calls of an earlier run it resumes)."""
    if stage.extra is not None:
        return min(width, stage.extra - done)
    if done >= stage.max_extra:
        return 0
    remaining = ctx.budget.remaining_calls()
    used = ctx.budget.snapshot().lm_calls - start_calls
    study.set_user_attr(STAGE_CALLS, used)  # kept in the study: a resumed search counts them too
    room = remaining - n_val // 2 if remaining is not None else (planned - 1) * n_val - used - n_val // 2
    return max(0, min(width, stage.max_extra - done, int(room // max(1.0, _per_candidate(study)))))
