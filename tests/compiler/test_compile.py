"""compile(): baseline vs stages, no mutation, determinism, report, Workflow meta, registry, layering."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import dspy
import pytest
from fakes import demo_task_lm, exact, examples

import flowopt
from flowopt.compiler import CompileReport, Stage, StageContext, get_stage, register_stage
from flowopt.modules import ChainOfThought, Predict


def test_demos_decide_the_outcome_baseline_low_compiled_optimal():
    lm = demo_task_lm()
    program = dspy.Predict("question -> answer")
    with dspy.context(lm=lm):
        out = flowopt.compile(program, examples(12), exact, valset=examples(8, 100), stages=["demos"], quiet=True)
    report = out.report
    assert report.baseline_score == 0.0
    assert report.best_score == 1.0
    assert report.stage("demos").kept and report.stage("demos").change == pytest.approx(1.0)
    assert program.demos == []  # the input is never modified
    assert len(out.demos) >= 2


def test_workflow_report_in_meta_and_json_roundtrip(tmp_path):
    lm = demo_task_lm()
    wf = flowopt.chain("question -> answer", Predict("question -> answer"), name="qa")
    before = wf.to_json()
    with dspy.context(lm=lm):
        out = flowopt.compile(wf, examples(12), exact, stages=["demos"], quiet=True, run_dir=tmp_path / "run")
    assert wf.to_json() == before
    assert out.meta["report"]["best_score"] == 1.0
    assert "split from the trainset" in out.report.valset_source
    saved = json.loads((tmp_path / "run" / "program.json").read_text())
    assert saved["meta"]["report"]["stages"][1]["name"] == "demos"
    loaded = flowopt.load(tmp_path / "run" / "program.json")
    with dspy.context(lm=lm):
        assert loaded(question="word3").answer == "#3drow"
    table = str(out.report)
    assert "baseline" in table and "demos" in table and "95% CI" in table
    again = CompileReport.from_dict(json.loads(out.report.to_json()))
    assert again.best_score == 1.0


def test_same_seed_same_result_and_different_seed_runs():
    lm = demo_task_lm()
    train, val = examples(16), examples(6, 100)
    with dspy.context(lm=lm):
        a = flowopt.compile(flowopt.chain("question -> answer", ChainOfThought("question -> answer")), train, exact,
                            valset=val, stages=[("demos", {"max_labeled_demos": 4})], seed=3, quiet=True)
        b = flowopt.compile(flowopt.chain("question -> answer", ChainOfThought("question -> answer")), train, exact,
                            valset=val, stages=[("demos", {"max_labeled_demos": 4})], seed=3, quiet=True)
    assert a.canonical_json() == b.canonical_json()


def test_cache_hits_counted_apart_from_real_calls():
    lm = demo_task_lm()
    val = examples(5, 100)
    with dspy.context(lm=lm):
        first = flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, valset=val,
                                stages=["labeled"], quiet=True)
        second = flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, valset=val,
                                 stages=["labeled"], quiet=True)
    assert first.report.stages[0].lm_calls == 5 and first.report.stages[0].cache_hits == 0
    assert second.report.stages[0].lm_calls == 0 and second.report.stages[0].cache_hits == 5
    assert lm.engine.calls == first.report.total["lm_calls"]


@dataclass(frozen=True)
class Shout(Stage):
    name: ClassVar[str] = "test-shout"
    suffix: str = "!"

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        for _, p in program.named_predictors():
            p.signature = p.signature.with_instructions("Shout" + self.suffix)
        ctx.record(candidates_tried=1, stop_reason="custom", extra=[1, 2])
        return program


def test_user_stage_by_object_and_by_registered_name():
    register_stage(Shout)
    assert get_stage("test-shout") is Shout
    lm = demo_task_lm()
    with dspy.context(lm=lm):
        out = flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, valset=examples(3, 50),
                              stages=[Shout(suffix="?"), ("test-shout", {"suffix": "!!"})], quiet=True)
    rows = out.report.stages
    assert [r.name for r in rows] == ["baseline", "test-shout", "test-shout"]
    assert rows[1].stop_reason == "custom" and rows[1].info["extra"] == [1, 2] and rows[1].candidates_tried == 1
    assert rows[2].settings == {"suffix": "!!"}
    assert not rows[1].kept  # equal score: the simpler program so far is kept


@dataclass(frozen=True)
class Typed(Stage):
    """Reports through the typed outcome, not through ``info``."""

    name: ClassVar[str] = "test-typed"

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        ctx.outcome.candidates_tried = 3
        ctx.outcome.stop_reason = "converged"
        ctx.outcome.best_candidate = 2
        ctx.record(rounds=4)
        return program


def test_the_typed_stage_outcome_reaches_the_report():
    with dspy.context(lm=demo_task_lm()):
        out = flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, valset=examples(3, 50),
                              stages=[Typed()], quiet=True)
    row = out.report.stage("test-typed")
    assert (row.candidates_tried, row.stop_reason) == (3, "converged")
    assert row.info["best_candidate"] == 2 and row.info["rounds"] == 4 and "stop_reason" not in row.info


def test_builtin_stage_names_resolve():
    from flowopt.optimizers.demos import BootstrapFewShot, LabeledFewShot
    from flowopt.optimizers.search import RandomSearch

    assert get_stage("demos") is BootstrapFewShot
    assert get_stage("labeled") is LabeledFewShot
    assert get_stage("search") is RandomSearch


def test_compiler_core_never_imports_higher_layers():
    root = Path(flowopt.__file__).parent
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(("flowopt.optimizers", "flowopt.benchmarks")), (path, name)
                if "compiler" in path.parts:
                    assert not name.startswith("flowopt.modules"), (path, name)


@dataclass(frozen=True)
class _ScoresItsStart(Stage):
    """A first stage that scores its start itself (as a shared search does), then returns it with demos."""

    name: ClassVar[str] = "scores-start"
    leave_scores: bool = True

    def scores_its_start(self) -> bool:
        return True

    def run(self, program, ctx):
        if self.leave_scores:  # what another worker scored: taken, not scored here
            ctx.evaluator.remember(program, ctx.valset, [(0.25, False)] * len(ctx.valset))
        program.demos = [ex for ex in ctx.trainset[:4]]
        return program


@pytest.mark.parametrize("leave_scores", [True, False])
def test_a_stage_that_scores_its_start_gives_the_baseline(leave_scores):
    lm = demo_task_lm()
    with dspy.context(lm=lm):
        out = flowopt.compile(dspy.Predict("question -> answer"), examples(12), exact, valset=examples(8, 100),
                              stages=[_ScoresItsStart(leave_scores=leave_scores)], quiet=True)
    report = out.report
    assert [s.name for s in report.stages] == ["baseline", "scores-start"]
    baseline = report.stage("baseline")
    # Its scores are the baseline (no LM call); a stage that left none has the baseline scored after it.
    assert (baseline.score, baseline.lm_calls) == ((0.25, 0) if leave_scores else (0.0, 8))
    stage = report.stage("scores-start")
    assert stage.kept and stage.change == pytest.approx(1.0 - baseline.score) and report.best_score == 1.0


def test_a_rejected_stages_output_is_saved_and_can_be_reloaded(tmp_path):
    """compile returns the best program; the run folder keeps what every stage made, kept or not."""
    from flowopt.compiler import saved_output

    start = dspy.Predict("question -> answer")
    with dspy.context(lm=demo_task_lm()):
        out = flowopt.compile(start, examples(6), exact, valset=examples(3, 50), stages=[Shout(suffix="?")],
                              run_dir=tmp_path / "run", quiet=True)
    assert not out.report.stages[1].kept
    assert "?" not in out.signature.instructions  # the returned program is the input, not the stage's
    rejected = saved_output(tmp_path / "run", 0, "test-shout", start)
    assert rejected is not None and rejected.signature.instructions.endswith("?")
    assert saved_output(tmp_path / "run", 1, "test-shout", start) is None  # no such stage


def test_a_stage_the_budget_stopped_is_saved_unfinished_and_runs_again_on_resume(tmp_path):
    """The budget ran out while the stage's output was validated: the output is readable (so ``flowopt
    bench`` can score what the stage made) but the stage is not finished, so ``--resume`` runs it again."""
    from flowopt.compiler import Budget, saved_output

    start = dspy.Predict("question -> answer")
    args = dict(valset=examples(3, 50), stages=[Shout(suffix="?")], run_dir=tmp_path / "run", quiet=True,
                budget=Budget(max_lm_calls=4))  # the baseline's 3 calls fit; the output's 3 do not
    with dspy.context(lm=demo_task_lm()):
        first = flowopt.compile(start, examples(6), exact, **args)
    row = first.report.stages[1]
    assert row.stop_reason == "budget: max_lm_calls" and row.score is None and not row.kept
    stopped = saved_output(tmp_path / "run", 0, "test-shout", start)
    assert stopped is not None and stopped.signature.instructions.endswith("?")
    with dspy.context(lm=demo_task_lm()):
        again = flowopt.compile(start, examples(6), exact, resume=True, **args)
    rerun = again.report.stages[1]
    assert not rerun.resumed and rerun.score is not None  # run again: the baseline's calls were saved
