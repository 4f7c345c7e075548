"""Measurements inside ``compile()``: repeats that re-sample, intervals, finalists re-measured on fresh
examples, LM calls per example, the cost-penalised objective and the score/cost Pareto front."""

from __future__ import annotations

import random
import re

import dspy
import pytest

import flowopt
from flowopt.modules import Predict
from flowopt.optimizers.structure import MCTS, Evaluation, RuleProposer, SearchSettings, Vocabulary
from flowopt.testing import scripted_lm

from .conftest import single


def _metric(ex, pred, trace=None):
    return float(str(pred.answer).strip() == ex.answer)


def _questions(n):
    return [dspy.Example(question=f"q{i}: what is {i} + 1?", answer=str(i + 1)).with_inputs("question")
            for i in range(n)]


def _coin(req):
    """Right half the time, at random: every real call is a new sample."""
    gold = int(re.findall(r"\d+", req.inputs["question"])[1]) + 1
    answer = str(gold if random.random() < 0.5 else gold + 1)
    return {"answer": answer, "reasoning": "think"}


def _structure_calls(repeats):
    wf = flowopt.Workflow("question -> answer").add("solve", Predict("question -> answer"))
    # DSPy's cache is on (a model name of its own per run): only a new rollout reaches the engine.
    seen: dict[str, int] = {}  # engine calls per question with the initial Predict (all stages)

    def answer(req):
        if "reasoning" not in req.output_fields:
            seen[req.inputs["question"]] = seen.get(req.inputs["question"], 0) + 1
        return _coin(req)

    model = f"scripted/coin-{repeats}-{random.random()}"
    with dspy.context(lm=scripted_lm(answer, temperature=0.7, model=model)):
        best = flowopt.compile(wf, _questions(12), _metric, quiet=True,
                               stages=[("structure", {"max_rounds": 1, "repeats": repeats, "final_top": 0,
                                                      "edit_kinds": ("swap_operator",)})])
    return best.report.stage("structure"), seen


def test_repeats_re_sample_inside_compile():
    (once, once_seen), (thrice, thrice_seen) = _structure_calls(1), _structure_calls(3)
    # Root and its one candidate (Predict -> ChainOfThought), one LM call per example each.
    assert once.info["evaluations"] == 2 and thrice.info["evaluations"] == 6
    n = once.info["search_examples"]
    assert thrice.info["search_examples"] == n
    # Each search question reached the engine once per repeat (plus the baseline stage's call): the
    # repeats are new samples, answered neither by the evaluation memo nor by DSPy's cache.
    assert sorted(thrice_seen.values(), reverse=True)[:n] == [3] * n
    assert max(once_seen.values()) == 1
    root = thrice.info["tree"]["nodes"][0]
    assert root["n"] == 3 * thrice.info["search_examples"] and root["calls"] == 3
    assert 0.0 < root["total"] < root["n"]  # a coin: some right, some wrong


def _adder(req):
    """Bare numbers; sums of 50 or more are right only with a reasoning field (ChainOfThought or ensemble)."""
    gold = sum(int(x) for x in re.findall(r"\d+", req.inputs.get("question", "")))
    value = gold if ("reasoning" in req.output_fields or gold < 50) else gold + 1
    return {f: {"answer": str(value), "reasoning": "add"}.get(f, str(value)) for f in req.output_fields}


def _sums(n):
    return [dspy.Example(question=f"What is {a} + {a * 3 % 40}?", answer=str(a + a * 3 % 40)).with_inputs("question")
            for a in range(3, 3 + 2 * n, 2)]


