"""BootstrapFinetune from gold labels: label pairs (answers, GSM8K rationales), labels alone and mixed."""

from __future__ import annotations

import tempfile
from pathlib import Path

import dspy
import pytest

import flowopt
from flowopt import ConfigError
from flowopt.lm.completion_adapter import AutoAdapter
from flowopt.modules import ChainOfThought, Predict, Retrieve
from flowopt.optimizers.weights import BootstrapFinetune, LoraSettings
from flowopt.optimizers.weights.traces import gold_outputs, label_pairs
from flowopt.testing import scripted_lm

LORA = LoraSettings(r=4, alpha=8)


def test_gold_outputs_take_answers_and_a_gold_rationale_without_calculator_notes():
    ex = dspy.Example(question="q", answer="72", solution="48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72")
    assert gold_outputs(ex, ["reasoning", "answer"]) == {"reasoning": "48/2 = 24\n48+24 = 72", "answer": "72"}
    assert gold_outputs(dspy.Example(answer=["Paris", "paris"]), ["answer"]) == {"answer": "Paris"}
    assert gold_outputs(dspy.Example(answer="Paris"), ["reasoning", "answer"]) is None


def test_label_pairs_run_retrieval_and_supervise_the_answer_node():
    wf = flowopt.Workflow("question, context: list[str] -> answer", name="rag")
    wf.add("retrieve", Retrieve(k=1)).add("answer", Predict("question, passages: list[str] -> answer"))
    ex = dspy.Example(question="Where is the Eiffel Tower?", answer="Paris",
                      context=["Cats sleep a lot.", "The Eiffel Tower is in Paris."]).with_inputs("question", "context")
    adapter = dspy.ChatAdapter()
    [pair] = label_pairs(wf, [ex], adapter)
    assert pair.node == "answer"
    prompt = pair.messages[-1]["content"]
    assert "The Eiffel Tower is in Paris." in prompt and "Cats sleep" not in prompt  # retrieval ran
    assert "[[ ## answer ## ]]\nParis" in pair.completion


def test_label_pairs_need_a_rationale_for_a_reasoning_field():
    program = ChainOfThought("question -> answer")
    adapter = dspy.ChatAdapter()
    gsm = dspy.Example(question="2+2?", answer="4", solution="2+2=<<2+2=4>>4").with_inputs("question")
    [pair] = label_pairs(program, [gsm], adapter)
    assert "2+2=4" in pair.completion and "<<" not in pair.completion and "4" in pair.completion
    with pytest.raises(ConfigError, match="reasoning field needs a gold rationale"):
        label_pairs(program, [dspy.Example(question="Capital?", answer="Paris").with_inputs("question")], adapter)


def test_labels_setting_is_checked():
    with pytest.raises(ConfigError, match=r"labels must be one of \['only', 'mix'\] or None"):
        BootstrapFinetune(labels="gold")


def _right(program, example, task) -> float:
    try:
        return task.metric(example, program(**example.inputs()))
    except Exception:  # an unparseable answer of the untrained model is a wrong answer
        return 0.0


def test_finetune_from_labels_only_learns_without_a_teacher(tiny_local, task, tmp_path_factory):
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = tiny_local.lm
    ctx = task.ctx(task.examples(24, seed=5), task.examples(16, seed=6), stage_name="finetune")
    with dspy.context(adapter=AutoAdapter()):
        before = sum(_right(program, ex, task) for ex in ctx.valset)
        out = BootstrapFinetune(labels="only", epochs=6, learning_rate=1e-2, lora=LORA).run(program, ctx)
        after = sum(_right(out, ex, task) for ex in ctx.valset)
    assert ctx.info["label_pairs"] == 24 and ctx.info["teacher_runs"] == 0 and ctx.info["pairs"] == 24
    assert before <= 2 and after >= 8, (before, after)
    # Without a run_dir the adapter goes to a fresh flowopt-finetune-* folder under tempfile's folder (the
    # conftest points it into pytest's tree), kept after the stage since the returned program loads it.
    saved = Path(ctx.info["adapter"])
    assert saved.parent.parent == Path(tempfile.gettempdir()) and saved.parent.name.startswith("flowopt-finetune-")
    assert Path(tempfile.gettempdir()).is_relative_to(tmp_path_factory.getbasetemp())
    assert (saved / "adapter_model.safetensors").is_file()
    assert out.lm.adapter_path == str(saved)  # what the program records and reloads


def test_finetune_mix_adds_passing_teacher_traces_to_the_labels(tiny_local, task):
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = tiny_local.lm
    teacher = scripted_lm(lambda req: {"word": task.animals[task.colors.index(req.inputs["cue"])]}, cache=False)
    ctx = task.ctx(task.examples(8, seed=5), [], stage_name="finetune")
    with dspy.context(adapter=AutoAdapter()):
        BootstrapFinetune(labels="mix", teacher=teacher, epochs=1, lora=LORA).run(program, ctx)
    assert ctx.info["label_pairs"] == 8 and ctx.info["teacher_passed"] == 8 and ctx.info["pairs"] == 16


def test_label_pairs_carry_the_demos_unless_excluded():
    program = Predict("question -> answer")
    [(_, predictor)] = program.named_predictors()
    predictor.demos = [dspy.Example(question="What colour is the sky?", answer="blue")]
    ex = dspy.Example(question="Capital of France?", answer="Paris").with_inputs("question")
    adapter = dspy.ChatAdapter()
    [with_demos] = label_pairs(program, [ex], adapter)
    [without] = label_pairs(program, [ex], adapter, exclude_demos=True)
    assert "What colour is the sky?" in str(with_demos.messages)
    assert "What colour is the sky?" not in str(without.messages) and "Capital of France?" in str(without.messages)
    assert without.completion == with_demos.completion


def test_exclude_demos_trains_and_returns_the_program_without_them(tiny_local, task, monkeypatch):
    """DSPy's exclude_demos: the teacher runs with the demos, the student learns (and later runs) without."""
    from flowopt.optimizers.weights import sft

    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = tiny_local.lm
    program.demos = [dspy.Example(noise="demo-noise", cue=task.colors[0], word=task.animals[0])]
    seen_demos = []

    def teach(request):
        seen_demos.append(len(request.demos))
        return {"word": task.animals[task.colors.index(request.inputs["cue"])]}

    trained_on = []
    real_token_pairs = sft.token_pairs
    monkeypatch.setattr(sft, "token_pairs", lambda policy, pairs, limit: trained_on.extend(pairs) or
                        real_token_pairs(policy, pairs, limit))
    ctx = task.ctx(task.examples(8, seed=5), [], stage_name="finetune")
    stage = BootstrapFinetune(labels="mix", teacher=scripted_lm(teach, cache=False), epochs=1, lora=LORA,
                              exclude_demos=True)
    with dspy.context(adapter=AutoAdapter()):
        out = stage.run(program, ctx)
    assert seen_demos == [1] * 8  # the teacher read the demo
    assert len(trained_on) == 16 and not any("demo-noise" in str(p.messages) for p in trained_on)
    assert out.demos == [] and ctx.info["pairs"] == 16
