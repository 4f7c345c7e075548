"""search_pruning_replay: a rule raced on fully scored candidates gives what the search itself gives."""

from __future__ import annotations

import dspy

from flowopt.benchmarks.perf.search_pruning_replay import RULES, collect, compare, replay
from flowopt.benchmarks.perf.search_tasks import Task, dspy_cache_off, metric
from flowopt.optimizers.search.pruners import Look, get_pruner


def _record(incumbent: str, bootstrap: str, labeled: str, tests: tuple[float, float, float]) -> dict:
    """One seed's three candidates over 40 valset examples (0/1 scores as a string), 5 bootstrap calls."""
    kinds = [("incumbent", incumbent), ("bootstrap", bootstrap), ("labeled", labeled)]
    return {"seed": 0, "shape": "demos_only", "calls": 5 + 3 * 40, "candidates": [
        {"number": i, "kind": kind, "scores": scores, "test": test}
        for i, ((kind, scores), test) in enumerate(zip(kinds, tests))]}


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
    record = _record("10" * 20, "1110" * 10, "0" * 40, (0.5, 0.7, 0.1))
    out = compare([record], lambda: get_pruner("none")())
    assert out["diff"][0] == 0.0 and out["calls_ratio"] == 1.0 and out["best_stopped"] == 0
    stopped = replay(record, get_pruner("confidence")())
    assert stopped["pick"] == 1 and stopped["stopped"] == {2: 20}  # 15 losses, no wins at the first look
    assert stopped["calls"] == 5 + 40 + 40 + 20
    assert all(compare([record], make)["n"] == 1 for make in RULES.values())


def test_the_first_look_is_judged_at_the_stricter_level_and_later_looks_at_alpha():
    from flowopt.benchmarks.perf.search_pruning_replay import StricterFirstLook

    rule = StricterFirstLook()  # alpha 0.05 at the first look, 0.1 after
    behind = {1: [1.0] * 20, 2: [0.0] * 4 + [1.0] * 16}  # 4 losses, no wins: McNemar's p = 1/16 = 0.0625
    assert rule.prune(Look(behind, {}, 20)) == {}
    assert set(rule.prune(Look(behind, {}, 20))) == {2}
    assert rule.rung_ends(100, None) == [20, 30, 40, 50, 60, 70, 80, 90, 100]


def test_halving_at_optunas_rungs_keeps_the_best_half_whatever_the_order_and_never_the_incumbent():
    from flowopt.benchmarks.perf.search_pruning_replay import HalvingFrom20

    live = {0: [0.0] * 20, 1: [1.0] * 20, 2: [1.0] * 12 + [0.0] * 8, 3: [1.0] * 4 + [0.0] * 16,
            4: [1.0] * 10 + [0.0] * 10}
    rule = HalvingFrom20()
    assert rule.rung_ends(100, None) == [20, 40, 80, 100]
    assert set(rule.prune(Look(live, {}, 20, incumbent=0))) == {3, 4}  # 1 and 2 kept; 0 is the incumbent
    backwards = dict(reversed(list(live.items())))
    assert set(rule.prune(Look(backwards, {}, 20, incumbent=0))) == {3, 4}


def test_where_the_calls_go_adds_up_to_the_replayed_calls():
    from flowopt.benchmarks.perf.search_pruning_replay import where_calls_go

    record = _record("10" * 20, "1110" * 10, "0" * 40, (0.5, 0.7, 0.1))
    make = RULES["confidence (default)"]
    split = where_calls_go([record], make)
    assert split == {"bootstraps": 5, "incumbent": 40, "pick": 40, "others_full": 0, "stopped": 20}
    assert sum(split.values()) == replay(record, make())["calls"]


def test_race_start_lets_a_rule_stop_the_incumbent_and_counts_only_what_it_scored():
    from flowopt.benchmarks.perf.search_pruning_replay import where_calls_go

    record = _record("0" * 40, "1110" * 10, "10" * 20, (0.1, 0.7, 0.5))
    make = RULES["confidence (default)"]
    kept = replay(record, make())
    assert 0 not in kept["stopped"] and kept["scored"][0] == 40  # the search never stops its start
    raced = replay(record, make(), race_start=True)
    assert raced["stopped"][0] == 20 and raced["pick"] == 1 and raced["calls"] == kept["calls"] - 20
    assert where_calls_go([record], make, race_start=True)["incumbent"] == 20
    assert compare([record], make, race_start=True)["diff"][0] == 0.0
