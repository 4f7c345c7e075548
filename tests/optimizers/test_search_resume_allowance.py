"""A resumed search decides its extras as the uninterrupted run did (test_kill_resume checks it end to end)."""

from __future__ import annotations

from types import SimpleNamespace

import optuna

from flowopt.optimizers.search import RandomSearch
from flowopt.optimizers.search.allowance import BUILD_CALLS, EXTRA_WAVES, SearchCalls, next_extra_wave, racing_share


class Counter:
    """A StageContext's budget as the allowance reads it: requests so far, paid or from the cache."""

    def __init__(self) -> None:
        self.calls = 0

    def snapshot(self) -> SimpleNamespace:
        return SimpleNamespace(lm_calls=self.calls, cache_hits=0)


def _ctx() -> SimpleNamespace:
    return SimpleNamespace(budget=Counter())


def test_a_resumed_search_counts_the_first_runs_build_not_its_own_cheaper_one():
    study = optuna.create_study()
    first = _ctx()
    first.budget.calls = 23  # the space's build: bootstraps and proposals
    calls = SearchCalls(first, built_from=0)
    calls.resume_from(study)
    first.budget.calls += 40  # candidates
    assert calls.record(study) == 63 and study.user_attrs[BUILD_CALLS] == 23

    resumed = _ctx()  # rebuilt from the run_dir's checkpoint: no calls
    calls = SearchCalls(resumed, built_from=0)
    calls.resume_from(study)
    resumed.budget.calls += 5
    assert calls.record(study) == 23 + 40 + 5


def test_extra_waves_decided_by_an_earlier_run_are_replayed_not_decided_again():
    study = optuna.create_study()
    stage = RandomSearch(extra=100)  # a fresh decision would be a full wave: min(width, 100 - done)
    study.set_user_attr(EXTRA_WAVES, [2, 3])
    ctx, calls = _ctx(), SearchCalls(_ctx(), built_from=0)
    assert next_extra_wave(stage, study, 10, 20, 0, 4, ctx, calls) == 2
    assert next_extra_wave(stage, study, 10, 20, 2, 4, ctx, calls) == 3
    assert next_extra_wave(stage, study, 10, 20, 5, 4, ctx, calls) == 4  # past the replayed ones: decided now
    assert study.user_attrs[EXTRA_WAVES] == [2, 3, 4]  # and kept before the wave starts, for a later resume
    assert next_extra_wave(RandomSearch(extra=9), study, 10, 20, 9, 4, ctx, calls) == 0
    assert study.user_attrs[EXTRA_WAVES] == [2, 3, 4]  # a stop is not a wave


def test_a_kill_mid_wave_does_not_count_the_cut_candidates_first_rungs_twice():
    scores = {0: [1.0] * 20, 1: [0.0] * 20}  # a wave of two, both scored on the first 20 examples
    study = optuna.create_study()
    first = _ctx()
    first.budget.calls = 10  # the space's build
    calls = SearchCalls(first, built_from=0)
    calls.resume_from(study)
    calls.start_wave()
    first.budget.calls += 40
    calls.record(study, racing_share(scores, {0}))  # candidate 1 pruned; candidate 0 races on: then a kill

    resumed = _ctx()  # rebuilt from the checkpoint: no calls; candidate 0 is asked again from example 0
    calls = SearchCalls(resumed, built_from=0)
    calls.resume_from(study)
    calls.start_wave()
    resumed.budget.calls += 20 + 30  # its first 20 examples again (from the cache), then the 30 left
    uninterrupted = 10 + 40 + 30
    assert calls.record(study, 0.0) == uninterrupted  # was 10 + 40 + 50: the first rung counted twice


def test_the_racing_share_is_the_untold_candidates_scores_over_the_waves():
    scores = {0: [1.0] * 20, 1: [0.0] * 60, 2: []}
    assert racing_share(scores, {1}) == 0.75 and racing_share(scores, set()) == 0.0
    assert racing_share({3: []}, {3}) == 0.0  # nothing scored yet: nothing to keep out
