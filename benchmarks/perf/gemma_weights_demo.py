"""Real weights: the embedded Gemma 3 270M (base) learns a task it starts low on, BootstrapFinetune then GRPO.

The task is a fixed, arbitrary code book: each colour stands for one animal ("red" -> "cat", ...). The
program is one ``dspy.Predict`` whose instructions list the eight animals, so a base model answers with
one of them but cannot know which: it starts near chance (1/8). The teacher is a scripted oracle
(standing in for a large LM), so BootstrapFinetune sees only traces that pass the metric. Held-out
examples pair the colours with unseen noise words. The completion adapter (LocalLM's choice for base
models) formats every prompt.

Run:    python benchmarks/perf/gemma_weights_demo.py [--grpo-steps 12] [--threads 2]
Writes benchmarks/results/gemma_weights_demo.{json,md}: held-out accuracy before, after BootstrapFinetune
and after GRPO, and the wall time of each stage on this machine.
"""

from __future__ import annotations

import argparse
import logging
import platform
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
COLORS = ["red", "blue", "green", "black", "white", "pink", "gold", "gray"]
ANIMALS = ["cat", "dog", "cow", "pig", "owl", "fox", "bee", "ant"]
NOISE = ["sun", "moon", "star", "tree", "rock", "lake", "hill", "road", "milk", "salt", "rain", "sand"]
INSTRUCTIONS = ("Each colour is the code name of one animal. Answer with the animal only, one of: "
                + ", ".join(ANIMALS) + ".")


def make_examples(n: int, seed: int) -> list[Any]:
    import dspy

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randrange(len(COLORS))
        out.append(dspy.Example(noise=" ".join(rng.sample(NOISE, 2)), cue=COLORS[k], word=ANIMALS[k])
                   .with_inputs("noise", "cue"))
    return out


def metric(example: Any, prediction: Any, trace: Any = None) -> float:
    words = str(getattr(prediction, "word", "") or "").replace(".", " ").replace(",", " ").split()
    return float(bool(words) and words[0].lower() == example.word)


