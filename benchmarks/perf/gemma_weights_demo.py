"""Real weights: the embedded Gemma 3 270M (base) learns a task it starts low on, BootstrapFinetune then GRPO.

The task is the cue -> word code book of :mod:`flowopt.benchmarks.cue_word`: each colour stands for
one animal ("red" -> "cat", ...). The program is one ``dspy.Predict`` whose instructions list the eight
animals, so a base model answers with one of them but cannot know which: it starts near chance (1/8).
The teacher is a scripted oracle (standing in for a large LM), so BootstrapFinetune sees only traces
that pass the metric. Training and held-out examples are drawn with different seeds from twelve noise
words. The completion adapter (LocalLM's choice for base models) formats every prompt.

Run:    python -m flowopt.benchmarks.perf.gemma_weights_demo [--grpo-steps 12] [--threads 2]
Writes benchmarks/results/gemma_weights_demo.{json,md} and ``_reward_curve.png`` (``--out STEM``):
held-out accuracy before, after BootstrapFinetune and after GRPO, and the wall time of each stage.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from flowopt.benchmarks import cue_word
from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run
from flowopt.io import atomic_write_bytes

logger = logging.getLogger(__name__)
SMOKE = {"train": 4, "heldout": 4, "sft_epochs": 1, "grpo_steps": 1, "batch": 2, "group": 2, "threads": 1}
NOISE = cue_word.NOISE + cue_word.MORE_NOISE


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("gemma_weights_demo", __doc__, smoke=SMOKE)
    parser.add_argument("--train", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=48)
    parser.add_argument("--sft-epochs", type=int, default=3)
    parser.add_argument("--sft-lr", type=float, default=3e-4)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--grpo-lr", type=float, default=1e-4)
    parser.add_argument("--grpo-beta", type=float, default=0.04, help="KL weight (reference: the SFT adapter)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    run = start_run(parser, argv)
    args = run.args

    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="gemma-demo-") as tmp:
        results = train_and_evaluate(args, Path(tmp))
        plot = Path(tmp) / "grpo" / "reward_curve.png"
        figure = run.sibling("_reward_curve.png") if plot.is_file() else None
        if figure is not None:
            atomic_write_bytes(figure, plot.read_bytes())

    curve = results["grpo_curve"]
    rows = [["base model (no training)", f"{results['base_heldout']:.3f}", f"eval {results['eval_s']}"],
            [f"+ BootstrapFinetune (LoRA r=16, {args.sft_epochs} epochs, {results['sft_info'].get('pairs')} pairs)",
             f"{results['sft_heldout']:.3f}", results["sft_s"]],
            [f"+ GRPO ({args.grpo_steps} steps, B={args.batch} x G={args.group}, lr {args.grpo_lr:g}, "
             f"beta {args.grpo_beta:g})", f"{results['grpo_heldout']:.3f}", results["grpo_s"]]]
    body = [
        f"Model: gemma-3-270m on {results['device']} {results['dtype']}, {args.threads} torch threads. "
        f"Task: colour code -> animal (8 pairs, chance 1/8); {args.train} training examples, {args.heldout} "
        "held-out examples (drawn with another seed); metric: first word of the answer equals the animal "
        "(case and full stops ignored); greedy decoding for held-out accuracy; completion adapter.", "",
        *markdown_table(["stage", "held-out accuracy", "wall time (s)"], rows, align="lrr"), "",
        f"Model load: {results['load_s']} s. GRPO mean reward per step: "
        + ", ".join(f"{p['mean_reward']:.2f}" for p in curve) + ".",
    ]
    if figure is not None:
        body += ["", f"![GRPO reward curve]({figure.name})"]
    run.finish("Gemma 3 270M: BootstrapFinetune then GRPO on a task it starts low on", results, body)
    return 0


def train_and_evaluate(args: Any, run_dir: Path) -> dict[str, Any]:
    """Held-out accuracy of the base model, after BootstrapFinetune and after GRPO, with each stage's time."""
    import dspy

    from flowopt.compiler.budget import BudgetTracker
    from flowopt.compiler.context import StageContext
    from flowopt.lm import AutoAdapter, LocalLM
    from flowopt.optimizers.weights import GRPO, BootstrapFinetune, LoraSettings
    from flowopt.testing import scripted_lm

    t0 = time.perf_counter()
    local = LocalLM("gemma-3-270m", max_new_tokens=8, progress=False)
    results: dict[str, Any] = {"load_s": round(time.perf_counter() - t0, 1), "device": str(local.device),
                               "dtype": str(local.dtype).replace("torch.", "")}
    program = dspy.Predict(dspy.Signature("noise, cue -> word", cue_word.INSTRUCTIONS))
    program.lm = local.lm.copy(cache=False)  # measured wall times, not answers from an earlier run's cache
    trainset = cue_word.make_examples(args.train, seed=1, noise=NOISE)
    heldout = cue_word.make_examples(args.heldout, seed=2, noise=NOISE)

    def ctx_for(stage: str) -> Any:
        return StageContext(trainset=trainset, valset=heldout, metric=cue_word.loose_metric, budget=BudgetTracker(),
                            seed=0, rng=random.Random(0), run_dir=run_dir / stage, stage_name=stage, num_threads=8)

    def evaluate(prog: Any, ctx: Any) -> float:
        ctx.evaluator.forget()  # its memo keys on prompts, not on the weights behind the LM
        return ctx.evaluate(prog, heldout).score

    with dspy.context(adapter=AutoAdapter()):
        ctx = ctx_for("finetune")
        t0 = time.perf_counter()
        results["base_heldout"] = evaluate(program, ctx)
        results["eval_s"] = round(time.perf_counter() - t0, 1)
        logger.info("base model: held-out %.3f", results["base_heldout"])

        teacher = scripted_lm(cue_word.oracle, cache=False)
        sft = BootstrapFinetune(teacher=teacher, epochs=args.sft_epochs, learning_rate=args.sft_lr, batch_size=8,
                                lora=LoraSettings(r=16, alpha=32))
        t0 = time.perf_counter()
        tuned = sft.run(program, ctx)
        results["sft_s"] = round(time.perf_counter() - t0, 1)
        results["sft_info"] = {k: v for k, v in ctx.info.items() if k not in ("adapter", "adapter_sha256")}
        results["sft_heldout"] = evaluate(tuned, ctx)
        logger.info("after BootstrapFinetune: held-out %.3f (%.0fs)", results["sft_heldout"], results["sft_s"])

        ctx = ctx_for("grpo")
        grpo = GRPO(steps=args.grpo_steps, batch_size=args.batch, group_size=args.group, max_new_tokens=6,
                    learning_rate=args.grpo_lr, temperature=1.0, beta=args.grpo_beta, checkpoint_every=0)
        t0 = time.perf_counter()
        trained = grpo.run(tuned, ctx)
        results["grpo_s"] = round(time.perf_counter() - t0, 1)
        keys = ("step", "mean_reward", "mean_score", "format_failures", "kl", "rollout_s", "update_s", "step_s")
        results["grpo_curve"] = [{k: p[k] for k in keys} for p in ctx.info["reward_curve"]]
        results["grpo_heldout"] = evaluate(trained, ctx)
        logger.info("after GRPO: held-out %.3f (%.0fs)", results["grpo_heldout"], results["grpo_s"])
    local.close()
    return results


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
