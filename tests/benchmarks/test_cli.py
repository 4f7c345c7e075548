"""`flowopt bench` end to end with a scripted LM: every output file, and --resume pays for nothing twice."""

import json
import shutil
import subprocess
import sys

import pytest

from flowopt.benchmarks import cli, runner
from flowopt.benchmarks.datasets import load_split
from flowopt.modules import Predict
from flowopt.testing import scripted_lm
from flowopt.workflow import Workflow

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
    assert results["splits"] == {"train": 6, "dev": 6, "test": 8, "report_split": "test", "metric": "gsm8k_aflow",
                                 "strict_metrics": ["gsm8k_strict"]}
    assert results["test"]["baseline"]["n"] == 8 and results["test"]["compiled"]["n"] == 8
    assert results["config"]["stages"] == "demos" and results["versions"]["dspy"]
    assert [s["name"] for s in results["stages"]] == ["baseline", "demos"] and results["status"] == "done"
    assert (out / "scores.png").read_bytes().startswith(b"\x89PNG")
    md = (out / "results.md").read_text()
    assert "| baseline | ok |" in md and "| demos | ok |" in md
    compiled = json.loads((out / "compiled.json").read_text())
    assert compiled["schema"] == "flowopt.workflow/v1"
    demos = compiled["nodes"][0]["predictors"]["cot.predict"]["demos"]
    assert demos, "the demos stage should have attached demonstrations"
    printed = capsys.readouterr().out
    assert "| demos | ok | 1.000" in printed and str(out) in printed
    assert results["test"]["baseline"]["score"] == 0.0 and results["test"]["compiled"]["score"] == 1.0
    assert results["test"]["change"]["mean"] == 1.0 and results["test"]["change"]["n"] == 8


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


def test_quiet_prints_only_the_table(tmp_path, scripted, capsys):
    assert bench(tmp_path / "run") == 0
    captured = capsys.readouterr()
    assert "DEBUG" not in captured.out + captured.err and "bm25s" not in captured.err
    assert captured.out.startswith("Report split:")


def test_bench_rows_and_plot_are_written_after_each_stage(tmp_path, scripted, monkeypatch):
    """The results on disk after the baseline already hold its row, before any stage runs."""
    seen = []
    real_write = runner._Run._write

    def spy(self):
        real_write(self)
        seen.append([row["name"] for row in json.loads((self.plan.out / "results.json").read_text())["stages"]])

    monkeypatch.setattr(runner._Run, "_write", spy)
    assert bench(tmp_path / "run", "--stages", "labeled,demos") == 0
    assert seen[:3] == [["baseline"], ["baseline", "labeled"], ["baseline", "labeled", "demos"]]


def test_a_failed_stage_is_a_row_and_resume_goes_on(tmp_path, scripted, monkeypatch):
    from flowopt.optimizers.demos import BootstrapFewShot

    def broken(self, program, ctx):
        raise RuntimeError("the stage broke")

    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(BootstrapFewShot, "run", broken)
        assert bench(out, "--stages", "demos,labeled") == 1  # a failed stage: exit 1, but every file is written
    results = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in results["stages"]}
    assert rows["demos"]["status"] == "failed" and "the stage broke" in rows["demos"]["error"]
    assert rows["labeled"]["status"] == "ok" and rows["labeled"]["test"]["score"] == 1.0  # went on after it
    assert "failed: RuntimeError: the stage broke" in (out / "results.md").read_text()
    assert (out / "scores.png").read_bytes().startswith(b"\x89PNG")
    calls = scripted.engine.calls
    assert bench(out, "--stages", "demos,labeled", "--resume") == 0  # the failed stage is tried again
    again = {r["name"]: r for r in json.loads((out / "results.json").read_text())["stages"]}
    assert again["demos"]["status"] == "ok" and again["demos"]["test"]["score"] == 1.0
    assert scripted.engine.calls > calls


def test_parse_failures_are_counted_per_stage(tmp_path, monkeypatch):
    lm = scripted_lm(lambda req: "no fields here at all", cache=False)
    monkeypatch.setattr(runner, "make_lm", lambda model, **kwargs: (lm, None))
    assert bench(tmp_path / "run", "--stages", "none") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["stages"][0]["test"]["errors"] == 8 and results["stages"][0]["test"]["score"] == 0.0
    assert "| 8/8 |" in (tmp_path / "run" / "results.md").read_text()


