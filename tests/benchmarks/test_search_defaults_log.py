"""search_defaults' seeds log: a seed's methods already logged are read back, not run again."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from flowopt.benchmarks.perf.search_defaults import logged_rows, run_seed


def _row(calls: int, test: float) -> dict[str, float]:
    return {"lm_calls": calls, "wall_s": 0.0, "test": test, "val": test}


def test_a_later_line_of_a_seed_adds_to_and_replaces_its_earlier_rows(tmp_path):
    log = tmp_path / "seeds.jsonl"
    lines = [{"seed": 0, "shape": "demos_only", "rows": {"bfrs8": _row(1100, 0.7), "flowopt_defaults": _row(900, 0.6)}},
             {"seed": 3, "shape": "demos_only", "rows": {"bfrs8": _row(1000, 0.5)}},  # not a job asked for
             {"seed": 0, "shape": "demos_only", "rows": {"flowopt_defaults": _row(950, 0.65)}}]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))

    rows = logged_rows(log, [(0, "demos_only"), (1, "needles")])

    assert rows == {(0, "demos_only"): {"bfrs8": _row(1100, 0.7), "flowopt_defaults": _row(950, 0.65)}}
    assert logged_rows(tmp_path / "absent.jsonl", [(0, "demos_only")]) == {}
    assert logged_rows(None, [(0, "demos_only")]) == {}


def test_run_seed_takes_logged_methods_from_the_log_without_running_them():
    args = SimpleNamespace(train=6, val=4, test=4, threads=1, methods=["bfrs8", "flowopt_bfrs8_candidates"])
    logged = {"bfrs8": _row(1100, 0.7), "flowopt_bfrs8_candidates": _row(540, 0.71)}

    before = logging.root.manager.disable
    out = run_seed((0, "demos_only"), args, logged)  # nothing left to run: no LM is configured or called

    assert out == {"seed": 0, "shape": "demos_only", "rows": logged}
    assert logging.root.manager.disable == before  # the seed's silence ends with it (later tests log again)
