"""The finals under noise: the leaders race on fresh measurements for the rest of the budget, ranked by
all of their measurements (the search's and the fresh ones), and report the fresh ones alone."""

from __future__ import annotations

from flowopt.optimizers.structure import MCTS, Evaluation, RuleProposer, SearchSettings, Vocabulary

from .conftest import single


def _op(wf) -> str:
    return type(wf.nodes["solve"]).op_name


def _right(k: int, n: int = 30) -> Evaluation:
    """k of n examples right, as per-example scores (so every measurement has a 95% interval)."""
    return Evaluation(k / n, scores=[1.0] * k + [0.0] * (n - k))


def test_pooled_measurements_decide_the_final_pick():
    # The search saw Predict at 27/30 and the swap at 15/30; on fresh examples Predict gets 18/30 and the
    # swap 20/30. Ranked by the fresh measurements alone the swap would win; all measurements together
    # (27+18+18 of 90 against 15+20+20 of 90) pick Predict, and its reported score stays the fresh one.
    search = {"Predict": 27, "ChainOfThought": 15}
    fresh = {"Predict": 18, "ChainOfThought": 20}
    settings = SearchSettings(max_rounds=1, max_evaluations=6, convergence_rounds=None, final_top=2,
                              final_repeats=1)
    mcts = MCTS(RuleProposer(Vocabulary(max_nodes=1, kinds=("swap_operator",))),
                lambda wf: _right(search[_op(wf)]), settings, seed=0,
                final_evaluate=lambda wf: _right(fresh[_op(wf)]))
    result = mcts.run(single())
    assert result.evaluations == 6  # 2 searched, then the race: 1 each, then leader and challenger once more
    assert _op(result.best) == "Predict" and result.best_node == 0
    swap = result.tree.nodes[1]
    assert swap.final["score"] > result.remeasured["score"] == 18 / 30  # fresh alone would pick the swap
    assert result.remeasured["n"] == swap.final["n"] == 60
    assert result.tree.nodes[0].final["pooled"] == (27 + 18 + 18) / 90
    low, high = result.best_interval
    assert low < 18 / 30 < high and list(result.best_interval) == result.remeasured["interval"]


def test_the_race_measures_the_leader_and_its_challenger_for_the_rest_of_the_budget():
    # Predict and ChainOfThought are close (15/30 and 16/30); the ensemble is far behind (2/30). After one
    # measurement each, every further pair of calls goes to the two close ones, until the budget is spent.
    right = {"Predict": 15, "ChainOfThought": 16, "ScEnsemble": 2}
    evaluate = lambda wf: _right(right[_op(wf)])  # noqa: E731
    settings = SearchSettings(max_rounds=2, max_evaluations=23, convergence_rounds=None, final_top=3,
                              final_repeats=1)
    vocabulary = Vocabulary(max_nodes=1, kinds=("swap_operator", "wrap_ensemble"), ensemble_sizes=(3,))
    mcts = MCTS(RuleProposer(vocabulary), evaluate, settings, seed=0, final_evaluate=evaluate)
    result = mcts.run(single())
    finals = {n.workflow["nodes"][0]["op"]: n.final["n"] for n in result.tree.nodes if n.final is not None}
    assert mcts.final_evaluations() == 3 + 2 + 1 < 23 - 3  # the race got more than the reserve
    assert finals == {"Predict": 30 * 9, "ChainOfThought": 30 * 9, "ScEnsemble": 30}
    assert result.evaluations == 3 + 3 + 2 * 8  # the 23rd call would not make a pair
    assert _op(result.best) == "ChainOfThought"


def test_a_settled_race_stops_early():
    # Measurements that never vary: after one fresh measurement each the order cannot change.
    score = {"Predict": 0.5, "ChainOfThought": 0.8}
    settings = SearchSettings(max_rounds=1, max_evaluations=50, convergence_rounds=None, final_top=2)
    mcts = MCTS(RuleProposer(Vocabulary(max_nodes=1, kinds=("swap_operator",))),
                lambda wf: score[_op(wf)], settings, seed=0)
    result = mcts.run(single())
    assert result.evaluations == 4 and _op(result.best) == "ChainOfThought"
    assert result.remeasured["score"] == 0.8
