"""Bad input gets a clear flowopt error, before LM calls where possible, and run_dir stays sound."""

from __future__ import annotations

import json
import os

import dspy
import pytest
from fakes import demo_task_lm, exact, examples

import flowopt
from flowopt import Budget, BudgetExhausted, ConfigError, DataError, MetricError
from flowopt.modules import Predict


def _run_dir_is_sound(path):
    assert not [p for p in path.rglob("*.tmp")], "half-written files left behind"
    for p in path.rglob("*.json"):
        json.loads(p.read_text())


def test_empty_trainset():
    with pytest.raises(DataError, match="trainset is empty"):
        flowopt.compile(dspy.Predict("question -> answer"), [], exact, quiet=True)


def test_single_example_without_valset():
    with pytest.raises(DataError, match="nothing is left to validate"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(1), exact, quiet=True)


def test_example_missing_a_program_input(tmp_path):
    wf = flowopt.chain("question -> answer", Predict("question -> answer"))
    bad = [*examples(3), dspy.Example(query="x", answer="y").with_inputs("query")]
    lm = demo_task_lm()
    with dspy.context(lm=lm), pytest.raises(DataError, match=r"trainset\[3\] has no field 'question'"):
        flowopt.compile(wf, bad, exact, quiet=True, run_dir=tmp_path / "r")
    assert lm.engine.calls == 0


def test_examples_without_inputs_for_a_plain_module():
    with pytest.raises(DataError, match="with_inputs"):
        flowopt.compile(dspy.Predict("question -> answer"), [dspy.Example(question="q", answer="a")] * 3, exact)


def test_metric_that_raises_names_the_example(tmp_path):
    def metric(example, pred, trace=None):
        return example.label == pred.answer  # no 'label' field

    with dspy.context(lm=demo_task_lm()), pytest.raises(MetricError, match=r"example #\d+ \(.*word"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), metric, quiet=True, run_dir=tmp_path / "r")
    _run_dir_is_sound(tmp_path / "r")


def test_metric_returning_a_non_number():
    with dspy.context(lm=demo_task_lm()), pytest.raises(MetricError, match="returned 'yes'"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), lambda e, p, t=None: "yes", quiet=True)


def test_unknown_stage_name_lists_known_ones():
    with pytest.raises(ConfigError, match=r"unknown stage 'demoz'.*'demos'"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(4), exact, stages=["demoz"])


@pytest.mark.parametrize("spec, match", [
    (("demos", {"max_bootstrapped_demos": -1}), "max_bootstrapped_demos must be an int >= 0"),
    (("search", {"sampler": "grid"}), "sampler must be one of"),
    (("demos", {"nonsense": 1}), "bad settings for stage 'demos'"),
])
def test_bad_stage_settings(spec, match):
    with pytest.raises(ConfigError, match=match):
        flowopt.compile(dspy.Predict("question -> answer"), examples(4), exact, stages=[spec])


def test_the_remaining_settings_validate_through_flowopt_settings():
    from flowopt.optimizers.weights import InferenceServer, LoraSettings

    for bad, match in [(lambda: LoraSettings(r=2.5), "LoraSettings r must be an int"),
                       (lambda: LoraSettings(dropout=1.0), "dropout must be a number >= 0 and < 1"),
                       (lambda: InferenceServer("http://127.0.0.1:8000/v1", adapter_dir="a", timeout_s=float("nan")),
                        "timeout_s"),
                       (lambda: Budget(max_cost_usd=float("nan")), "max_cost_usd")]:
        with pytest.raises(ConfigError, match=match):
            bad()
    for kwargs, match in [({"max_errors": -1}, "compile max_errors must be an int >= 0"),
                          ({"quiet": "yes"}, "compile quiet must be a bool")]:
        with pytest.raises(ConfigError, match=match):
            flowopt.compile(dspy.Predict("question -> answer"), examples(4), exact, **kwargs)


def test_bad_budget_values():
    with pytest.raises(ConfigError, match="max_lm_calls must be an int >= 0"):
        Budget(max_lm_calls=-1)
    with pytest.raises(ConfigError, match="max_tokens must be an int"):
        Budget(max_tokens=1.5)


def test_budget_already_exhausted_raises_and_leaves_run_dir_sound(tmp_path):
    lm = demo_task_lm()
    with dspy.context(lm=lm), pytest.raises(BudgetExhausted, match="max_lm_calls used 0 of 0"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, budget=Budget(max_lm_calls=0),
                        quiet=True, run_dir=tmp_path / "r")
    assert lm.engine.calls == 0
    _run_dir_is_sound(tmp_path / "r")


