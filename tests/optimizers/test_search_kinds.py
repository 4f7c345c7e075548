"""The search's extra candidates by kind: the bandit, the kinds a space can make, and the defaults
(DSPy BFRS's candidate set planned, extras that change the leader, a call budget that is kept)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import dspy
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "compiler"))
from fakes import category_lm, exact, examples, reverse_answer

import flowopt
from flowopt import ConfigError
from flowopt.optimizers.search import RandomSearch
from flowopt.optimizers.search.kinds import (
    EXPLORE_ORDER,
    KINDS,
    choose_kind,
    kind_record,
    leader_params,
    next_kind,
    win,
)
from flowopt.optimizers.search.space import SearchSpace
from flowopt.testing import scripted_lm

TRAIN, VAL = examples(15, categories=True), examples(24, 100, categories=True)
GOOD = "Reverse the question and prefix it with #."


def test_a_win_needs_a_lead_of_a_standard_error_not_a_bare_lead():
    assert win([1.0] * 4 + [0.0] * 16, [0.0] * 4 + [0.0] * 16)  # 4 wins, no loss: z = 2
    assert not win([1.0] * 3 + [0.0] * 2 + [0.0] * 15, [0.0] * 3 + [1.0] * 2 + [0.0] * 15)  # 3 v 2: z = 0.45
    assert not win([1.0] * 20, [1.0] * 20)  # the same answers
    assert win([0.9, 0.8, 0.9], [0.5, 0.5, 0.5])  # graded scores: the z of the paired difference


def test_kind_record_counts_each_extra_against_its_own_leader():
    leader = [1.0] * 10 + [0.0] * 10
    better = [1.0] * 20
    record = kind_record([("subset", better, leader), ("subset", leader, leader), ("bootstrap", [0.0] * 20, leader)])
    assert record == {"subset": (1, 1), "bootstrap": (0, 1)}


def test_the_bandit_gives_most_draws_to_the_kind_that_wins_and_tries_an_untried_one():
    rng = random.Random(0)
    draws = [choose_kind(rng, ("bootstrap", "subset"), {"bootstrap": (0, 8), "subset": (6, 2)}) for _ in range(400)]
    assert draws.count("subset") > 380
    # A kind never tried (Beta(1, 1)) is drawn over one that keeps losing.
    draws = [choose_kind(rng, ("bootstrap", "instruction"), {"bootstrap": (0, 10)}) for _ in range(400)]
    assert draws.count("instruction") > 300


def test_every_available_kind_is_asked_once_before_the_bandit_draws():
    available = ("bootstrap", "subset", "instruction")
    # Untried kinds first, those the planned bootstraps do not cover before the others, whatever the rng.
    assert EXPLORE_ORDER[0] == "instruction"
    for seed in range(20):
        rng = random.Random(seed)
        assert next_kind(rng, available, {}, set()) == "instruction"
        assert next_kind(rng, available, {}, {"instruction"}) == "subset"
        assert next_kind(rng, available, {}, {"instruction", "subset"}) == "bootstrap"
    # Every kind asked: the bandit decides, and a kind that keeps winning gets the draws.
    rng = random.Random(0)
    record = {"bootstrap": (0, 6), "subset": (0, 6), "instruction": (5, 1)}
    draws = [next_kind(rng, available, record, set(available)) for _ in range(200)]
    assert draws.count("instruction") > 180
    assert next_kind(rng, (), {}, set()) == "subset"  # nothing to vary but a sampled subset


def test_an_instruction_extra_takes_an_instruction_not_yet_tried_on_the_same_leader():
    space = SearchSpace()
    space.predictors, space.instructions = ["self"], {"self": ["original", "a", "b", "c"]}
    leader = {"p0.instr": 0, "p0.k": 2}
    tried: list[dict] = []
    for i in range(3):  # three extras on one leader: the three other instructions, each once
        params = space.change_one("instruction", leader, random.Random(i), tried)
        assert params["p0.k"] == 2 and params["p0.instr"] != 0
        tried.append(params)
    assert sorted(t["p0.instr"] for t in tried) == [1, 2, 3]
    # All tried: any other than the leader's own again.
    assert space.change_one("instruction", leader, random.Random(9), tried)["p0.instr"] in (1, 2, 3)


def test_leader_params_split_by_what_they_set():
    params = {"p0.k": 2, "p0.d0": 3, "p0.d1": 1, "p0.instr": 1, "self.temp": 0, "node:a.n": 1}
    assert leader_params(params, "demos") == {"p0.k": 2, "p0.d0": 3, "p0.d1": 1}
    assert leader_params(params, "instruction") == {"p0.instr": 1}
    assert leader_params(params, "settings") == {"self.temp": 0, "node:a.n": 1}


def test_defaults_plan_dspy_bfrs_default_set():
    stage = RandomSearch()
    assert stage.n_candidates == 19 and stage.seeded_count() == 16  # BFRS(16): 16 shuffled + 3
    assert tuple(stage.kinds) == KINDS and stage.proposer_lm == "task"
    assert stage.finalists == 0  # the winner's-curse re-scoring is off unless asked for


def test_unknown_kinds_are_refused_with_a_fix():
    with pytest.raises(ConfigError, match="kinds must be a non-empty subset") as info:
        RandomSearch(kinds=("bootstrap", "mutation"))
    assert "kinds=" in info.value.fix


def _instruction_lm():
    def answer(req):  # right only under the good instruction; demos change nothing
        q = req.inputs.get("question", "")
        if "instruction" in req.output_fields:
            return {"instruction": GOOD}
        return {"answer": reverse_answer(q) if "Reverse the question" in req.system else q}

    return scripted_lm(answer, model="scripted/kinds", cache=False)


def _run(lm, stage, **kwargs):
    with dspy.context(lm=lm):
        return flowopt.compile(dspy.Predict("question -> answer"), TRAIN, exact, valset=VAL, stages=[stage],
                               quiet=True, num_threads=4, **kwargs)


def test_extras_change_the_leader_and_find_the_instruction_the_task_lm_proposed():
    # Demos change nothing here; only the instruction the task LM itself proposes does.
    stage = RandomSearch(n_candidates=4, seeded=1, max_demos=2, max_labeled_demos=2, extra=8, n_proposals=2)
    out = _run(_instruction_lm(), stage)
    row = out.report.stage("search")
    assert row.info["instruction_candidates"] == {"self": 2}  # the original and the proposal (the same text twice)
    assert sum(row.info["extra_kinds"].values()) == 8 and "instruction" in row.info["extra_kinds"]
    assert row.info["best_kind"] == "instruction" and GOOD in out.predictors()[0].signature.instructions
    assert out.report.best_score == 1.0 > out.report.baseline_score


def test_one_wave_of_extras_asks_each_kind_once_not_the_kind_the_seed_favours():
    # Three extras in one wave, all asked before any finishes: one of each kind the space can make.
    stage = RandomSearch(n_candidates=4, seeded=1, max_demos=2, max_labeled_demos=2, extra=3, n_proposals=2)
    row = _run(_instruction_lm(), stage).report.stage("search")
    assert row.info["extra_kinds"] == {"instruction": 1, "subset": 1, "bootstrap": 1}


def test_without_anything_to_vary_but_demos_the_extras_are_bootstraps_and_subsets():
    stage = RandomSearch(n_candidates=4, seeded=1, max_demos=2, max_labeled_demos=2, extra=6, proposer_lm=None)
    row = _run(category_lm(cache=False), stage).report.stage("search")
    assert set(row.info["extra_kinds"]) <= {"bootstrap", "subset"} and sum(row.info["extra_kinds"].values()) == 6
    assert row.info["instruction_candidates"] == {"self": 1}


def test_the_defaults_under_a_call_budget_keep_to_it_and_return_a_scored_program():
    lm = category_lm(cache=False)
    out = _run(lm, RandomSearch(max_demos=2, max_labeled_demos=2), budget=flowopt.Budget(max_lm_calls=180))
    row = out.report.stage("search")
    assert lm.engine.calls <= 180
    assert row.info["fully_scored"] >= 2 and row.kept  # waves that fit: a scored pick, not a wave cut short
    assert row.info["seeded"] < 16  # the planned set is sized to the budget, not DSPy's 19 programs
