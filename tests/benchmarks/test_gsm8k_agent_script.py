"""The GSM8K calculator-agent script runs end to end at its smoke size (a tiny random model) and writes
every arm's held-out scores, per question, with intervals."""

from __future__ import annotations

import json

import pytest

from flowopt.benchmarks.perf import gsm8k_calculator_agent as script


@pytest.mark.slow
def test_the_smoke_run_writes_every_arm(tmp_path):
    assert script.main(["--smoke", "--out", str(tmp_path / "agent")]) == 0
    payload = json.loads((tmp_path / "agent.json").read_text())
    results = payload["results"]
    assert set(results["untrained"]) == {"react", "cot"}
    assert set(results["seeds"]["0"]) == set(script.ARMS)
    for row in [*results["untrained"].values(), *results["seeds"]["0"].values()]:
        assert len(row["scores"]) == 3 and row["ci"][0] <= row["score"] <= row["ci"][1]
    intermediate = results["seeds"]["0"]["react-intermediate"]["curve"][0]
    assert intermediate["tool_calls"] >= 0 and "intermediate_reward" in intermediate
    assert "react-intermediate" in (tmp_path / "agent.md").read_text()


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