def test_threads_reach_compile(tmp_path, scripted, monkeypatch):
    import flowopt.compiler

    seen = {}
    real = flowopt.compiler.compile

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(flowopt.compiler, "compile", spy)
    assert bench(tmp_path / "run") == 0  # bench passes --threads 2
    assert seen["num_threads"] == 2


@pytest.mark.parametrize(("extra", "problem", "fix"), [
    (["--stages", "demos,nope"], "unknown stage 'nope'", "use one of"),
    (["--stages", "demos,,search"], "empty stage name", "--stages none"),
    (["--candidates", "0"], "--candidates must be >= 1", "--candidates 1"),
    (["--max-lm-calls", "-1"], "--max-lm-calls must be >= 1", "leave it out"),
    (["--dev", "0"], "--dev must be >= 1", "--dev 1"),
    (["--train", "-1"], "--train must be >= 1", "--train 1 or more"),
    (["--test", "0"], "--test must be >= 1", "--test 1"),
    (["--max-tokens", "-1"], "--max-tokens must be >= 1", "--max-tokens 1"),
    (["--threads", "0"], "--threads must be >= 1", "--threads 1"),
    (["--epochs", "0"], "--epochs must be >= 1", "--epochs 1"),
    (["--group-size", "1"], "--group-size must be >= 2", "--group-size 2"),
    (["--grpo-batch", "0"], "--grpo-batch must be >= 1", "--grpo-batch 1"),
    (["--lm-batch", "0"], "--lm-batch must be >= 1", "--lm-batch 1"),
    (["--demos", "-1"], "--demos must be >= 0", "--demos 0 or more"),
    (["--rounds", "0"], "--rounds must be >= 1", "--rounds 1 or more"),
    (["--labels", "only"], "only applies to the finetune stage", "add finetune"),
    (["--exclude-demos"], "--exclude-demos only applies to the finetune stage", "add finetune"),
    (["--train", "300"], "exceeds the 264 examples", "lower --train"),
    (["--test", "2000"], "exceeds the 1055 examples", "--test 1055"),
    (["--program", "magic"], "unknown program 'magic'", "use one of"),
    (["--program", "missing.json"], "no workflow file at missing.json", "save one with Workflow.save"),
    (["--resume"], "holds no earlier run", "drop --resume"),
    (["--stages", "finetune", "--student", "no-such-model"], "neither an embedded model", "--student gemma-3-270m"),
    (["--stages", "finetune", "--labels", "only", "--teacher", "openai/gpt-4o-mini"], "contradict", "--labels mix"),
])
def test_every_setting_is_checked_before_any_lm_call_or_file(tmp_path, monkeypatch, caplog, extra, problem, fix):
    lm = scripted_lm(gsm8k_answer, cache=False)
    monkeypatch.setattr(runner, "make_lm", lambda model, **kwargs: (lm, None))
    out = tmp_path / "runs" / "bench"
    assert bench(out, *extra) == 2
    assert lm.engine.calls == 0 and not (tmp_path / "runs").exists()
    message = " ".join(r.getMessage() for r in caplog.records)
    assert problem in message and fix in message, message


def test_out_that_is_a_file_is_a_clear_error(tmp_path, caplog):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert bench(target) == 2
    assert "is a file, not a folder" in caplog.text and target.read_text() == "keep me"


def test_out_under_a_file_is_a_clear_error(tmp_path, caplog):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert bench(afile / "sub") == 2  # was a NotADirectoryError traceback
    assert f"--out {afile / 'sub'} lies under {afile}, which is a file" in caplog.text
    assert "pass a folder path outside" in caplog.text and afile.read_text() == "keep me"


def test_stages_none_scores_the_baseline_only(tmp_path, scripted):
    assert bench(tmp_path / "run", "--stages", "none") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [r["name"] for r in results["stages"]] == ["baseline"]
    assert results["test"]["change"]["mean"] == 0.0


def test_help_advertises_stages_none_and_the_weights_settings():
    text = cli.bench_parser().format_help()
    for flag in ("'none'", "--labels", "--student", "--teacher", "--epochs", "--grpo-steps", "--group-size",
                 "--grpo-batch", "--lm-batch"):
        assert flag in text


