"""The GSM8K calculator-agent script's arms (its smoke run is a case of ``test_perf_smoke.py``)."""

from __future__ import annotations

from flowopt.benchmarks.perf import gsm8k_calculator_agent as script


def test_only_the_intermediate_arm_sets_tool_rewards():
    args = type("Args", (), {"steps": 2, "batch": 1, "group": 2, "max_new_tokens": 4, "lr": 1e-4, "tool_ok": 0.1,
                             "tool_error": -0.05, "tool_unknown": -0.1})()
    stages = {arm: script.stage_for(arm, args) for arm in script.ARMS}
    assert stages["react-intermediate"].tool_rewards == {"ok": 0.1, "error": -0.05, "unknown_tool": -0.1}
    assert stages["react-terminal"].tool_rewards is None and stages["cot-terminal"].tool_rewards is None
    assert {s.steps for s in stages.values()} == {2}
    react, cot = script.programs(3).values()
    assert react.nodes["solve"].config() == {"tools": ["calculator"], "max_steps": 3}
    assert cot.nodes["solve"].op_name == "ChainOfThought"
