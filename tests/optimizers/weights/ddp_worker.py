"""One process of the multi-process weights tests, and the one-process reference they compare with.

``torchrun --nproc_per_node 2 ddp_worker.py sft grpo OUT`` (either or both, in turn; the test starts the
processes itself with the same environment) trains the tiny random model
with BootstrapFinetune (gold labels, no teacher) or GRPO on N processes; :func:`run` does the same in
the calling process. The adapter lands in ``OUT/<kind>/adapter``; rank 0 writes ``OUT/<kind>.json``
(the stage's report entry and how many rollout batches each phase sampled).

GRPO samples through a stand-in for ``run_rollouts`` whose completions depend only on the example
and the rollout's place in the step's batch (``rank * share + position``), so the one-process run and
the N-process run train on the same rollouts and their adapters must agree. It is run in two phases
(2 steps, then ``resume=True`` to 3), so resuming on N processes is part of what is compared.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import dspy

from flowopt.benchmarks import cue_word

LABELS = ["Noise:", "Cue:", "Word:", "---", "Given", "fields", "produce", "`noise`,", "`cue`,", "`word`."]
WORDS = [*cue_word.COLORS, *cue_word.ANIMALS, *cue_word.NOISE, *LABELS]
SFT = {"labels": "only", "epochs": 2, "batch_size": 4, "micro_batch_size": 1, "learning_rate": 1e-3}
GRPO = {"batch_size": 3, "group_size": 2, "micro_batch_size": 2, "passes": 2, "beta": 0.04, "aggregation": "grpo",
        "learning_rate": 1e-3, "checkpoint_every": 1, "plot": False}


def _local() -> Any:
    from flowopt.lm.local import LocalLM
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm(WORDS, seed=0)
    return LocalLM.from_model(model, tokenizer, name="tiny", max_new_tokens=4)


def _ctx(trainset: list[Any], run_dir: Path, *, stage_name: str, resume: bool = False) -> Any:
    from flowopt.compiler.budget import BudgetTracker
    from flowopt.compiler.context import StageContext

    return StageContext(trainset=trainset, valset=[], metric=cue_word.metric, budget=BudgetTracker(), seed=0,
                        rng=random.Random(0), run_dir=run_dir, resume=resume, num_threads=2, stage_name=stage_name)


def _program(local: Any) -> dspy.Module:
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = local.lm
    return program


class FakeRollouts:
    """Stands in for ``run_rollouts``: deterministic rollouts, one or two LM calls each, some right."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, program: Any, examples: list[Any], group_size: int, policy: Any, **_: Any) -> list[Any]:
        import torch.distributed as dist

        from flowopt.optimizers.weights.rollout import Rollout, Transition

        self.calls += 1
        n = len(examples) * group_size
        offset = dist.get_rank() * n if dist.is_initialized() else 0  # equal contiguous shares
        rollouts = []
        for j in range(n):
            example = examples[j // group_size]
            rng = random.Random(f"{example.noise}:{example.cue}:{offset + j}")
            word = rng.choice([example.word, *cue_word.ANIMALS[:3]])
            prompt = policy.render([{"role": "user", "content": f"noise : {example.noise} cue : {example.cue} word :"}])
            calls = [word] if rng.random() < 0.6 else [f"{example.cue} {rng.choice(cue_word.NOISE)}", word]
            transitions = [Transition(prompt, policy.completion_ids(text), [0.0], text, "stop") for text in calls]
            rollouts.append(Rollout(j // group_size, j % group_size, example, prediction=dspy.Prediction(word=word),
                                    transitions=transitions))
        return rollouts


def _launched_compile(folder: Path, lora: Any) -> dict[str, Any]:
    """SFT through ``flowopt.compile`` with a run folder (rank 0 writes it), then the same compile resumed."""
    import flowopt
    from flowopt.lm.local import LocalLM
    from flowopt.modules import Predict
    from flowopt.optimizers.weights import BootstrapFinetune
    from flowopt.optimizers.weights.distributed import current_world
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    world = current_world()
    if world.is_main:  # a model on disk, so the run folder can name the workflow's LM
        model, tokenizer = tiny_causal_lm(WORDS, seed=0)
        model.save_pretrained(folder / "model")
        tokenizer.save_pretrained(folder / "model")
    world.barrier()
    local = LocalLM(str(folder / "model"), name="tiny", device="cpu", dtype="float32", max_new_tokens=4,
                    progress=False)
    wf = flowopt.Workflow("noise, cue -> word", name="cue-word")
    wf.add("solve", Predict(dspy.Signature("noise, cue -> word", "Answer.")), lm="default")
    wf.lms["default"] = local.lm
    train, val = cue_word.make_examples(8, seed=5), cue_word.make_examples(4, seed=6)
    rows = []
    try:
        for again in (False, True):
            best = flowopt.compile(wf, train, cue_word.metric, valset=val, quiet=True, run_dir=folder / "run",
                                   stages=[BootstrapFinetune(lora=lora, **{**SFT, "epochs": 1})], resume=again,
                                   num_threads=2)
            rows.append(best.report.stages[-1].to_dict())
            world.barrier()  # as between two launches: rank 0 has written the run folder
    finally:
        local.close()
    return {"resumed": [row.get("resumed", False) for row in rows], "info": rows[0]["info"]}


def run(kind: str, out: Path, *, resume: bool = True) -> dict[str, Any]:
    """Train ``kind`` ("sft", "grpo" or "compile": SFT through ``flowopt.compile``) in this process (one
    of N when launched); returns what it recorded.

    GRPO runs 2 steps then resumes to 3 (``resume=False``: 3 steps at once).
    """
    from flowopt.lm.completion_adapter import AutoAdapter
    from flowopt.optimizers.weights import GRPO as GRPOStage
    from flowopt.optimizers.weights import BootstrapFinetune, LoraSettings

    lora = LoraSettings(r=4, alpha=8)
    local = _local()
    try:
        with dspy.context(adapter=AutoAdapter()):
            if kind == "sft":
                ctx = _ctx(cue_word.make_examples(9, seed=5), out / kind, stage_name="finetune")
                BootstrapFinetune(lora=lora, **SFT).run(_program(local), ctx)
                return {"info": ctx.info}
            if kind == "compile":
                return _launched_compile(out / kind, lora)
            fake = FakeRollouts()
            trainset = cue_word.make_examples(12, seed=7)
            calls = []
            with mock.patch("flowopt.optimizers.weights.grpo.run_rollouts", fake):
                for steps, again in ((2, False), (3, True)) if resume else ((3, False),):
                    ctx = _ctx(trainset, out / kind, stage_name="grpo", resume=again)
                    GRPOStage(steps=steps, lora=lora, **GRPO).run(_program(local), ctx)
                    calls.append(fake.calls)
            return {"info": ctx.info, "rollout_calls": calls}
    finally:
        local.close()


if __name__ == "__main__":
    import torch

    from flowopt.optimizers.weights.distributed import current_world

    torch.set_num_threads(1)
    folder = Path(sys.argv[-1])
    world = current_world()
    for kind in sys.argv[1:-1]:
        result = run(kind, folder)
        if world.is_main:
            (folder / f"{kind}.json").write_text(json.dumps({**result, "processes": world.size}, default=str))
