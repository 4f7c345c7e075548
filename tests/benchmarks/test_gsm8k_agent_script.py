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


def _args(**overrides):
    values = {"model": "tiny", "device": "cpu", "train": 4, "test": 3, "steps": 2, "batch": 1, "group": 2,
              "max_steps": 2, "max_new_tokens": 4, "lr": 1e-4, "tool_ok": 0.1, "tool_error": -0.05,
              "tool_unknown": -0.1, "seeds": [0], "max_seconds": 0.0, "eval_threads": 2}
    return type("Args", (), {**values, **overrides})()


def _row(score):
    return {"score": score, "ci": [0.0, 1.0], "scores": [score] * 3, "errors": 0, "tool_calls": {"ok": 2}}


def test_the_agents_comparison_runs_before_the_no_tools_baseline():
    assert script.schedule([0, 1]) == [
        ("untrained react", None), ("react-terminal", 0), ("react-intermediate", 0), ("react-terminal", 1),
        ("react-intermediate", 1), ("untrained cot", None), ("cot-terminal", 0), ("cot-terminal", 1)]


def test_a_run_out_of_time_stops_before_a_unit_that_no_longer_fits_and_reports_what_finished(monkeypatch, tmp_path):
    published = []

    def slow_unit(runner, arm, seed, kind):
        runner.seconds[f"score-{kind}"] = 10_000.0  # this unit's kind takes longer than the budget has left
        return _row(0.5)

    monkeypatch.setattr(script, "run_unit", slow_unit)
    results = script.run_all(_args(max_seconds=600.0), tmp_path, lambda r: published.append(dict(r)))
    assert results["untrained"] == {"react": _row(0.5)} and results["seeds"] == {}
    assert results["status"] == "stopped: time budget (before react-terminal seed 0)"
    assert results["not_run"] == ["react-terminal seed 0", "react-intermediate seed 0", "untrained cot",
                                  "cot-terminal seed 0"]
    assert [p["status"] for p in published] == ["running", results["status"]]  # written after the unit, and at the stop
    body = "\n".join(script.report_body(_args(), results))
    assert "not run: react-terminal seed 0" in body and "untrained react" in body


def test_a_unit_the_budget_stops_midway_is_reported_as_not_run(monkeypatch, tmp_path):
    def unit(runner, arm, seed, kind):
        return None if arm == "react-intermediate" else {**_row(0.0), "steps_done": 2, "train_s": 1.0, "curve": []}

    monkeypatch.setattr(script, "run_unit", unit)
    results = script.run_all(_args(max_seconds=600.0), tmp_path, lambda r: None)
    assert list(results["seeds"]["0"]) == ["react-terminal"]
    assert results["status"] == "stopped: time budget (react-intermediate seed 0)"
    assert results["not_run"][0] == "react-intermediate seed 0"


def test_a_complete_run_reports_the_pooled_paired_changes(monkeypatch, tmp_path):
    scores = {"react-terminal": 0.0, "react-intermediate": 1.0, "cot-terminal": 0.0}

    def unit(runner, arm, seed, kind):
        row = _row(scores.get(arm, 0.0))
        return row if seed is None else {**row, "steps_done": 2, "train_s": 1.0,
                                         "curve": [{"mean_reward": 0.25, "tool_calls": 3}]}

    monkeypatch.setattr(script, "run_unit", unit)
    results = script.run_all(_args(seeds=[0, 1]), tmp_path, lambda r: None)
    assert results["status"] == "complete" and results["not_run"] == []
    change = script.pooled(results, "react-intermediate", "react-terminal")
    assert change["mean"] == 1.0 and change["n"] == 6  # 3 questions x 2 seeds, paired
    body = "\n".join(script.report_body(_args(seeds=[0, 1]), results))
    assert "| intermediate - terminal (react) | +1.000 [+1.000, +1.000] |" in body


def test_units_picks_which_parts_run(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(script, "run_unit", lambda runner, arm, seed, kind: ran.append((arm, seed)) or _row(0.0))
    results = script.run_all(_args(units=["untrained-cot"]), tmp_path, lambda r: None)
    assert ran == [("untrained cot", None)] and results["status"] == "complete"
