"""Each budget limit stops compile where it should, counted from what the LMs really did."""

from __future__ import annotations

import time

import dspy
import pytest
from fakes import category_lm, demo_task_lm, exact, examples

import flowopt
from flowopt import Budget
from flowopt.compiler import BudgetTracker
from flowopt.errors import BudgetExhausted
from flowopt.optimizers.search import RandomSearch

STAGES = [("demos", {"max_labeled_demos": 4}), RandomSearch(n_candidates=6, max_demos=2, pool_size=4)]


def _compile(lm, budget, **kwargs):
    with dspy.context(lm=lm):
        return flowopt.compile(dspy.Predict("question -> answer"), examples(12, categories=True), exact,
                               valset=examples(9, 100, categories=True), stages=STAGES, budget=budget,
                               quiet=True, **kwargs)


def test_max_lm_calls_is_exact_and_named():
    lm = category_lm()
    out = _compile(lm, Budget(max_lm_calls=30), num_threads=4)
    assert lm.engine.calls <= 30
    assert out.report.total["lm_calls"] == lm.engine.calls
    assert out.report.stop_reason == "budget: max_lm_calls"
    assert "budget: max_lm_calls" in str(out.report)
    assert any(r.stop_reason.startswith("budget: max_lm_calls") for r in out.report.stages[1:])


def test_max_lm_calls_below_the_search_cost_shrinks_the_search_and_is_kept():
    lm = category_lm()
    free = _compile(category_lm(), None)
    search_calls = free.report.stage("search").lm_calls
    limit = free.report.total["lm_calls"] - search_calls // 2
    out = _compile(lm, Budget(max_lm_calls=limit), num_threads=1)
    row = out.report.stage("search")
    # Under a call budget the search sizes its candidate set to what the budget pays for and races it in
    # waves it can afford (a wave cut short would return nothing): it ends within the limit, with fewer
    # candidates, and says "budget" when it stopped a wave early for it.
    assert lm.engine.calls <= limit and out.report.total["lm_calls"] == lm.engine.calls
    assert row.stop_reason in ("done", "budget: max_lm_calls")
    assert row.candidates_tried is not None and row.candidates_tried < free.report.stage("search").candidates_tried


def test_max_tokens():
    lm = category_lm()
    out = _compile(lm, Budget(max_tokens=3000), num_threads=1)
    assert out.report.stop_reason == "budget: max_tokens"
    used = out.report.total["tokens"]
    assert 3000 <= used < 3000 + 400  # at most the one call that crossed the line


class PricedLM(dspy.LM):
    """A scripted LM whose real calls cost $0.001 each, as a priced provider would report."""

    def update_history(self, entry):
        if entry.get("usage"):
            entry["cost"] = 0.001
        super().update_history(entry)


def test_max_cost_usd():
    engine_lm = category_lm()
    lm = PricedLM(engine_lm.model, engine=engine_lm.engine)
    out = _compile(lm, Budget(max_cost_usd=0.02), num_threads=2)
    assert out.report.stop_reason == "budget: max_cost_usd"
    assert 0.02 <= out.report.total["cost_usd"] <= 0.02 + 0.002 + 1e-9
    assert out.report.total["cost_usd"] == pytest.approx(0.001 * lm.engine.calls)


def test_max_wall_s():
    # 44 calls at 0.1 s on 2 threads take about 2.7 s unbounded, well past the 0.6 s limit even on a fast
    # run (at 0.02 s a warm run could finish inside the limit), and the stop must come soon after it.
    lm = category_lm(latency_s=0.1)
    start = time.monotonic()
    try:
        out = _compile(lm, Budget(max_wall_s=0.6), num_threads=2)
    except BudgetExhausted as err:
        # On a heavily loaded machine the baseline itself (9 calls, about 0.5 s idle) can overrun the
        # limit: compile then stops with the budget named, since there is nothing to compare against.
        assert "max_wall_s" in str(err)
    else:
        # On a loaded machine the baseline alone can use the 0.6 s, and the stage then reports "(not run)".
        assert out.report.stop_reason in ("budget: max_wall_s", "budget: max_wall_s (not run)")
    assert time.monotonic() - start < 2.0


def test_tracker_counts_real_calls_and_cache_hits_apart():
    lm = demo_task_lm()
    tracker = BudgetTracker()
    with tracker.activate(), tracker.guard(), dspy.context(lm=lm):
        for _ in range(3):
            dspy.Predict("question -> answer")(question="same")
    usage = tracker.usage()
    assert usage["lm_calls"] == 1 and usage["cache_hits"] == 2 and lm.engine.calls == 1
    assert usage["tokens"] > 0


def test_budget_check_and_exhausted():
    tracker = BudgetTracker(Budget(max_lm_calls=1))
    assert tracker.exhausted() is None
    tracker.check()
    with tracker.activate(), dspy.context(lm=demo_task_lm(cache=False)):
        with tracker.guard():
            dspy.Predict("question -> answer")(question="q1")
        with pytest.raises(flowopt.BudgetExhausted, match="max_lm_calls"):
            tracker.check()
        with pytest.raises(flowopt.BudgetExhausted), tracker.guard():
            dspy.Predict("question -> answer")(question="q2")
    assert tracker.exhausted() == "max_lm_calls"