@pytest.mark.parametrize("objective", ["score", "penalised"])
def test_cost_is_measured_and_the_front_reported(tmp_path, objective):
    wf = flowopt.Workflow("question -> answer").add("solve", Predict("question -> answer"))
    settings = {"max_rounds": 6, "convergence_rounds": None, "max_examples": 8, "final_top": 3,
                "edit_kinds": ("swap_operator", "wrap_ensemble"), "ensemble_sizes": (3, 5),
                "objective": objective, "cost_weight": 0.05}
    # A model name of its own: every call is real (tokens are counted for real calls only).
    with dspy.context(lm=scripted_lm(_adder, model=f"scripted/adder-{random.random()}")):
        best = flowopt.compile(wf, _sums(20), _metric, quiet=True, run_dir=tmp_path / objective,
                               stages=[("structure", settings)])
    info = best.report.stage("structure").info
    nodes = info["tree"]["nodes"]
    calls = {n["description"]: n["cost"]["lm_calls"] for n in nodes}
    assert calls["initial workflow"] == pytest.approx(1.0)
    assert calls["swap solve to ChainOfThought"] == pytest.approx(1.0)
    assert calls["wrap solve in ScEnsemble(n=5)"] == pytest.approx(5.0)
    # Tokens of real calls (an ensemble's samples that another ensemble already drew come from DSPy's cache).
    assert all(n["cost"]["tokens"] > 0 for n in nodes if n["description"] in ("initial workflow",
                                                                               "swap solve to ChainOfThought"))
    front = info["pareto_front"]
    assert [p["lm_calls"] for p in front] == sorted(p["lm_calls"] for p in front)
    # ChainOfThought is right on every sum with one call: every ensemble is dominated.
    assert "swap solve to ChainOfThought" in {p["description"] for p in front}
    assert all(p["lm_calls"] == pytest.approx(1.0) for p in front)
    from pathlib import Path

    assert Path(info["pareto_picture"]).read_bytes()[:4] == b"\x89PNG"
    # Finalists re-measured on the examples of the split past the 8 the search saw; both scores reported.
    assert info["search_examples"] == 8 and info["final_examples"] >= 4
    assert info["remeasured"]["n"] >= info["final_examples"] and len(info["finalists"]) >= 1
    assert all({"measured", "remeasured", "remeasured_interval"} <= set(f) for f in info["finalists"])
    if objective == "penalised":  # as right as an ensemble, at a fraction of the calls
        assert [e["kind"] for e in info["edits"]] == ["swap_operator"]


def test_finalists_re_measured_and_the_interval_is_the_re_measurement():
    rng = random.Random(0)
    truth = {0: 0.5}

    def noisy(wf):
        p = 0.4 + 0.1 * len(wf.nodes) + (0.1 if "ChainOfThought" in repr(wf) else 0.0)
        truth[0] = p
        k = sum(rng.random() < p for _ in range(40))
        return Evaluation(k / 40, scores=[1.0] * k + [0.0] * (40 - k), cost={"lm_calls": float(len(wf.nodes))})

    settings = SearchSettings(max_rounds=30, max_evaluations=40, convergence_rounds=None, final_top=4,
                              final_repeats=2)
    search = MCTS(RuleProposer(Vocabulary(max_nodes=3, kinds=("swap_operator", "add_refine", "remove_node"))),
                  noisy, settings, seed=1)
    result = search.run(single())
    assert result.evaluations <= 40
    assert search.final_evaluations() == 2 * (4 + 2 + 1)
    assert len(result.finalists) == 4 and result.remeasured is not None
    winner = result.tree.nodes[result.best_node]
    low, high = result.best_interval
    assert winner.final is not None and (low, high) == tuple(winner.final["interval"])
    # The race spends what the search left (a last odd call cannot make a pair); every finalist got its
    # final_repeats fresh measurements first, the winner more.
    assert result.evaluations >= 39
    assert all(f["remeasured_interval"][0] < f["remeasured"] for f in result.finalists)
    assert winner.final["n"] > 2 * 40
    assert low < winner.final["score"] < high
    # Every node carries its own 95% interval from its 40 per-example scores.
    assert all(n.half_width > 0 for n in result.tree.nodes)


