"""``python -m flowopt.optimizers.weights`` (the entry point ``accelerate launch -m`` runs on every process),
and compile's rules for launched processes."""

from __future__ import annotations

import json

import dspy
import pytest

import flowopt
from flowopt.benchmarks import cue_word
from flowopt.errors import ConfigError, DataError
from flowopt.modules import Predict
from flowopt.optimizers.weights.__main__ import main, stage_settings


def _files(tmp_path, tiny_saved_local):
    wf = flowopt.Workflow("noise, cue -> word", name="cue-word")
    wf.add("solve", Predict(dspy.Signature("noise, cue -> word", "Answer.")), lm="default")
    wf.lms["default"] = tiny_saved_local.lm
    program = wf.save(tmp_path / "wf.json")
    rows = [{"noise": ex.noise, "cue": ex.cue, "word": ex.word} for ex in cue_word.make_examples(8, seed=3)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return program, data


def test_the_module_compiles_a_saved_workflow_with_the_weights_stages(tmp_path, tiny_saved_local):
    program, data = _files(tmp_path, tiny_saved_local)
    run = tmp_path / "run"
    assert main(["--program", str(program), "--trainset", str(data), "--valset", str(data), "--inputs", "noise,cue",
                 "--metric", "flowopt.benchmarks.cue_word:metric", "--stage", "finetune",
                 "--set", "finetune.labels=only", "--set", "finetune.epochs=1", "--set", 'finetune.lora={"r": 4}',
                 "--run-dir", str(run)]) == 0
    report = json.loads((run / "report.json").read_text())
    finetune = report["stages"][-1]
    assert finetune["name"] == "finetune" and finetune["info"]["pairs"] == 8
    assert (run / "program.json").is_file()
    assert (run / "stages" / "00-finetune" / "adapter" / "adapter_model.safetensors").is_file()


def test_the_module_names_what_is_wrong_with_its_input(tmp_path, tiny_saved_local):
    program, data = _files(tmp_path, tiny_saved_local)
    common = ["--program", str(program), "--inputs", "noise,cue", "--stage", "grpo", "--run-dir", str(tmp_path / "r")]
    with pytest.raises(ConfigError, match="is not module:function"):
        main([*common, "--trainset", str(data), "--metric", "cue_word"])
    with pytest.raises(DataError, match="lacks the input fields"):
        main([*common, "--trainset", str(data), "--inputs", "question",
              "--metric", "flowopt.benchmarks.cue_word:metric"])
    with pytest.raises(ConfigError, match="does not name one of the stages"):
        stage_settings(["grpo"], ["finetune.epochs=2"])


def test_launched_compile_refuses_stages_that_run_in_one_process(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    train = [dspy.Example(q=str(i), a=str(i)).with_inputs("q") for i in range(4)]
    with pytest.raises(ConfigError, match=r"launched on 2 processes, but stages \['demos'\] run in one process"):
        flowopt.compile(dspy.Predict("q -> a"), train, lambda ex, pred, trace=None: 1.0, stages=["demos", "grpo"],
                        run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_only_rank_0_writes_the_run_folder(tmp_path):
    from flowopt.compiler.checkpoint import RunFolder

    reader = RunFolder(tmp_path, resume=False, fingerprint={"seed": 0}, writer=False)
    reader.write_manifest()
    reader.save_report({"stages": []})
    reader.save_finished(0, "grpo", None, {"name": "grpo"})
    assert not (tmp_path / "compile.json").exists() and not (tmp_path / "report.json").exists()
    assert not (tmp_path / "stages" / "00-grpo" / "output.json").exists()
    writer = RunFolder(tmp_path, resume=False, fingerprint={"seed": 0})
    writer.write_manifest()
    # Rank 1 starts after rank 0 wrote the manifest of this very run: not a leftover run to refuse.
    RunFolder(tmp_path, resume=False, fingerprint={"seed": 0}, writer=False)
    with pytest.raises(ConfigError, match="already holds a compile run"):
        RunFolder(tmp_path, resume=False, fingerprint={"seed": 0})
