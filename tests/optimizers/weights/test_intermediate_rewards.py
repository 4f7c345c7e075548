"""Intermediate rewards in GRPO: each transition's own reward (tool status, per-node checks) on top of its
rollout's advantage; off by default, and then the loss is the one recorded before they existed."""

from __future__ import annotations

import json

import dspy
import pytest
import torch

from flowopt.errors import ConfigError
from flowopt.optimizers.weights import GRPO
from flowopt.optimizers.weights.advantages import group_advantages
from flowopt.optimizers.weights.grpo import scored_transitions
from flowopt.optimizers.weights.learner import ScoredTransition
from flowopt.optimizers.weights.rewards import score_rollout, transition_rewards
from flowopt.optimizers.weights.rollout import NodeCall, Rollout, Transition
from flowopt.tools import ToolCall


def _transition(call: str | None = None) -> Transition:
    return Transition([2, 5], [6, 3], [-0.1, -0.2], "x", "stop", call=call)


def _episode() -> list[Rollout]:
    """One example, two rollouts. Rollout 0: three LM calls (two act steps choosing tools, then the answer);
    rollout 1: one act step that named no such tool, then a failed answer."""
    first = Rollout(0, 0, dspy.Example(q="q").with_inputs("q"), prediction=dspy.Prediction(answer="7"),
                    transitions=[_transition("a1"), _transition("a2"), _transition("e1")],
                    tool_calls=[ToolCall("calculator", "3+4", "7", None, "ok", transition=0),
                                ToolCall("calculator", "7/0", None, "division by zero", "error", transition=1)],
                    node_calls=[NodeCall("a1", "solve", {"q": "q"}, {"next_tool": "calculator"}),
                                NodeCall("a2", "solve", {"q": "q"}, {"next_tool": "calculator"}),
                                NodeCall("e1", "answer", {"q": "q"}, {"answer": "7"})])
    second = Rollout(0, 1, first.example, prediction=dspy.Prediction(answer="5"),
                     transitions=[_transition("b1"), _transition("f1")],
                     tool_calls=[ToolCall("abacus", "2", None, "no such tool", "unknown_tool", transition=0)],
                     node_calls=[NodeCall("b1", "solve", {"q": "q"}, {"next_tool": "abacus"}),
                                 NodeCall("f1", "answer", {"q": "q"}, None)])  # raised: earns nothing
    return [first, second]


def _metric(example, prediction, trace=None):
    return float(prediction.answer == "7")


def _answer_check(example, inputs, outputs):
    return 0.4 if outputs.get("answer") else 0.0


def _previous_scored_transitions(rollouts, advantages):
    """The construction GRPO used before intermediate rewards (commit 6367316), as it was."""
    items = []
    for index, (rollout, advantage) in enumerate(zip(rollouts, advantages)):
        for t in rollout.transitions:
            items.append(ScoredTransition(t.prompt_ids, t.completion_ids, t.logprobs, float(advantage), rollout=index))
    return items


def test_off_by_default_every_transition_gets_exactly_its_rollouts_advantage():
    stage = GRPO()
    rollouts = _episode()
    rewards = torch.tensor([[score_rollout(r, _metric) for r in rollouts]])
    advantages = group_advantages(rewards).flatten().tolist()
    own = stage._own_rewards(rollouts)
    assert own is None
    assert scored_transitions(rollouts, advantages, own, weight=stage.intermediate_weight) == \
        _previous_scored_transitions(rollouts, advantages)


def test_each_transition_gets_its_own_reward_on_a_hand_computed_episode():
    stage = GRPO(tool_rewards={"ok": 0.2, "error": -0.1, "unknown_tool": -0.3}, node_reward_credit="transition",
                 node_rewards={"answer": _answer_check}, intermediate_weight=0.5)
    rollouts = _episode()
    # Credited per transition, node rewards stay out of the rollout's reward: 1 and 0, as the metric says.
    rewards = [score_rollout(r, _metric, node_rewards=None) for r in rollouts]
    assert rewards == [1.0, 0.0]
    a = 0.5 / (2 ** -0.5 + 1e-4)  # (r - mean) / (Bessel std + eps) for rewards [1, 0]
    own = stage._own_rewards(rollouts)
    assert own == [pytest.approx([0.2, -0.1, 0.4]), pytest.approx([-0.3, 0.0])]
    items = scored_transitions(rollouts, group_advantages(torch.tensor([rewards])).flatten().tolist(), own,
                               weight=0.5)
    assert [t.advantage for t in items] == pytest.approx([a + 0.1, a - 0.05, a + 0.2, -a - 0.15, -a], abs=1e-6)
    assert [t.rollout for t in items] == [0, 0, 0, 1, 1]


