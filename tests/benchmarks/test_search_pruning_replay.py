"""search_pruning_replay: a rule raced on fully scored candidates gives what the search itself gives."""

from __future__ import annotations

import dspy

from flowopt.benchmarks.perf.search_pruning_replay import RULES, collect, compare, replay
from flowopt.benchmarks.perf.search_tasks import Task, dspy_cache_off, metric
from flowopt.optimizers.search.pruners import get_pruner


def test_the_default_rule_replayed_gives_the_searchs_own_calls_and_pick():
    import flowopt

    job = (1, "needles", 30, 40, 60)
    record = collect(job)
    assert len(record["candidates"]) == 11 and all(len(c["scores"]) == 40 for c in record["candidates"])

    task = Task(1, 30, 40, 60, shape="needles")
    lm = task.lm(0.0)
    cache = dspy.cache
    with dspy_cache_off(), dspy.context(lm=lm):
        out = flowopt.compile(dspy.Predict("question -> answer"), task.train, metric, valset=task.val,
                              stages=[("search", {"n_candidates": 11, "extra": 0})], num_threads=8, quiet=True)
    assert dspy.cache is cache  # the caller's DSPy cache is back: later tests still count cache hits
    replayed = replay(record, get_pruner("confidence")())
    assert replayed["calls"] == lm.engine.calls < record["calls"]
    test = {c["number"]: c["test"] for c in record["candidates"]}[replayed["pick"]]
    assert abs(test - task.score(out, task.test)["expected"]) < 1e-6


def test_no_pruning_is_bfrss_pick_at_bfrss_calls_and_every_rule_is_compared():
    record = {"seed": 0, "shape": "demos_only", "calls": 5 + 3 * 40, "candidates": [  # 5 bootstrap calls
        {"number": 0, "kind": "incumbent", "scores": "10" * 20, "test": 0.5},
        {"number": 1, "kind": "bootstrap", "scores": "1110" * 10, "test": 0.7},
        {"number": 2, "kind": "labeled", "scores": "0" * 40, "test": 0.1}]}
    out = compare([record], lambda: get_pruner("none")())
    assert out["diff"][0] == 0.0 and out["calls_ratio"] == 1.0 and out["best_stopped"] == 0
    stopped = replay(record, get_pruner("confidence")())
    assert stopped["pick"] == 1 and stopped["stopped"] == {2: 20}  # 15 losses, no wins at the first look
    assert stopped["calls"] == 5 + 40 + 40 + 20
    assert all(compare([record], make)["n"] == 1 for make in RULES.values())
