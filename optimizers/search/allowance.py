"""How many candidates the search races: the planned set under a call budget, and the extras' allowance.

Without a budget the extras are paid for by what pruning saved: the allowance is what BFRS pays for as
many programs (every planned candidate scored on the whole valset; the incumbent's scores are the
compiler's baseline), less every call the search made (bootstraps, proposals, pruned and full scores)
and half a valset kept back. Under a ``Budget(max_lm_calls=...)`` the planned set is cut to half of what
the budget pays for (the other half goes to extras of the kinds that win), raced 4 at a time, and a wave
starts only while the budget pays for it.

The half valset kept back pays the finalists' fresh examples when they are on (``finalists=k``). With
``finalists=0`` (the default) it is a margin: a wave is admitted on what a candidate cost so far *on
average*, and a wave that costs more (its candidates race longer) is stopped by the budget mid-wave,
its calls lost and its candidates not picked. Spent on more extras instead, it lowered the held-out
score where demos are the only lever (issue 27's tuning, ``benchmarks/results/search_defaults_confirm.md``,
notes), so it stays.

Example:
    >>> from flowopt.optimizers.search import RandomSearch
    >>> planned_count(RandomSearch(), 100, None), planned_count(RandomSearch(), 100, 700)
    (19, 7)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flowopt.optimizers.search.pruning import first_look
from flowopt.optimizers.search.study import SCORES

if TYPE_CHECKING:
    from flowopt.compiler import StageContext
    from flowopt.optimizers.search.stage import RandomSearch

STAGE_CALLS = "stage_calls"  # study user attr: the LM calls the search has made, over runs (for the allowance)
BUILD_CALLS = "build_calls"  # study user attr: the LM calls the first run's build of the space made


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
    valset back (the finalists' fresh examples, or with none a margin for a wave dearer than the average;
    the pick's valset scores are memoised for the final check)?"""
    remaining = ctx.budget.remaining_calls()
    return remaining is None or remaining - n_val // 2 >= count * _per_candidate(study)


def requests(ctx: StageContext) -> int:
    """LM calls asked for so far, paid or answered by DSPy's cache. The allowance counts these, not only
    the paid ones: a resumed search replays the candidate a kill cut short from the cache, and must count
    those calls as the uninterrupted run counted them (with the cache off the two are the same)."""
    snapshot = ctx.budget.snapshot()
    return snapshot.lm_calls + snapshot.cache_hits


class SearchCalls:
    """The calls a search has used, over runs: its space's build in this run, plus its candidates' calls,
    which are kept in the study after each wave so that a resumed search counts an earlier run's too."""

    def __init__(self, ctx: StageContext, built_from: int) -> None:
        self.ctx = ctx
        self.build = requests(ctx) - built_from
        self.candidates_from = requests(ctx)
        self.wave_from = self.candidates_from

    def start_wave(self) -> None:
        """Mark the start of a wave: :meth:`record` splits the calls made since between its candidates."""
        self.wave_from = requests(self.ctx)

    def resume_from(self, study: Any) -> None:
        self.candidates_from -= int(study.user_attrs.get(STAGE_CALLS, 0))
        # The space's build counts what the first run paid for it: a resumed run rebuilds it from the run_dir's
        # checkpoint for fewer calls, and counting those would leave it more room for extras than the
        # uninterrupted run had.
        self.build = int(study.user_attrs.get(BUILD_CALLS, self.build))
        study.set_user_attr(BUILD_CALLS, self.build)

    def record(self, study: Any, racing: float = 0.0) -> int:
        """Keep the candidates' calls in the study; every call used so far.

        ``racing``: the share of this wave's valset scores held by candidates not yet told (still racing).
        A kill cuts those short and a resumed search scores them again from the first example, counting
        those calls anew, so the study keeps only the rest of the wave's calls (the split is by scores: the
        candidates of a wave run the same program on the same examples)."""
        now = requests(self.ctx)
        candidates = now - self.candidates_from
        study.set_user_attr(STAGE_CALLS, candidates - round(racing * (now - self.wave_from)))
        return self.build + candidates


def extras_affordable(stage: RandomSearch, study: Any, planned: int, n_val: int, done: int, width: int,
                      ctx: StageContext, calls: SearchCalls) -> int:
    """How many extra candidates to try next (0: stop); ``calls``: what the search has used."""
    if stage.extra is not None:
        return min(width, stage.extra - done)
    if done >= stage.max_extra:
        return 0
    remaining = ctx.budget.remaining_calls()
    used = calls.record(study)
    room = remaining - n_val // 2 if remaining is not None else (planned - 1) * n_val - used - n_val // 2
    return max(0, min(width, stage.max_extra - done, int(room // max(1.0, _per_candidate(study)))))


def racing_share(scores: Mapping[int, Sequence[float]], racing: set[int]) -> float:
    """The share of a wave's valset ``scores`` that its candidates still ``racing`` hold.

    Example:
        >>> racing_share({1: [1.0] * 20, 2: [0.0] * 60}, {2})
        0.75
    """
    total = sum(len(v) for v in scores.values())
    return sum(len(scores[k]) for k in racing) / total if total else 0.0


EXTRA_WAVES = "extra_waves"  # study user attr: the sizes of the extra waves decided so far, over runs


def next_extra_wave(stage: RandomSearch, study: Any, planned: int, n_val: int, done: int, width: int,
                    ctx: StageContext, calls: SearchCalls) -> int:
    """The size of the next wave of extras (0: stop), kept in the study before the wave starts.

    A resumed search replays the sizes an earlier run decided instead of deciding again: the study
    then already holds the extras that run finished after its decision, so a fresh decision would read
    a later state, cut the extras into other waves and ask other candidates than an uninterrupted run.
    """
    decided = [int(size) for size in study.user_attrs.get(EXTRA_WAVES, [])]
    sizes_before, index = 0, 0
    while index < len(decided) and sizes_before < done:
        sizes_before, index = sizes_before + decided[index], index + 1
    if index < len(decided) and sizes_before == done:
        return decided[index]
    count = extras_affordable(stage, study, planned, n_val, done, width, ctx, calls)
    if count > 0:
        study.set_user_attr(EXTRA_WAVES, [*decided[:index], count])
    return count