def test_weights_settings_reach_the_stages():
    from flowopt.benchmarks.settings import build_stage

    args = cli.bench_parser().parse_args(["gsm8k-dspy", "--grpo-steps", "7", "--grpo-batch", "16",
                                          "--group-size", "8", "--max-tokens", "200", "--epochs", "2",
                                          "--labels", "only", "--exclude-demos"])
    grpo = build_stage("grpo", args)
    assert (grpo.steps, grpo.batch_size, grpo.group_size, grpo.max_new_tokens) == (7, 16, 8, 200)
    finetune = build_stage("finetune", args)
    assert (finetune.epochs, finetune.labels, finetune.exclude_demos) == (2, "only", True)
    assert build_stage("finetune", cli.bench_parser().parse_args(["gsm8k-dspy"])).exclude_demos is False


def test_demos_and_rounds_reach_the_prompt_stages():
    from flowopt.benchmarks.settings import build_stage
    from flowopt.compiler.stages import resolve_stages

    args = cli.bench_parser().parse_args(["gsm8k-dspy", "--demos", "2", "--rounds", "5", "--candidates", "6"])
    labeled, demos, search, structure = resolve_stages(
        [build_stage(name, args) for name in ("labeled", "demos", "search", "structure")])
    assert labeled.k == 2
    assert (demos.max_bootstrapped_demos, demos.max_labeled_demos) == (2, 2)
    assert (search.n_candidates, search.max_labeled_demos, search.max_demos) == (6, 2, 2)
    assert structure.max_rounds == 5
    defaults = cli.bench_parser().parse_args(["gsm8k-dspy"])
    assert resolve_stages([build_stage("demos", defaults)])[0].max_labeled_demos == 16


def test_demos_caps_the_demos_in_the_compiled_program(tmp_path, scripted):
    assert bench(tmp_path / "run", "--demos", "1") == 0
    compiled = json.loads((tmp_path / "run" / "compiled.json").read_text())
    assert len(compiled["nodes"][0]["predictors"]["cot.predict"]["demos"]) == 1
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["test"]["compiled"]["score"] == 1.0
    assert ", demos 1." in (tmp_path / "run" / "results.md").read_text()


def test_bm25s_debug_lines_are_dropped(tmp_path, monkeypatch, caplog):
    lm = scripted_lm(lambda req: {"answer": "Paris"}, cache=False)
    monkeypatch.setattr(runner, "make_lm", lambda model, **kwargs: (lm, None))
    caplog.set_level("DEBUG")
    argv = ["bench", "hotpotqa-aflow", "--lm", "scripted/lm", "--program", "workflow", "--stages", "none",
            "--train", "2", "--dev", "2", "--test", "3", "--out", str(tmp_path / "run"), "--threads", "1"]
    assert cli.main(argv) == 0
    assert lm.engine.calls == 3  # the retrieval program ran (bm25s logs while indexing)
    assert not [r for r in caplog.records if r.name.startswith("bm25s")]


def test_dspy_truncation_warnings_are_shown_once_and_counted(tmp_path, monkeypatch, caplog, capfd):
    import dataclasses

    import dspy

    from flowopt.testing import ScriptedEngine

    class CutShort(ScriptedEngine):  # every completion hits the token limit, as --max-tokens 8 does
        def complete(self, request):
            return dataclasses.replace(super().complete(request), finish_reason="length")

    engine = CutShort(lambda req: {"answer": "Paris"})
    lm = dspy.LM("scripted/lm", engine=engine, cache=False)
    monkeypatch.setattr(runner, "make_lm", lambda model, **kwargs: (lm, None))
    argv = ["bench", "hotpotqa-aflow", "--lm", "scripted/lm", "--program", "predict", "--stages", "none",
            "--train", "2", "--dev", "2", "--test", "4", "--out", str(tmp_path / "run"), "--threads", "1"]
    assert cli.main(argv) == 0
    assert engine.calls == 4
    printed = capfd.readouterr().err  # DSPy prints through its own handler (its logger does not propagate)
    assert printed.count("LM response was truncated") == 1 and "shown once" in printed
    assert "4 LM responses were truncated at --max-tokens 256" in caplog.text


def test_lm_batch_sets_the_local_models_batch_size(tmp_path):
    from flowopt.lm import local_of
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm(["red", "blue"])
    model.save_pretrained(str(tmp_path / "tiny"))
    tokenizer.save_pretrained(str(tmp_path / "tiny"))
    lm, _adapter = runner.make_lm(str(tmp_path / "tiny"), max_tokens=5, batch=48)
    local = local_of(lm)
    try:
        assert local is not None and local.max_batch_size == 48
    finally:
        local.close()


TEST_QUESTIONS = {ex.question for ex in load_split("gsm8k-aflow", "test")}


