"""Out of memory in a weights stage, in process: the stage stops with OutOfMemoryError naming the settings
to lower, keeps what it finished, and a resumed run with a smaller micro-batch completes.

The allocation failure is a real one from torch's CPU allocator (a 32 TiB tensor, asked for while a
micro-batch larger than one trains), so the stage meets what a too-large batch meets; the same behaviour
under a real address-space limit runs in ``tests/faults/test_out_of_memory.py`` (slow suite).
"""

from __future__ import annotations

import dspy
import pytest
import torch

import flowopt
from flowopt.errors import OutOfMemoryError
from flowopt.lm import AutoAdapter
from flowopt.modules import Predict
from flowopt.optimizers.weights import GRPO, BootstrapFinetune, LoraSettings

LORA = LoraSettings(r=4, alpha=8)


def _allocate_too_much() -> None:
    torch.empty(1 << 45, dtype=torch.uint8)  # RuntimeError: DefaultCPUAllocator: can't allocate memory


def test_grpo_out_of_memory_names_the_settings_keeps_its_checkpoint_and_resumes(make_tiny_local, task, tmp_path,
                                                                               monkeypatch):
    from flowopt.optimizers.weights import learner as learner_module

    trainset = task.examples(16, seed=8)
    run_dir = tmp_path / "grpo"
    original = learner_module.GRPOLearner.update
    updates: list[int] = []

    def update(self, items):  # the second step's update does not fit while micro-batches hold 4 rollouts
        updates.append(self.micro)
        if self.micro > 1 and len(updates) == 2:
            _allocate_too_much()
        return original(self, items)

    def run(micro: int) -> dict:
        program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
        program.lm = make_tiny_local().lm
        ctx = task.ctx(trainset, [], run_dir=run_dir, resume=True)
        stage = GRPO(steps=3, batch_size=2, group_size=4, max_new_tokens=2, learning_rate=1e-2, checkpoint_every=1,
                     micro_batch_size=micro, lora=LORA)
        with dspy.context(adapter=AutoAdapter()):
            stage.run(program, ctx)
        return ctx.info

    monkeypatch.setattr(learner_module.GRPOLearner, "update", update)
    with pytest.raises(OutOfMemoryError) as caught:
        run(micro=4)
    message = str(caught.value)
    assert message.startswith("grpo (step 2) ran out of memory (") and "can't allocate memory" in message
    assert "the checkpoint after 1 steps is intact" in message
    assert "micro_batch_size=4 -> 2" in message and "gradient_checkpointing=True" in message
    assert "batch_size (now 2)" in message and "group_size (now 4)" in message and "max_new_tokens (now 2)" in message
    assert caught.value.settings == {"micro_batch_size": 4, "micro_batch_tokens": None, "gradient_checkpointing": False,
                                     "batch_size": 2, "group_size": 4, "max_new_tokens": 2}
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1"]  # the last good one, whole
    assert (run_dir / "checkpoint-1" / "learner.pt").is_file()
    assert (run_dir / "checkpoint-1" / "adapter" / "adapter_model.safetensors").is_file()

    resumed = run(micro=1)
    assert updates == [4, 4, 1, 1]  # the resumed run continued at step 2: step 1 was not trained again
    assert [p["step"] for p in resumed["reward_curve"]] == [1, 2, 3] and resumed["steps_done"] == 3


def test_finetune_out_of_memory_keeps_the_baseline_and_resumes_with_a_smaller_micro_batch(tiny_saved_local, task,
                                                                                         tmp_path, monkeypatch):
    from flowopt.optimizers.weights import sft

    run_dir = tmp_path / "run"
    original = sft.sft_train
    trained_with: list[int] = []

    def sft_train(*args, micro_batch_size, **kwargs):
        trained_with.append(micro_batch_size)
        if micro_batch_size > 1:
            _allocate_too_much()
        return original(*args, micro_batch_size=micro_batch_size, **kwargs)

    monkeypatch.setattr(sft, "sft_train", sft_train)
    wf = flowopt.Workflow("noise, cue -> word", name="cue-word")
    wf.add("solve", Predict(dspy.Signature("noise, cue -> word", "Answer.")), lm="default")
    wf.lms["default"] = tiny_saved_local.lm.copy(cache=False)
    trainset, valset = task.examples(8, seed=1), task.examples(2, seed=2)

    def compile_with(micro: int, resume: bool) -> flowopt.Workflow:
        stage = BootstrapFinetune(labels="only", epochs=1, batch_size=8, micro_batch_size=micro,
                                  micro_batch_tokens=None, max_length=256, lora=LORA)
        with dspy.context(adapter=AutoAdapter()):
            return flowopt.compile(wf, trainset, task.metric, valset=valset, stages=[stage], run_dir=run_dir,
                                   resume=resume, quiet=True, num_threads=1)

    with pytest.raises(OutOfMemoryError) as caught:
        compile_with(8, resume=False)
    message = str(caught.value)
    assert message.startswith("finetune ran out of memory") and "micro_batch_size=8 -> 4" in message
    assert "gradient_checkpointing=True" in message and "batch_size (now 8)" in message
    assert "max_length (now 256)" in message
    assert caught.value.settings == {"micro_batch_size": 8, "micro_batch_tokens": None,
                                     "gradient_checkpointing": False, "batch_size": 8, "max_length": 256}
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()) == ["compile.json"]

    best = compile_with(1, resume=True)
    rows = {row.name: row.to_dict() for row in best.report.stages}
    assert trained_with == [8, 1]
    assert rows["baseline"]["resumed"]  # the resumed run kept the baseline instead of scoring it again
    assert rows["finetune"]["stop_reason"] == "done"
    assert (run_dir / "stages" / "00-finetune" / "adapter" / "adapter_config.json").is_file()


def test_a_cuda_out_of_memory_error_becomes_the_same_flowopt_error():
    """What CUDA's caching allocator raises (``torch.cuda.OutOfMemoryError``, CUDA's own wording) is mapped
    like a CPU allocator failure; ``benchmarks/perf/cuda_oom_check.py`` forces a real one on a GPU."""
    from flowopt.optimizers.weights.memory import out_of_memory_errors

    cuda_error = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB")
    guard = out_of_memory_errors("finetune", {"micro_batch_size": 8, "gradient_checkpointing": True},
                                 {"batch_size": 16}, resume_note="nothing is lost")
    with pytest.raises(OutOfMemoryError) as caught, guard:
        raise cuda_error
    message = str(caught.value)
    assert message.startswith("finetune ran out of memory (CUDA out of memory. Tried to allocate 20.00 GiB")
    assert "micro_batch_size=8 -> 4" in message and "batch_size (now 16)" in message
    assert "gradient_checkpointing=True" not in message  # already on: not offered again
    assert caught.value.__cause__ is cuda_error
