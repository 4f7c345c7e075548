"""The winner's-curse guard: finalists re-scored on fresh examples only while their order is uncertain.

``RandomSearch._finalists`` is driven directly with scripted trials and a scripted evaluator, so the
number of fresh examples each finalist is scored on is counted exactly.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import dspy
import pytest

from flowopt.compiler import BudgetTracker, EvalResult, StageContext
from flowopt.errors import BudgetExhausted
from flowopt.optimizers.search import RandomSearch
from flowopt.optimizers.search.stage import SCORES

TRAIN = [dspy.Example(question=f"t{i}", answer="x").with_inputs("question") for i in range(80)]
VAL = [dspy.Example(question=f"v{i}", answer="x").with_inputs("question") for i in range(100)]


class Space:
    """Each trial's program: a zero-shot Predict tagged with its candidate (no demo hides a fresh example)."""

    pools: dict[str, Any] = {}
    instructions: dict[str, Any] = {}

    def apply(self, program: dspy.Module, trial: Any) -> dspy.Module:
        out = dspy.Predict("question -> answer")
        out.candidate = trial.user_attrs["candidate"]
        return out


def _trial(candidate: int, val: list[float]) -> Any:
    attrs = {"candidate": candidate, SCORES: val}
    return SimpleNamespace(number=candidate, value=sum(val) / len(val), user_attrs=attrs)


def _ctx(fresh: dict[int, float], scored: dict[int, int], fail: bool = False) -> StageContext:
    """A context whose evaluator scores candidate c's fresh examples with probability ``fresh[c]`` of 1."""
    ctx = StageContext(trainset=TRAIN, valset=VAL, metric=lambda e, p, t=None: 1.0, budget=BudgetTracker(), seed=0,
                       rng=random.Random(0))

    def evaluate_many(jobs: Any, **_: Any) -> list[EvalResult]:
        if fail:
            raise BudgetExhausted("max_lm_calls", used=10, allowed=10)
        out = []
        for program, examples in jobs:
            c = program.candidate
            scored[c] = scored.get(c, 0) + len(examples)
            rng = random.Random(f"{c}:{examples[0].question}")
            out.append(EvalResult.from_scores([float(rng.random() < fresh[c]) for _ in examples]))
        return out

    ctx.evaluate_many = evaluate_many  # type: ignore[method-assign]
    return ctx


VAL_A = [1.0] * 60 + [0.0] * 40
VAL_B = [1.0] * 58 + [0.0] * 42  # 0.58 vs 0.60: the valset cannot tell them apart


def test_a_finalist_shown_worse_on_fresh_examples_stops_after_a_chunk():
    scored: dict[int, int] = {}
    rows = RandomSearch(finalists=3)._finalists([_trial(1, VAL_A), _trial(2, VAL_B)], Space(), dspy.Predict("q -> a"),
                                                _ctx({1: 0.0, 2: 1.0}, scored))
    by = {r["candidate"]: r for r in rows}
    # 50 fresh examples (half the valset) in chunks of 13: candidate 1 loses the first 13 outright.
    assert scored == {1: 13, 2: 13}
    assert not by[1]["in_final"] and "worse than candidate 2" in by[1]["stopped"]
    assert by[2]["in_final"] and by[2]["fresh"] == 1.0 and by[2]["fresh_n"] == 13
    assert by[1]["val"] == 0.6 and by[1]["fresh"] == 0.0  # both scores are reported


def test_finalists_whose_order_stays_uncertain_are_scored_on_every_fresh_example():
    # At 5%: these draws (both 0.6 in truth; 0.48 and 0.68 on the 50 fresh examples) leave the order uncertain
    # to the end. At the default 10% the last chunk stops candidate 1, after both were scored on all 50.
    scored: dict[int, int] = {}
    rows = RandomSearch(finalists=3, alpha=0.05)._finalists([_trial(1, VAL_A), _trial(2, VAL_B)], Space(),
                                                            dspy.Predict("q -> a"), _ctx({1: 0.6, 2: 0.6}, scored))
    assert scored == {1: 50, 2: 50}
    assert all(r["in_final"] and r["fresh_n"] == 50 and "stopped" not in r for r in rows)


def test_a_candidate_the_valset_already_ranks_below_is_no_finalist():
    scored: dict[int, int] = {}
    clearly_worse = [1.0] * 30 + [0.0] * 70  # 30 losses, 0 wins against VAL_A
    rows = RandomSearch(finalists=3)._finalists([_trial(1, VAL_A), _trial(2, clearly_worse)], Space(),
                                                dspy.Predict("q -> a"), _ctx({1: 0.5, 2: 0.5}, scored))
    assert [r["candidate"] for r in rows] == [1] and scored == {}  # a lone finalist costs no call


def test_a_budget_refusal_falls_back_to_the_valset_alone():
    rows = RandomSearch(finalists=3)._finalists([_trial(1, VAL_A), _trial(2, VAL_B)], Space(), dspy.Predict("q -> a"),
                                                _ctx({1: 0.5, 2: 0.5}, {}, fail=True))
    assert all(r["in_final"] and r["fresh_n"] == 0 and r["combined"] == r["val"] for r in rows)
    assert max(rows, key=lambda r: r["combined"])["candidate"] == 1


@pytest.mark.parametrize("finalists", [1, 2])
def test_the_finalist_count_caps_who_is_rescored(finalists):
    scored: dict[int, int] = {}
    trials = [_trial(1, VAL_A), _trial(2, VAL_B), _trial(3, VAL_B[::-1])]
    rows = RandomSearch(finalists=finalists)._finalists(trials, Space(), dspy.Predict("q -> a"),
                                                        _ctx({1: 0.6, 2: 0.6, 3: 0.6}, scored))
    assert len(rows) == finalists and len(scored) == (finalists if finalists > 1 else 0)
