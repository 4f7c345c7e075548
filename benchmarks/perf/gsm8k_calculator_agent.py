"""GSM8K calculator agent: GRPO with terminal rewards only against terminal plus intermediate rewards.

The program is one ``ReAct`` node (``question -> answer``) with the ``calculator`` tool; the student is the
embedded Gemma 3 270M (``--model tiny``: a tiny random word model, for a smoke run). Per seed, three
trainings with the same seed, steps and examples:

- ``react-terminal``: GRPO, reward = the GSM8K metric on the final answer;
- ``react-intermediate``: the same plus per-transition tool rewards (``--tool-ok``, ``--tool-error``,
  ``--tool-unknown`` for each call's status, credited to the LM call that chose the tool);
- ``cot-terminal``: the same model without tools (``ChainOfThought``), terminal rewards.

Every program, and both untrained ones, is scored on the same held-out GSM8K test questions (DSPy's
split and metric, greedy decoding); the JSON keeps every per-question score, and the report gives each
score with its 95% interval and the paired changes (intermediate - terminal, react - cot) per seed.

Run:    python -m flowopt.benchmarks.perf.gsm8k_calculator_agent [--steps 20] [--seeds 0 1] [--test 100]
Smoke:  python -m flowopt.benchmarks.perf.gsm8k_calculator_agent --smoke --out /tmp/agent_smoke
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run

logger = logging.getLogger(__name__)
SMOKE = {"model": "tiny", "train": 4, "test": 3, "steps": 1, "batch": 1, "group": 2, "max_steps": 1,
         "max_new_tokens": 4, "seeds": [0], "threads": 1}
ARMS = ("react-terminal", "react-intermediate", "cot-terminal")


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("gsm8k_calculator_agent", __doc__, smoke=SMOKE)
    parser.add_argument("--model", default="gemma-3-270m", help="a LocalLM name or folder, or 'tiny'")
    parser.add_argument("--train", type=int, default=200)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=3, help="ReAct's tool-calling steps")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--tool-ok", type=float, default=0.1)
    parser.add_argument("--tool-error", type=float, default=-0.05)
    parser.add_argument("--tool-unknown", type=float, default=-0.1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    run = start_run(parser, argv)
    args = run.args

    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="gsm8k-agent-") as tmp:
        results = run_all(args, Path(tmp))
    run.finish("GSM8K calculator agent: terminal vs terminal + intermediate rewards, and without tools", results,
               report_body(args, results))
    return 0


def _student(name: str, max_new_tokens: int, folder: Path) -> Any:
    """A fresh LocalLM (no adapter); ``tiny`` is saved to ``folder`` first, so it loads like a checkpoint."""
    from flowopt.lm import LocalLM

    if name == "tiny":
        from flowopt.optimizers.weights.tiny import tiny_causal_lm

        if not (folder / "config.json").is_file():
            model, tokenizer = tiny_causal_lm(["calculator", "finish", *[str(n) for n in range(10)], "+", "*"],
                                              seed=0)
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        name = str(folder)
    return LocalLM(name, max_new_tokens=max_new_tokens, progress=False)


def programs(max_steps: int) -> dict[str, Any]:
    """The two untrained programs: the calculator agent, and the same model without tools."""
    import flowopt
    from flowopt.modules import ChainOfThought, ReAct

    react = flowopt.Workflow("question -> answer", name="calculator-agent").add(
        "solve", ReAct("question -> answer", tools=["calculator"], max_steps=max_steps))
    cot = flowopt.Workflow("question -> answer", name="no-tools").add("solve", ChainOfThought("question -> answer"))
    return {"react": react, "cot": cot}


def stage_for(arm: str, args: Any) -> Any:
    from flowopt.optimizers.weights import GRPO

    tool_rewards = ({"ok": args.tool_ok, "error": args.tool_error, "unknown_tool": args.tool_unknown}
                    if arm == "react-intermediate" else None)
    return GRPO(steps=args.steps, batch_size=args.batch, group_size=args.group, max_new_tokens=args.max_new_tokens,
                learning_rate=args.lr, temperature=1.0, tool_rewards=tool_rewards, checkpoint_every=0, plot=False)


def run_all(args: Any, run_dir: Path) -> dict[str, Any]:
    """Untrained scores, then per seed the three trainings and their held-out scores."""
    import dspy

    from flowopt.benchmarks.datasets import load_split
    from flowopt.benchmarks.metrics import gsm8k_dspy_metric
    from flowopt.compiler.budget import BudgetTracker
    from flowopt.compiler.context import StageContext
    from flowopt.lm import AutoAdapter

    trainset = load_split("gsm8k-dspy", "train", limit=args.train, seed=0)
    testset = load_split("gsm8k-dspy", "test", limit=args.test, seed=0)
    results: dict[str, Any] = {"untrained": {}, "seeds": {}}

    def ctx_for(name: str, seed: int) -> Any:
        return StageContext(trainset=trainset, valset=testset, metric=gsm8k_dspy_metric, budget=BudgetTracker(),
                            seed=seed, rng=random.Random(seed), run_dir=run_dir / name, stage_name=name,
                            num_threads=8)

    def score(program: Any, ctx: Any) -> dict[str, Any]:
        ctx.evaluator.forget()  # its memo keys on prompts, not on the weights behind the LM
        result = ctx.evaluate(program, testset)
        return {"score": result.score, "ci": list(result.ci), "scores": result.scores, "errors": result.errors}

    with dspy.context(adapter=AutoAdapter()):
        for name, program in programs(args.max_steps).items():
            local = _student(args.model, args.max_new_tokens, run_dir / "tiny-model")
            with dspy.context(lm=local.lm.copy(cache=False)):
                results["untrained"][name] = score(program, ctx_for(f"untrained-{name}", 0))
            local.close()
        for seed in args.seeds:
            per_seed: dict[str, Any] = {}
            for arm in ARMS:
                local = _student(args.model, args.max_new_tokens, run_dir / "tiny-model")
                program = programs(args.max_steps)["cot" if arm.startswith("cot") else "react"]
                ctx = ctx_for(f"{arm}-{seed}", seed)
                began = time.perf_counter()
                with dspy.context(lm=local.lm.copy(cache=False)):  # the stage trains the LM the program runs on
                    trained = stage_for(arm, args).run(program, ctx)
                keys = ("step", "mean_reward", "mean_score", "format_failures", "tool_calls", "intermediate_reward",
                        "step_s")
                per_seed[arm] = {"train_s": round(time.perf_counter() - began, 1),
                                 "curve": [{k: p.get(k) for k in keys} for p in ctx.info["reward_curve"]],
                                 **score(trained, ctx)}
                logger.info("seed %d %s: held-out %.3f", seed, arm, per_seed[arm]["score"])
                local.close()
            results["seeds"][str(seed)] = per_seed
    return results


def report_body(args: Any, results: dict[str, Any]) -> list[str]:
    from flowopt.benchmarks.scoring import paired_change

    def cell(row: dict[str, Any]) -> str:
        return f"{row['score']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]"

    def change(after: dict[str, Any], before: dict[str, Any]) -> str:
        c = paired_change(before, after)
        return f"{c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]"

    rows = [[f"untrained {name}", "-", cell(row), "-"] for name, row in results["untrained"].items()]
    for seed, arms in results["seeds"].items():
        for arm, row in arms.items():
            paired = change(row, arms["react-terminal"]) if arm != "react-terminal" else "-"
            rows.append([arm, seed, cell(row), paired])
    return [f"Student: {args.model}; {args.train} GSM8K training questions, {args.test} held-out test questions "
            f"(DSPy's split and metric); GRPO {args.steps} steps, B={args.batch} x G={args.group}, lr {args.lr:g}, "
            f"ReAct max_steps {args.max_steps}, {args.max_new_tokens} new tokens a call; tool rewards ok "
            f"{args.tool_ok:g}, error {args.tool_error:g}, unknown tool {args.tool_unknown:g}.", "",
            *markdown_table(["program", "seed", "held-out score [95% CI]", "paired vs react-terminal [95% CI]"],
                            rows, align="llrr")]


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
