"""Bench reports: cumulative cost, failed stages in the table and the plot."""

from flowopt.benchmarks.report import plot_scores, score_table


def _row(name, calls, score=0.5, status="ok", error=None):
    return {"name": name, "status": status, "error": error, "kept": status == "ok", "lm_calls": calls,
            "wall_s": 1.0, "cpu_s": 2.0,
            "test": {"score": score, "ci": [score - 0.1, score + 0.1], "n": 10, "errors": 1, "strict": {}}}


def _results(rows):
    return {"protocol": "gsm8k-aflow", "config": {"lm": "x", "program": "cot"}, "stages": rows,
            "splits": {"metric": "gsm8k_aflow", "report_split": "test", "test": 10, "strict_metrics": []},
            "test": {"change": {"mean": 0.1, "ci": [0.0, 0.2], "n": 10}}}


def test_lm_calls_are_cumulative():
    """The issue's case: stages that made 16, 32 and 32 calls read 16, 48, 80."""
    table = score_table(_results([_row("baseline", 16), _row("demos", 32), _row("search", 32)]))
    lines = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| ")]
    column = lines[0].index("LM calls (cumulative)")
    cumulative = [cells[column] for cells in lines[1:]]
    assert cumulative == ["16", "48", "80"]


def test_a_failed_stage_is_in_the_table_and_the_plot(tmp_path):
    results = _results([_row("baseline", 0), _row("demos", 5, status="failed", error="LMError: boom")])
    assert "| demos | failed: LMError: boom |" in score_table(results)
    plot_scores(results, tmp_path / "scores.png")
    assert (tmp_path / "scores.png").read_bytes().startswith(b"\x89PNG")


def test_a_normal_stop_reason_is_shown_beside_the_status_not_as_an_error():
    row = {**_row("grpo", 4), "stop_reason": "steps"}
    assert "| grpo | ok (steps) |" in score_table(_results([_row("baseline", 0), row]))
