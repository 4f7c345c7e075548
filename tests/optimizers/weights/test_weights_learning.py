"""Learning on CPU with a tiny model: GRPO raises mean reward, SFT raises held-out accuracy.

Both use the real stack: a LocalLM, its DSPy engine, the completion adapter LocalLM picks for base
models, the stage interface and its context. They assert improvement, not exact values.
"""

from __future__ import annotations

import time

import dspy

from flowopt.lm import AutoAdapter, adapter_for, local_of
from flowopt.optimizers.weights import GRPO, BootstrapFinetune, LoraSettings
from flowopt.testing import scripted_lm


def _mean(xs):
    return sum(xs) / len(xs)


def _program(local):
    # Short instructions keep the prompt short: a 2-layer random model's attention is easily diluted.
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = local.lm
    return program


def test_grpo_raises_mean_reward(tiny_local, task, tmp_path):
    program = _program(tiny_local)
    ctx = task.ctx(task.examples(64, seed=1), task.examples(32, seed=2), run_dir=tmp_path / "grpo")
    stage = GRPO(steps=50, batch_size=4, group_size=16, max_new_tokens=2, learning_rate=5e-3,
                 lora=LoraSettings(r=8, alpha=16), checkpoint_every=20)
    with dspy.context(adapter=adapter_for(tiny_local.lm)):  # the completion adapter, as for any base model
        before = ctx.evaluate(program, ctx.valset).score
        started = time.monotonic()
        out = stage.run(program, ctx)
        elapsed = time.monotonic() - started
        ctx.evaluator.forget()  # its memo keys on prompts and demos, not on the weights behind the LM
        after = ctx.evaluate(out, ctx.valset).score  # greedy, on held-out examples
    rewards = [p["mean_reward"] for p in ctx.info["reward_curve"]]
    assert len(rewards) == 50 and ctx.outcome.stop_reason == "steps"
    start, end = _mean(rewards[:10]), _mean(rewards[-10:])
    assert end > start + 0.25, f"reward {start:.2f} -> {end:.2f}"
    assert after > before + 0.25, f"held-out {before:.2f} -> {after:.2f}"
    assert (tmp_path / "grpo" / "reward_curve.png").is_file()
    assert (tmp_path / "grpo" / "adapter" / "adapter_model.safetensors").is_file()
    print(f"GRPO: reward {start:.2f} -> {end:.2f}, held-out {before:.2f} -> {after:.2f}, {elapsed:.1f}s")


def test_sft_raises_held_out_accuracy(tiny_local, task, tmp_path):
    teacher = scripted_lm(task.oracle, cache=False)
    program = _program(tiny_local)
    trainset, valset = task.examples(48, seed=3), task.examples(32, seed=4)
    ctx = task.ctx(trainset, valset, run_dir=tmp_path / "finetune", stage_name="finetune")
    stage = BootstrapFinetune(teacher=teacher, epochs=6, learning_rate=1e-2, batch_size=8,
                              lora=LoraSettings(r=8, alpha=16))
    # AutoAdapter: the chat teacher gets DSPy's ChatAdapter, the base-model student the completion adapter.
    with dspy.context(adapter=AutoAdapter()):
        before = ctx.evaluate(program, valset).score
        started = time.monotonic()
        out = stage.run(program, ctx)
        elapsed = time.monotonic() - started
        ctx.evaluator.forget()
        after = ctx.evaluate(out, valset).score
    assert ctx.info["pairs"] == 48 and ctx.outcome.stop_reason == "done"
    assert after >= before + 0.5, f"held-out {before:.2f} -> {after:.2f}"
    assert local_of(out.lm) is tiny_local and out.lm.adapter == "finetune"  # the student, pinned to the adapter
    print(f"SFT: held-out {before:.2f} -> {after:.2f}, {elapsed:.1f}s")
