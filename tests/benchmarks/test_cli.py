"""`flowopt bench` end to end with a scripted LM: every output file, and --resume pays for nothing twice."""

import json
import subprocess
import sys

import pytest

from flowopt.benchmarks import cli, runner
from flowopt.benchmarks.datasets import load_split
from flowopt.testing import scripted_lm

GOLD = {ex.question: ex.answer for split in ("val", "test") for ex in load_split("gsm8k-aflow", split)}


def gsm8k_answer(request):
    """Knows every gold answer but gives it only when the prompt carries demos, so demos decide."""
    if "answer" not in request.output_fields:
        return {f: "x" for f in request.output_fields}
    gold = GOLD[request.inputs["question"]]
    return {"reasoning": "Work it out.", "answer": gold if request.demos else "-1"}


@pytest.fixture
def scripted(monkeypatch):
    lm = scripted_lm(gsm8k_answer, cache=False)
    monkeypatch.setattr(runner, "make_lm", lambda model, **kwargs: (lm, None))
    return lm


def bench(out, *extra):
    return cli.main(["bench", "gsm8k-aflow", "--lm", "scripted/lm", "--program", "cot", "--stages", "demos",
                     "--train", "6", "--dev", "6", "--test", "8", "--seed", "1", "--out", str(out), "--quiet",
                     "--threads", "2", *extra])


def test_bench_writes_every_output(tmp_path, scripted, capsys):
    assert bench(tmp_path / "run") == 0
    out = tmp_path / "run"
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"] == "gsm8k-aflow"
    assert results["splits"] == {"train": 6, "dev": 6, "test": 8, "report_split": "test", "metric": "gsm8k_aflow"}
    assert results["test"]["baseline"]["n"] == 8 and results["test"]["compiled"]["n"] == 8
    assert results["config"]["stages"] == "demos" and results["versions"]["dspy"]
    names = [s["name"] for s in results["compile"]["stages"]]
    assert names[0] == "baseline" and "demos" in names
    assert (out / "scores.png").read_bytes().startswith(b"\x89PNG")
    md = (out / "results.md").read_text()
    assert "| baseline |" in md and "| compiled |" in md
    compiled = json.loads((out / "compiled.json").read_text())
    assert compiled["schema"] == "flowopt.workflow/v1"
    demos = compiled["nodes"][0]["predictors"]["cot.predict"]["demos"]
    assert demos, "the demos stage should have attached demonstrations"
    printed = capsys.readouterr().out
    assert "compiled" in printed and str(out) in printed
    assert results["test"]["baseline"]["score"] == 0.0 and results["test"]["compiled"]["score"] == 1.0
    assert results["test"]["change"] == 1.0


def test_bench_resume_pays_nothing_twice(tmp_path, scripted):
    assert bench(tmp_path / "run") == 0
    first = scripted.engine.calls
    assert first > 0
    first_results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert bench(tmp_path / "run", "--resume") == 0
    assert scripted.engine.calls == first
    again = json.loads((tmp_path / "run" / "results.json").read_text())
    assert again["test"] == first_results["test"]


def test_bench_list_and_bad_input(capsys):
    assert cli.main(["bench", "--list"]) == 0
    listing = capsys.readouterr().out
    for name in ("gsm8k-dspy", "gsm8k-aflow", "hotpotqa-aflow", "hotpotqa-closedbook", "workflow"):
        assert name in listing
    assert cli.main(["bench", "nope-protocol", "--lm", "openai/x"]) == 2
    assert cli.main(["bench", "gsm8k-aflow", "--lm", "openai/x", "--program", "magic"]) == 2


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "flowopt.benchmarks.cli", "bench", "--list"],
                         capture_output=True, text=True, check=True).stdout
    assert "hotpotqa-aflow" in out