def test_run_dir_reuse_needs_resume_and_same_settings(tmp_path):
    lm = demo_task_lm()
    with dspy.context(lm=lm):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, stages=["labeled"], quiet=True,
                        run_dir=tmp_path)
        with pytest.raises(ConfigError, match="resume=True"):
            flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, stages=["labeled"],
                            run_dir=tmp_path)
        with pytest.raises(ConfigError, match="differs in: seed"):
            flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, stages=["labeled"],
                            run_dir=tmp_path, resume=True, seed=1)
    _run_dir_is_sound(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# compile() arguments: each refused with a named error before any LM call, and nothing written anywhere.

def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


def _file(tmp_path):
    (tmp_path / "a-file").write_text("keep me")
    return tmp_path / "a-file"


COMPILE_CASES = {
    "budget with an unknown limit": (lambda tmp: {"budget": {"max_calls": 10}}, "unknown limits"),
    "budget limit as a string": (lambda tmp: {"budget": {"max_lm_calls": "10"}}, "max_lm_calls"),
    "budget limit NaN": (lambda tmp: {"budget": {"max_lm_calls": float("nan")}}, "max_lm_calls"),
    "budget wall time infinite": (lambda tmp: {"budget": {"max_wall_s": float("inf")}}, "max_wall_s"),
    "budget a list": (lambda tmp: {"budget": [10]}, "budget is a list"),
    "run_dir empty": (lambda tmp: {"run_dir": ""}, "current folder"),
    "run_dir blank": (lambda tmp: {"run_dir": "   "}, "current folder"),
    "run_dir a number": (lambda tmp: {"run_dir": 5}, "folder path"),
    "run_dir a file": (lambda tmp: {"run_dir": _file(tmp)}, "is a file"),
    "run_dir below a file": (lambda tmp: {"run_dir": _file(tmp) / "run"}, "which is a file"),
    "run_dir under /proc": (lambda tmp: {"run_dir": "/proc/self/flowopt-run"}, "/proc"),
    "run_dir under /sys": (lambda tmp: {"run_dir": "/sys/flowopt-run"}, "/sys"),
    "run_dir with NUL": (lambda tmp: {"run_dir": str(tmp / "a\x00b")}, "NUL"),
    "resume not a bool": (lambda tmp: {"resume": "yes", "run_dir": tmp / "r"}, "resume"),
    "seed a string": (lambda tmp: {"seed": "0"}, "seed"),
    "num_threads 0": (lambda tmp: {"num_threads": 0}, "num_threads"),
    "demos setting as a string": (lambda tmp: {"stages": [("demos", {"max_bootstrapped_demos": "4"})]},
                                  "max_bootstrapped_demos"),
    "search n_candidates 2.5": (lambda tmp: {"stages": [("search", {"n_candidates": 2.5})]}, "n_candidates"),
    "search temperatures above 2": (lambda tmp: {"stages": [("search", {"temperatures": [0.5, 9]})]},
                                    "temperatures"),
    "structure alpha NaN": (lambda tmp: {"stages": [("structure", {"alpha": float("nan")})]}, "alpha"),
    "finetune epochs '3'": (lambda tmp: {"stages": [("finetune", {"epochs": "3"})]}, "epochs"),
    "grpo steps 2.5": (lambda tmp: {"stages": [("grpo", {"steps": 2.5})]}, "steps"),
    "grpo temperature NaN": (lambda tmp: {"stages": [("grpo", {"temperature": float("nan")})]}, "temperature"),
}


@pytest.mark.parametrize("case", sorted(COMPILE_CASES))
def test_bad_compile_arguments_are_refused_before_any_lm_call(case, tmp_path, monkeypatch):
    make, match = COMPILE_CASES[case]
    kwargs = make(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    lm = demo_task_lm()
    with dspy.context(lm=lm), pytest.raises(flowopt.FlowoptError, match=match) as info:
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, quiet=True, **kwargs)
    assert isinstance(info.value, ConfigError) and "Fix:" in str(info.value)
    assert lm.engine.calls == 0
    assert _tree(tmp_path) == before  # nothing created, nothing changed (the cwd included)


def test_read_only_run_dir_is_refused(tmp_path, monkeypatch):
    import os

    parent = tmp_path / "ro"
    parent.mkdir()
    real_statvfs = os.statvfs

    class _ReadOnly:
        def __init__(self, path):
            self._stat = real_statvfs(path)
            self.f_flag = self._stat.f_flag | os.ST_RDONLY

    # A read-only mount (root writes through file modes, so chmod alone proves nothing under root).
    monkeypatch.setattr(os, "statvfs", lambda p: _ReadOnly(p) if str(p).startswith(str(parent)) else real_statvfs(p))
    with pytest.raises(ConfigError, match="read-only"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, quiet=True, run_dir=parent / "run")
    assert list(parent.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_folder_without_write_permission_is_refused(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="read-only"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(6), exact, quiet=True, run_dir=parent / "run")


# ---------------------------------------------------------------------------------------------------------
# Checkpoints: each carries a SHA-256 digest; a damaged or edited one is refused on resume, by name.

def _finished_run(tmp_path, stages=("labeled", "demos")):
    run = tmp_path / "run"
    with dspy.context(lm=demo_task_lm()):
        flowopt.compile(dspy.Predict("question -> answer"), examples(8), exact, stages=list(stages), quiet=True,
                        run_dir=run)
    return run


def _edit_demo_answer(path):
    data = json.loads(path.read_text())
    demos = data["program"]["state"]["demos"]
    assert demos, "the labeled stage put demos on the program"
    demos[0]["answer"] = "#tampered"
    path.write_text(json.dumps(data))


def _edit_baseline_score(path):
    data = json.loads(path.read_text())
    data["baseline"]["score"] = 0.99  # would make every later stage look worse than the baseline
    path.write_text(json.dumps(data))


CHECKPOINT_CASES = {
    "edited demo answer": ("stages/00-labeled/output.json", _edit_demo_answer),
    "binary output.json": ("stages/00-labeled/output.json", lambda p: p.write_bytes(bytes(range(256)))),
    "truncated output.json": ("stages/00-labeled/output.json", lambda p: p.write_bytes(p.read_bytes()[:100])),
    "empty object": ("stages/00-labeled/output.json", lambda p: p.write_text("{}")),
    "a JSON list": ("stages/00-labeled/output.json", lambda p: p.write_text("[]")),
    "digest removed": ("stages/00-labeled/output.json",
                       lambda p: p.write_text(json.dumps({k: v for k, v in json.loads(p.read_text()).items()
                                                          if k != "sha256"}))),
    "edited baseline score": ("compile.json", lambda p: _edit_baseline_score(p)),
    "binary compile.json": ("compile.json", lambda p: p.write_bytes(b"\x80\x04\x95" + bytes(64))),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_damaged_checkpoints_are_refused_on_resume(case, tmp_path):
    run = _finished_run(tmp_path)
    target, damage = CHECKPOINT_CASES[case]
    damage(run / target)
    before = _tree(run)
    lm = demo_task_lm()
    with dspy.context(lm=lm), pytest.raises(ConfigError, match="refused") as info:
        flowopt.compile(dspy.Predict("question -> answer"), examples(8), exact, stages=["labeled", "demos"],
                        quiet=True, run_dir=run, resume=True)
    assert target in str(info.value) and "Fix: delete" in str(info.value)
    assert lm.engine.calls == 0
    assert _tree(run) == before


def test_deleting_the_refused_checkpoint_recomputes_that_stage(tmp_path):
    run = _finished_run(tmp_path)
    _edit_demo_answer(run / "stages/00-labeled/output.json")
    (run / "stages/00-labeled/output.json").unlink()  # what the refusal's fix says
    with dspy.context(lm=demo_task_lm()):
        out = flowopt.compile(dspy.Predict("question -> answer"), examples(8), exact, stages=["labeled", "demos"],
                              quiet=True, run_dir=run, resume=True)
    assert not out.report.stage("labeled").resumed and out.report.stage("demos").resumed
    assert all(d["answer"] != "#tampered" for d in out.predictors()[0].demos)


def test_a_damaged_search_db_is_refused(tmp_path):
    run = _finished_run(tmp_path, stages=("search",))
    (run / "stages/00-search/output.json").unlink()  # as if killed before the search finished
    db = run / "stages/00-search/search.db"
    db.write_bytes(db.read_bytes()[:4096] + bytes(4096))
    damaged = db.read_bytes()
    with dspy.context(lm=demo_task_lm()), pytest.raises(ConfigError, match=r"search\.db is refused"):
        flowopt.compile(dspy.Predict("question -> answer"), examples(8), exact, stages=["search"], quiet=True,
                        run_dir=run, resume=True)
    assert db.read_bytes() == damaged
