"""The before/after A/B driver: run order, both results schemas, paired statistics, bad commands."""

from __future__ import annotations

import shlex

import pytest

from flowopt.benchmarks.perf import runtime_ab
from flowopt.benchmarks.perf.harness import read_results
from flowopt.errors import ConfigError, DataError


def fake_lm_command(raw_s: float, local_s: float) -> str:
    """A shell command that writes an lm_throughput-shaped result (2 rounds) to the {out} stem."""
    payload = {"results": {"seconds": {"raw": [raw_s, raw_s], "local_batch1": [local_s, local_s],
                                       "local_8_callers": [local_s / 5, local_s / 4]},
                           "tokens_generated": {"raw": [100, 100], "local_batch1": [100, 100],
                                                "local_8_callers": [100, 100]}}}
    code = f"import json, sys; json.dump({payload!r}, open(sys.argv[1] + '.json', 'w'))"
    return "{python} -c " + shlex.quote(code) + " {out}"


def test_run_order_alternates_and_balances():
    assert runtime_ab.run_order(3) == ["before", "after", "after", "before", "before", "after"]


def test_grpo_rounds_reads_the_harness_and_the_pre_harness_schema():
    runs = {"flowopt": {"runs_median_step_s": [0.1, 0.2]}, "stage": {"runs_median_step_s": [0.2, 0.4]},
            "trl-nockpt": {"runs_median_step_s": [0.15, 0.2]}}
    harness = runtime_ab.grpo_rounds({"results": {"runs": runs}})
    flat = runtime_ab.grpo_rounds({"results": runs})
    assert harness == flat
    assert harness["flowopt_vs_trl"] == [1.5, 1.0] and harness["stage_vs_trl"] == [0.75, 0.5]


def test_bootstrap_interval_holds_the_median_and_the_difference_its_sign():
    low, high = runtime_ab.bootstrap_median([0.9, 1.0, 1.1, 1.0, 1.2, 0.95], resamples=2000)
    assert low <= 1.0 <= high
    low, high = runtime_ab.bootstrap_difference([2.0, 2.1, 1.9, 2.05], [1.0, 1.1, 0.9, 1.05], resamples=2000)
    assert 0.8 <= low <= high <= 1.2


def test_a_run_pairs_rounds_and_reports_the_difference(tmp_path):
    out = tmp_path / "ab"
    # before: LocalLM takes 10% longer than the raw loop; after: 20% longer.
    assert runtime_ab.main(["--measure", "lm", "--alternations", "2", "--resamples", "500", "--out", str(out),
                            "--before", fake_lm_command(1.0, 1.1), "--after", fake_lm_command(1.0, 1.2)]) == 0
    payload = read_results(out)
    summary = payload["results"]["summary"]["batch1_overhead"]
    assert summary["before"]["n"] == summary["after"]["n"] == 4
    assert summary["before"]["median"] == pytest.approx(0.1, abs=1e-6)
    assert summary["after_minus_before"]["median"] == pytest.approx(0.1, abs=1e-6)
    # A constant 10-point regression: the interval excludes zero, so "no worse within noise" is not met.
    goal = next(g for g in payload["goals"] if g["name"].startswith("batch1_overhead"))
    assert goal["met"] is False
    assert [r["side"] for r in payload["results"]["runs"]] == ["before", "after", "after", "before"]
    assert "| batch1_overhead |" in (tmp_path / "ab.md").read_text()


def test_commands_must_name_the_out_stem_and_failures_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="--before has no"):
        runtime_ab.main(["--before", "true", "--after", "true {out}", "--out", str(tmp_path / "x")])
    with pytest.raises(DataError, match="exit 3"):
        runtime_ab.main(["--before", "exit 3 # {out}", "--after", "true {out}", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(DataError, match="no readable"):
        runtime_ab.main(["--before", "true {out}", "--after", "true {out}", "--out", str(tmp_path / "y")])


def test_lm_rounds_refuses_a_result_that_holds_medians_only():
    with pytest.raises(DataError, match="per-round seconds"):
        runtime_ab.lm_rounds({"tokens_per_s": {"raw": 9.9, "local_batch1": 9.5}, "batch1_overhead_vs_raw": 0.04})