def oracle(request: Any) -> dict[str, str]:
    return {"word": ANIMALS[COLORS.index(request.inputs["cue"])]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--out-name", default="gemma_weights_demo")
    args = parser.parse_args(argv)

    import dspy
    import torch

    from flowopt.compiler.budget import BudgetTracker
    from flowopt.compiler.context import StageContext
    from flowopt.io import atomic_write_json, atomic_write_text
    from flowopt.lm import AutoAdapter, LocalLM
    from flowopt.optimizers.weights import GRPO, BootstrapFinetune, LoraSettings
    from flowopt.testing import scripted_lm

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("dspy", "LiteLLM", "httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    log = logging.getLogger("gemma_demo")

    t0 = time.perf_counter()
    local = LocalLM("gemma-3-270m", max_new_tokens=8, progress=False)
    load_s = time.perf_counter() - t0
    program = dspy.Predict(dspy.Signature("noise, cue -> word", INSTRUCTIONS))
    program.lm = local.lm.copy(cache=False)  # measured wall times, not answers from an earlier run's cache
    trainset, heldout = make_examples(args.train, seed=1), make_examples(args.heldout, seed=2)
    run_dir = Path(tempfile.mkdtemp(prefix="gemma-demo-"))

    def ctx_for(stage: str) -> Any:
        return StageContext(trainset=trainset, valset=heldout, metric=metric, budget=BudgetTracker(), seed=0,
                            rng=random.Random(0), run_dir=run_dir / stage, stage_name=stage, num_threads=8)

    def evaluate(prog: Any, ctx: Any) -> float:
        ctx.evaluator.forget()  # its memo keys on prompts, not on the weights behind the LM
        return ctx.evaluate(prog, heldout).score

    results: dict[str, Any] = {"load_s": round(load_s, 1)}
    with dspy.context(adapter=AutoAdapter()):
        ctx = ctx_for("finetune")
        t0 = time.perf_counter()
        results["base_heldout"] = evaluate(program, ctx)
        results["eval_s"] = round(time.perf_counter() - t0, 1)
        log.info("base model: held-out %.3f", results["base_heldout"])

        teacher = scripted_lm(oracle, cache=False)
        sft = BootstrapFinetune(teacher=teacher, epochs=args.sft_epochs, learning_rate=args.sft_lr, batch_size=8,
                                lora=LoraSettings(r=16, alpha=32))
        t0 = time.perf_counter()
        tuned = sft.run(program, ctx)
        results["sft_s"] = round(time.perf_counter() - t0, 1)
        results["sft_info"] = {k: v for k, v in ctx.info.items() if k not in ("adapter", "adapter_sha256")}
        results["sft_heldout"] = evaluate(tuned, ctx)
        log.info("after BootstrapFinetune: held-out %.3f (%.0fs)", results["sft_heldout"], results["sft_s"])

        ctx = ctx_for("grpo")
        grpo = GRPO(steps=args.grpo_steps, batch_size=args.batch, group_size=args.group, max_new_tokens=6,
                    learning_rate=args.grpo_lr, temperature=1.0, beta=args.grpo_beta, checkpoint_every=0)
        t0 = time.perf_counter()
        trained = grpo.run(tuned, ctx)
        results["grpo_s"] = round(time.perf_counter() - t0, 1)
        keys = ("step", "mean_reward", "mean_score", "format_failures", "kl", "rollout_s", "update_s", "step_s")
        results["grpo_curve"] = [{k: p[k] for k in keys} for p in ctx.info["reward_curve"]]
        results["grpo_heldout"] = evaluate(trained, ctx)
        log.info("after GRPO: held-out %.3f (%.0fs)", results["grpo_heldout"], results["grpo_s"])
        plot = run_dir / "grpo" / "reward_curve.png"

    RESULTS.mkdir(parents=True, exist_ok=True)
    if plot.is_file():
        (RESULTS / f"{args.out_name}_reward_curve.png").write_bytes(plot.read_bytes())
    command = "python benchmarks/perf/gemma_weights_demo.py " + " ".join(sys.argv[1:])
    payload = {"command": command.strip(), "settings": vars(args),
               "machine": f"{platform.platform()}, {platform.machine()}, python {platform.python_version()}, "
                          f"torch threads {args.threads}, device {local.device}, dtype {local.dtype}",
               "results": results}
    atomic_write_json(RESULTS / f"{args.out_name}.json", payload)
    curve = results["grpo_curve"]
    lines = [
        "# Gemma 3 270M: BootstrapFinetune then GRPO on a task it starts low on", "",
        f"Command: `{payload['command']}`  ",
        f"Machine: {payload['machine']}  ",
        f"Task: colour code -> animal (8 pairs, chance 1/8); {args.train} training examples, {args.heldout} held-out "
        "examples (unseen noise words); metric: first word of the answer equals the animal; greedy decoding for "
        "held-out accuracy; completion adapter.", "",
        "| stage | held-out accuracy | wall time (s) |",
        "|---|---:|---:|",
        f"| base model (no training) | {results['base_heldout']:.3f} | eval {results['eval_s']} |",
        f"| + BootstrapFinetune (LoRA r=16, {args.sft_epochs} epochs, {results['sft_info'].get('pairs')} pairs) | "
        f"{results['sft_heldout']:.3f} | {results['sft_s']} |",
        f"| + GRPO ({args.grpo_steps} steps, B={args.batch} x G={args.group}, lr {args.grpo_lr:g}, "
        f"beta {args.grpo_beta:g}) | "
        f"{results['grpo_heldout']:.3f} | {results['grpo_s']} |", "",
        f"Model load: {results['load_s']} s. GRPO mean reward per step: "
        + ", ".join(f"{p['mean_reward']:.2f}" for p in curve) + ".",
    ]
    if plot.is_file():
        lines += ["", f"![GRPO reward curve]({args.out_name}_reward_curve.png)"]
    atomic_write_text(RESULTS / f"{args.out_name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    local.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