def test_node_rewards_credited_per_rollout_are_summed_into_its_reward_as_before():
    rollouts = _episode()
    for r in rollouts:  # the DSPy trace the rollout recorded: (node, inputs, outputs)
        r.trace = [(c.node, c.inputs, c.outputs or {}) for c in r.node_calls]
    assert score_rollout(rollouts[0], _metric, node_rewards={"answer": _answer_check}) == pytest.approx(1.4)
    assert GRPO(node_rewards={"answer": _answer_check})._own_rewards(rollouts) is None


def test_a_node_reward_goes_to_the_last_lm_call_of_its_predictor_call():
    """The completion adapter may ask again for a missing field: that call's second transition completed it."""
    rollout = Rollout(0, 0, None, transitions=[_transition("p"), _transition("p"), _transition("q")],
                      node_calls=[NodeCall("p", "draft", {}, {"answer": "x"}), NodeCall("q", "other", {}, {})])
    assert transition_rewards(rollout, node_rewards={"draft": _answer_check}) == [0.0, 0.4, 0.0]


@pytest.mark.parametrize("bad", [{"tool_rewards": {"success": 1.0}}, {"node_reward_credit": "step"},
                                 {"intermediate_weight": -1.0}, {"tool_rewards": {"ok": "high"}}])
def test_bad_intermediate_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        GRPO(**bad)


def test_zero_intermediate_rewards_repeat_the_recorded_grpo_steps(make_tiny_local, task, monkeypatch):
    """The path with intermediate rewards on, all zero, gives the losses and rewards recorded from the code
    before they existed (``data/grpo_reference.json``)."""
    from tests.optimizers.weights.test_grpo_equivalence import CONFIGS, REFERENCE, _run

    expected = json.loads(REFERENCE.read_text())["forward-old"]["dapo"]
    got = _run(make_tiny_local(), task, monkeypatch, {**CONFIGS["dapo"], "tool_rewards": {"ok": 0.0},
                                                        "node_reward_credit": "transition"})
    assert got["rewards"] == expected["rewards"]
    assert got["losses"] == pytest.approx(expected["losses"], abs=1e-6)


def test_rollouts_record_tool_calls_under_the_lm_call_that_chose_them(tiny_local):
    """A ReAct node sampled by the tiny random model: its (nonsense) tool choices are recorded, each naming
    the transition of the act step that chose it, and every transition is tagged with its predictor call."""
    import flowopt
    from flowopt.modules import ReAct
    from flowopt.optimizers.weights.policy import LoraSettings, Policy
    from flowopt.optimizers.weights.rollout import run_rollouts
    from tests.optimizers.weights.word_adapter import WordAdapter

    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("react-test")
    program = flowopt.Workflow("cue -> word").add("solve", ReAct("cue -> word", tools=["calculator"], max_steps=2))
    examples = [dspy.Example(cue="red").with_inputs("cue")]
    rollouts = run_rollouts(program, examples, 2, policy, temperature=1.0, max_new_tokens=3,
                            generator=torch.Generator().manual_seed(0), adapter=WordAdapter())
    for r in rollouts:
        assert r.error is None and len(r.transitions) == 3  # two act steps, then extract
        assert len(r.tool_calls) == 2 and {c.status for c in r.tool_calls} <= {"ok", "error", "unknown_tool"}
        assert [c.transition for c in r.tool_calls] == [0, 1]
        assert [t.call for t in r.transitions] == [c.call_id for c in r.node_calls]
        assert [c.node for c in r.node_calls] == ["solve"] * 3
        for call, act in zip(r.tool_calls, r.node_calls):  # the tool each act step named is the one called
            assert call.tool == str(act.outputs["next_tool"]).strip() and call.status == "unknown_tool"
