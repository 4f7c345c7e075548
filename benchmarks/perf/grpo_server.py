"""GRPO with rollouts on an inference server (``flowopt serve --enable-lora``) against in-process rollouts.

Both sides run the whole GRPO stage on the same program (``dspy.Predict`` on the cue -> word task), the
same randomly initialised word-level model, batch, group size, lengths and seed:

- ``local``:  rollouts sampled in this process, in lockstep batches (the default);
- ``server``: rollouts sampled by ``flowopt serve`` in a second process on 127.0.0.1, the adapter pushed
  before every step (save, unload the previous one, load under a fresh name), the server's token ids
  and log-probs trained on. The step time includes the push.

Runs are interleaved over ``--repeats`` rounds; the first step of each run is a warm-up and not timed.
On a CPU the two processes share the cores, so the server path pays HTTP, JSON and the push without
a faster sampler to gain from: this measures its overhead, not the GPU layout it is for (vLLM on its
own GPU). In float32 on both sides the server's log-probs must equal the training forward's (the gap
column), which checks that the server sampled with the weights being trained.

Run: python -m flowopt.benchmarks.perf.grpo_server [--steps 4] [--repeats 3] [--hidden 256 --layers 4]
     python -m flowopt.benchmarks.perf.grpo_server --model gemma-3-270m --batch 2 --group 4 --completion 16 \
         --steps 3 --repeats 2 --out benchmarks/results/grpo_server_gemma
Writes benchmarks/results/grpo_server.{json,md} (``--out STEM``).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from flowopt.benchmarks import cue_word
from flowopt.benchmarks.perf.harness import Goal, PerfParser, interleaved, markdown_table, setup_logging, start_run
from flowopt.lm.serve_process import serve_subprocess

SMOKE = {"steps": 2, "repeats": 1, "hidden": 64, "layers": 2, "batch": 2, "group": 2, "completion": 3}
LABELS = ["Noise:", "Cue:", "Word:", "---", "Given", "fields", "produce", "`noise`,", "`cue`,", "`word`."]


def run_grpo(model_dir: Path | str, args: Any, option: Any) -> dict[str, Any]:
    """One GRPO stage of ``args.steps`` steps; returns its report info."""
    import random

    import dspy

    from flowopt.compiler.budget import BudgetTracker
    from flowopt.compiler.context import StageContext
    from flowopt.lm import AutoAdapter, LocalLM
    from flowopt.optimizers.weights import GRPO, LoraSettings

    local = LocalLM(str(model_dir), device="cpu", dtype="float32", max_new_tokens=args.completion, progress=False)
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = local.lm
    ctx = StageContext(trainset=cue_word.make_examples(32, seed=1), valset=[], metric=cue_word.metric,
                       budget=BudgetTracker(), seed=0, rng=random.Random(0), run_dir=None, stage_name="grpo")
    stage = GRPO(steps=args.steps, batch_size=args.batch, group_size=args.group, max_new_tokens=args.completion,
                 learning_rate=1e-3, beta=0.04, lora=LoraSettings(r=8, alpha=16), rollout_server=option, plot=False)
    try:
        with dspy.context(adapter=AutoAdapter()):
            stage.run(program, ctx)
    finally:
        local.close()
    return dict(ctx.info)


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("grpo_server", __doc__, smoke=SMOKE)
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per run (the first is a warm-up)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="tiny", choices=["tiny", "gemma-3-270m"],
                        help="a random word-level model, or the embedded Gemma 3 270M (base)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion", type=int, default=8, help="max new tokens per LM call")
    run = start_run(parser, argv)
    args = run.args
    import torch

    from flowopt.optimizers.weights import InferenceServer
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    torch.set_num_threads(1)  # the server has one thread too: the two processes share the cores
    with tempfile.TemporaryDirectory(prefix="flowopt-grpo-server-") as tmp:
        root = Path(tmp) / "loras"
        root.mkdir()
        model_dir: Path | str = args.model
        if args.model == "tiny":
            words = [*cue_word.COLORS, *cue_word.ANIMALS, *cue_word.NOISE, *LABELS]
            model, tokenizer = tiny_causal_lm(words, hidden_size=args.hidden, layers=args.layers, seed=0)
            model_dir = Path(tmp) / "model"
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        # One torch thread: the trainer and the server share the cores.
        with serve_subprocess(model_dir, "--dtype", "float32", "--enable-lora", "--lora-root", str(root),
                              "--max-loras", "2", "--log-level", "warning", "--max-batch-size", "64",
                              log=Path(tmp) / "server.log", env={"OMP_NUM_THREADS": "1"}) as base:
            counter = iter(range(10_000))
            option = lambda: InferenceServer(base, adapter_dir=root / f"run{next(counter)}")  # noqa: E731
            runs = interleaved({"local": lambda: run_grpo(model_dir, args, None),
                                "server": lambda: run_grpo(model_dir, args, option())}, args.repeats)
    summary: dict[str, Any] = {}
    for side, infos in runs.items():
        points = [p for info in infos for p in info["reward_curve"][1:]]  # step 1 of each run: warm-up
        summary[side] = {
            "median_step_s": round(statistics.median(p["step_s"] for p in points), 4),
            "median_rollout_s": round(statistics.median(p["rollout_s"] for p in points), 4),
            "median_update_s": round(statistics.median(p["update_s"] for p in points), 4),
            "max_sampler_logprob_gap": max(p["sampler_logprob_gap"] for p in points),
            "mean_reward_per_step": [round(p["mean_reward"], 3) for info in infos for p in info["reward_curve"]],
            "completion_tokens": sum(p["completion_tokens"] for p in points), "timed_steps": len(points),
            "adapters_pushed": sum(len(info.get("served_adapters", [])) for info in infos),
            "median_push_s": round(statistics.median([s for info in infos for s in info.get("push_seconds", [])]
                                                     or [0.0]), 4)}
    ratio = summary["server"]["median_step_s"] / summary["local"]["median_step_s"]
    shape = ({"name": "tiny", "hidden": args.hidden, "layers": args.layers} if args.model == "tiny"
             else {"name": args.model})
    results = {"model": {**shape, "dtype": "float32"},
               "shape": {"batch": args.batch, "group": args.group, "completion": args.completion,
                         "steps": args.steps, "repeats": args.repeats},
               "sides": summary, "server_vs_local_step_time": round(ratio, 3)}
    rows = [[side, s["median_step_s"], s["median_rollout_s"], s["median_push_s"], s["median_update_s"],
             f"{s['max_sampler_logprob_gap']:.2e}", s["timed_steps"], s["adapters_pushed"]]
            for side, s in summary.items()]
    described = (f"Word-level Llama-shaped model (random weights), hidden {args.hidden}, {args.layers} layers"
                 if args.model == "tiny" else "Gemma 3 270M (the embedded base model)")
    body = [f"{described}, float32, one torch thread per process; B={args.batch} x G={args.group}, "
            f"up to {args.completion} new tokens, beta 0.04, LoRA r=8; {args.steps} steps per run (the first untimed), "
            f"{args.repeats} interleaved rounds.", "",
            *markdown_table(["rollouts", "median step s", "rollout s (incl. push)", "push s", "update s",
                             "max sampler log-prob gap", "timed steps", "adapters pushed"], rows, align="lrrrrrrr"),
            "", f"Server step time / local step time: **{ratio:.2f}x** (on one CPU the server path adds HTTP and the "
                "adapter push; its gain is a fast sampler on its own GPU)."]
    goals = [Goal.at_most("server log-prob gap to the training forward (float32)",
                          summary["server"]["max_sampler_logprob_gap"], 1e-4)]
    run.finish("GRPO rollouts through flowopt serve vs in process (CPU)", results, body, goals=goals)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