def test_max_evaluations_is_honoured_despite_re_proposals():
    calls = []

    def flat(wf):
        calls.append(1)
        return 0.5

    settings = SearchSettings(max_rounds=1000, max_evaluations=15, convergence_rounds=None)
    result = MCTS(RuleProposer(Vocabulary(max_nodes=4)), flat, settings, seed=0).run(single())
    assert len(calls) == result.evaluations == 15
    assert result.stop_reason == "max_evaluations (15)"


def test_penalised_objective_needs_a_cost():
    settings = SearchSettings(max_rounds=2, objective="penalised", cost_weight=0.1)
    with pytest.raises(flowopt.ConfigError, match="lm_calls"):
        MCTS(RuleProposer(), lambda wf: 0.5, settings).run(single())


def _chain_lm(req):
    """A 2-step chain where each step needs chain of thought on half the questions: question i is solved
    when step 1 reasons (or i < 10) and step 2 reasons (or i is even). Predict/Predict 0.25, one step
    reasoning 0.5, both 1.0: an additive landscape (the benchmark's ``additive`` family in small)."""
    i = int(re.findall(r"\d+", req.inputs["question"])[0])
    reasons = "reasoning" in req.output_fields
    if "a1" in req.output_fields:
        value = "ok" if reasons or i < 10 else "bad"
    else:
        right = req.inputs.get("a1") == "ok" and (reasons or i % 2 == 0)
        value = str(i + 1 if right else i + 2)
    return {f: {"reasoning": "step by step"}.get(f, value) for f in req.output_fields}


def test_compile_finds_the_optimum_of_an_additive_chain(tmp_path):
    wf = (flowopt.Workflow("question -> answer", name="chain")
          .add("s1", Predict("question -> a1")).add("s2", Predict("question, a1 -> answer")))
    train = _questions(20)
    settings = {"max_rounds": 10, "convergence_rounds": None, "edit_kinds": ("swap_operator", "wrap_ensemble"),
                "ensemble_sizes": (3,), "objective": "penalised", "cost_weight": 0.01, "final_top": 3}
    with dspy.context(lm=scripted_lm(_chain_lm, model=f"scripted/chain-{random.random()}")):
        best = flowopt.compile(wf, train, _metric, quiet=True, run_dir=tmp_path, stages=[("structure", settings)])
    stage = best.report.stage("structure")
    assert stage.score == 1.0 and best.report.stage("baseline").score < 0.5
    ops = {node_id: type(op).op_name for node_id, op in best.nodes.items()}
    assert ops == {"s1": "ChainOfThought", "s2": "ChainOfThought"}  # the optimum: right everywhere, 2 calls
    assert stage.info["remeasured"]["score"] == 1.0
    assert stage.info["best_cost"]["lm_calls"] == pytest.approx(2.0)


def test_noisy_leaders_are_confirmed_before_they_are_expanded():
    rng = random.Random(3)

    def noisy(wf):
        k = sum(rng.random() < 0.3 + 0.1 * len(wf.nodes) for _ in range(20))
        return Evaluation(k / 20, scores=[1.0] * k + [0.0] * (20 - k))

    settings = SearchSettings(max_rounds=100, max_evaluations=30, convergence_rounds=None, confirm=2)
    result = MCTS(RuleProposer(Vocabulary(max_nodes=3)), noisy, settings, seed=0).run(single())
    expanded = [n for n in result.tree.nodes if n.children]
    assert expanded and all(n.calls >= 2 and n.n == 20 * n.calls for n in expanded)
    assert any(e["event"] == "remeasure" for e in result.log)
    # A deterministic evaluator (one number per call) is never re-measured: it would say the same again.
    plain = MCTS(RuleProposer(Vocabulary(max_nodes=3)), lambda wf: 0.1 * len(wf.nodes), settings, seed=0).run(single())
    assert all(n.calls == 1 for n in plain.tree.nodes)
