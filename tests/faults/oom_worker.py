"""Subprocess for test_out_of_memory: a weights stage whose batch does not fit under an address-space limit.

Usage: python oom_worker.py RUN_DIR OUT_JSON [finetune|grpo]

The worker builds a small random model on the cue -> word task with long inputs, then caps its own
address space (RLIMIT_AS) a little above what it uses when training starts (GRPO: when its second
step's update starts, after the first step was checkpointed): a micro-batch of 12 long sequences does
not fit, one does. It compiles with ``micro_batch_size=12`` (which must stop with OutOfMemoryError),
then resumes the same run folder with ``micro_batch_size=1`` under the same cap.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "optimizers" / "weights"))

HEADROOM = 500 * 2**20  # bytes of address space above what the process holds when training starts


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


# GRPO trains this bf16 model (on a CPU with bf16 compute) under autocast, so its step holds less than the finetune's.
GRPO_HEADROOM = 250 * 2**20


def _cap(headroom: int = HEADROOM) -> None:
    """Cap the address space a little above what the process holds now (once)."""
    if resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + headroom, resource.RLIM_INFINITY))


def main() -> None:
    run_dir, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    stage_kind = sys.argv[3] if len(sys.argv) > 3 else "finetune"
    import dspy
    import torch
    from conftest import WORDS

    import flowopt
    from flowopt.benchmarks import cue_word
    from flowopt.errors import OutOfMemoryError
    from flowopt.lm import AutoAdapter
    from flowopt.lm.local import LocalLM
    from flowopt.modules import Predict
    from flowopt.optimizers.weights import GRPO, BootstrapFinetune, LoraSettings, learner, sft
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    torch.set_num_threads(1)
    model, tokenizer = tiny_causal_lm(WORDS, hidden_size=256, layers=2, seed=0)
    model.save_pretrained(run_dir.parent / "model")  # a run folder's program.json names its model's folder
    tokenizer.save_pretrained(run_dir.parent / "model")
    local = LocalLM(str(run_dir.parent / "model"), name="tiny", device="cpu", max_new_tokens=2, progress=False)
    long_noise = " ".join(cue_word.NOISE * 180)  # about 1,500 tokens a prompt
    trainset = [ex.copy(noise=long_noise) for ex in cue_word.make_examples(12, seed=1)]
    valset = [ex.copy(noise=long_noise) for ex in cue_word.make_examples(2, seed=2)]

    train, update = sft.sft_train, learner.GRPOLearner.update
    updates: list[int] = []

    def capped_train(*args, **kwargs):  # the cap lands when training starts, above what scoring needed
        _cap()
        return train(*args, **kwargs)

    def capped_update(self, items):  # GRPO: the cap lands at the second step's update
        updates.append(self.micro)
        if len(updates) == 2:
            _cap(GRPO_HEADROOM)
        return update(self, items)

    sft.sft_train = capped_train
    learner.GRPOLearner.update = capped_update

    wf = flowopt.Workflow("noise, cue -> word", name="cue-word")
    wf.add("solve", Predict(dspy.Signature("noise, cue -> word", "Answer.")), lm="default")
    wf.lms["default"] = local.lm.copy(cache=False)
    lora = LoraSettings(r=4, alpha=8)
    seen: dict = {}

    def metric(example, prediction, trace=None):  # GRPO: rewards that differ within a group, so it trains
        if stage_kind == "finetune":
            return cue_word.metric(example, prediction, trace)
        return len(str(getattr(prediction, "word", ""))) / 10

    def compile_with(micro: int, resume: bool) -> flowopt.Workflow:
        # No token bound: the micro-batch size alone decides what one forward pass holds.
        stage = (BootstrapFinetune(labels="only", epochs=1, batch_size=12, micro_batch_size=micro,
                                   micro_batch_tokens=None, max_length=2048, lora=lora)
                 if stage_kind == "finetune" else
                 GRPO(steps=2, batch_size=3, group_size=4, max_new_tokens=2, micro_batch_size=micro,
                      checkpoint_every=1, lora=lora))
        with dspy.context(adapter=AutoAdapter()):
            return flowopt.compile(wf, trainset, metric, valset=valset, stages=[stage], run_dir=run_dir,
                                   resume=resume, quiet=True, num_threads=1)

    try:
        compile_with(12, resume=False)
        seen["error"] = None
    except OutOfMemoryError as err:
        seen["error"] = {"message": str(err), "settings": err.settings}
    seen["files_after_error"] = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    best = compile_with(1, resume=True)
    rows = {row.name: row.to_dict() for row in best.report.stages}
    name = "finetune" if stage_kind == "finetune" else "grpo"
    adapter = run_dir / "stages" / f"00-{name}" / "adapter" / "adapter_config.json"
    seen["resumed"] = {"baseline_resumed": rows["baseline"]["resumed"], name: rows[name],
                       "adapter_saved": adapter.is_file(), "updates": updates}
    out_path.write_text(json.dumps(seen, default=str))


if __name__ == "__main__":
    main()