def test_a_rejected_stage_still_reports_its_own_test_score(tmp_path, monkeypatch):
    """Demos help on the test split only: the dev split rejects the stage, yet its contribution shows."""

    def answer(request):
        if "answer" not in request.output_fields:
            return {f: "x" for f in request.output_fields}
        question = request.inputs["question"]
        helped = request.demos and question in TEST_QUESTIONS
        return {"reasoning": "Work it out.", "answer": GOLD[question] if helped else "-1"}

    lm = scripted_lm(answer, cache=False)
    monkeypatch.setattr(runner, "make_lm", lambda model, **kwargs: (lm, None))
    out = tmp_path / "run"
    assert bench(out, "--stages", "labeled") == 0
    results = json.loads((out / "results.json").read_text())
    baseline, labeled = results["stages"]
    assert "own" not in baseline
    assert labeled["kept"] is False and labeled["val"]["score"] == labeled["val"]["before"] == 0.0
    assert labeled["test"]["score"] == 0.0  # the best program so far is still the baseline
    assert labeled["own"]["score"] == 1.0 and labeled["own"]["n"] == 8
    assert labeled["own"]["change"] == {"mean": 1.0, "ci": [1.0, 1.0], "n": 8}
    md = (out / "results.md").read_text()
    assert "| labeled | ok | 0.000 [" in md and "| no | 1.000 [" in md and "| +1.000 [+1.000, +1.000] |" in md
    calls = lm.engine.calls
    assert bench(out, "--stages", "labeled", "--resume") == 0  # the rejected output is reloaded, not re-run
    assert lm.engine.calls == calls
    again = json.loads((out / "results.json").read_text())
    assert again["stages"][1]["own"] == labeled["own"]


def test_a_kept_stage_reports_its_test_score_as_its_own(tmp_path, scripted):
    assert bench(tmp_path / "run") == 0
    demos = json.loads((tmp_path / "run" / "results.json").read_text())["stages"][1]
    assert demos["kept"] is True
    assert demos["own"]["score"] == demos["test"]["score"] == 1.0
    assert demos["own"]["change"]["mean"] == 1.0


def test_a_saved_program_continues_where_its_run_stopped(tmp_path, scripted):
    """``--program compiled.json`` starts the stages from an earlier run's program; the earlier run's test
    scores of that program are reused (evals/ alone is enough for --resume), so it is not scored again."""
    assert bench(tmp_path / "first") == 0
    first = json.loads((tmp_path / "first" / "results.json").read_text())
    second = tmp_path / "second"
    second.mkdir()
    shutil.copytree(tmp_path / "first" / "evals", second / "evals")
    calls = scripted.engine.calls
    saved = str(tmp_path / "first" / "compiled.json")
    assert bench(second, "--program", saved, "--stages", "none", "--resume") == 0
    assert scripted.engine.calls == calls
    results = json.loads((second / "results.json").read_text())
    assert results["test"]["baseline"] == first["test"]["compiled"]
    assert results["test"]["baseline"]["score"] == 1.0  # the demos the first run compiled are in the program


def test_a_saved_program_of_another_protocol_is_refused(tmp_path, scripted, caplog):
    other = Workflow("question, context: list[str] -> answer").add(
        "answer", Predict("question, context: list[str] -> answer"))
    other.save(tmp_path / "hotpot.json")
    assert bench(tmp_path / "run", "--program", str(tmp_path / "hotpot.json")) == 2
    assert "maps ['question', 'context'] -> ['answer']" in caplog.text
    assert "saved from a gsm8k-aflow run" in caplog.text and not (tmp_path / "run").exists()


def test_a_local_model_run_reports_how_full_its_decode_batches_were(tmp_path):
    """With a local model the results carry the decode loop's counters (rows per step, compile seconds),
    which is how a GPU scoring run shows whether its batches stayed full."""
    from flowopt.benchmarks.perf.local_lm_cuda import build_model

    model = build_model(tmp_path / "tiny", layers=1)
    out = tmp_path / "run"
    assert cli.main(["bench", "gsm8k-aflow", "--lm", str(model), "--program", "predict", "--stages", "none",
                     "--test", "3", "--max-tokens", "4", "--threads", "3", "--lm-batch", "4", "--out", str(out),
                     "--quiet"]) == 0
    decode = json.loads((out / "results.json").read_text())["decode"]
    assert decode["steps"] >= 3 and sum(decode["steps_by_rows"].values()) == decode["steps"]
    assert 1 <= decode["mean_rows_per_step"] <= 4 and decode["eager_reason"] is None
