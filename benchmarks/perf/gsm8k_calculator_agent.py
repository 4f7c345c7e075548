"""GSM8K calculator agent: GRPO with terminal rewards only against terminal plus intermediate rewards.

The program is one ``ReAct`` node (``question -> answer``) with the ``calculator`` tool; the student is the
embedded Gemma 3 270M (``--model tiny``: a tiny random word model, for a smoke run). Per seed, three
trainings with the same seed, steps and examples:

- ``react-terminal``: GRPO, reward = the GSM8K metric on the final answer;
- ``react-intermediate``: the same plus per-transition tool rewards (``--tool-ok``, ``--tool-error``,
  ``--tool-unknown`` for each call's status, credited to the LM call that chose the tool);
- ``cot-terminal``: the same model without tools (``ChainOfThought``), terminal rewards.

Every program, and both untrained ones, is scored on the same held-out GSM8K test questions (DSPy's
split and metric, greedy decoding); the JSON keeps every per-question score and the held-out tool calls
by status, and the report gives each score with its 95% interval and the paired changes (intermediate -
terminal, react - cot) per seed and pooled over seeds.

The agent's units run first (untrained, then per seed terminal and intermediate), the no-tools baseline's
after them (:func:`schedule`). The results files are rewritten after every scored unit (``results.status``
says ``running``, ``complete`` or why it stopped; ``results.not_run`` lists what did not run), so a run
killed from outside keeps what finished. ``--max-seconds`` is a time budget for the whole run: a training
is not started when the time its kind took before (training and scoring) no longer fits, a training stops
between GRPO steps when only its scoring's time is left (``steps_done`` then says how far it got), and a
scoring that would run past the budget stops and is reported as not run.

Run (CPU):  python -m flowopt.benchmarks.perf.gsm8k_calculator_agent [--steps 20] [--seeds 0 1] [--test 100]
Smoke:      python -m flowopt.benchmarks.perf.gsm8k_calculator_agent --smoke --out /tmp/agent_smoke/run
GPU (one H100/H200; /work/shared/gpu/README.md case (b): build the bundle with ``--with-transformers 5.24.0``
and the GGUF parts, make the six part calls, then this as call 7, carrying ``.gpu``; about 7 of the 15 device
minutes are left by then, so ``--max-seconds`` (which counts the Gemma conversion, 1-2 min) stops the run
cleanly before ``--timeout`` would kill it, and every unit that finished is already in ``$OUT``)::

    bash .gpu/run-on-gpu.sh --timeout 420 --log agent.log -- python3 -m flowopt.benchmarks.perf.gsm8k_calculator_agent \
      --device cuda --threads 8 --eval-threads 128 --train 200 --test 100 --steps 5 --batch 4 --group 8 \
      --max-steps 2 --max-new-tokens 64 --seeds 0 --max-seconds 360 --out "$OUT/gsm8k_calculator_agent"

With more device time (or a machine kept for longer): ``--test 300 --steps 30 --seeds 0 1 2``, and
``--max-seconds`` a minute under the command's timeout.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run

logger = logging.getLogger(__name__)
SMOKE = {"model": "tiny", "train": 4, "test": 3, "steps": 1, "batch": 1, "group": 2, "max_steps": 1,
         "max_new_tokens": 4, "seeds": [0], "threads": 1, "eval_threads": 2}
ARMS = ("react-terminal", "react-intermediate", "cot-terminal")
TITLE = "GSM8K calculator agent: terminal vs terminal + intermediate rewards, and without tools"


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("gsm8k_calculator_agent", __doc__, smoke=SMOKE)
    parser.add_argument("--model", default="gemma-3-270m", help="a LocalLM name or folder, or 'tiny'")
    parser.add_argument("--device", default="cpu", help="where the student runs: cpu or cuda")
    parser.add_argument("--dtype", default=None, help="the student's dtype (default: bf16 where native, else fp32)")
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
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    parser.add_argument("--eval-threads", type=int, default=8, help="held-out questions run at once (batched)")
    parser.add_argument("--units", nargs="+", default=None, choices=["untrained-react", "untrained-cot", *ARMS],
                        help="run only these units (default: all)")
    parser.add_argument("--max-seconds", type=float, default=0.0,
                        help="time budget for the whole run (0: none); stops cleanly and reports what finished")
    run = start_run(parser, argv)
    args = run.args

    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    def publish(results: dict[str, Any]) -> None:
        run.finish(TITLE, results, report_body(args, results))

    with tempfile.TemporaryDirectory(prefix="gsm8k-agent-") as tmp:
        run_all(args, Path(tmp), publish)
    return 0


class Clock:
    """The run's time budget: what is left, and whether a unit that took ``estimate`` s before still fits.

    Example:
        >>> Clock(0).fits(1e9), Clock(0).left()
        (True, None)
    """

    def __init__(self, max_seconds: float) -> None:
        self.deadline = time.monotonic() + max_seconds if max_seconds > 0 else None

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def fits(self, estimate: float) -> bool:
        left = self.left()
        return left is None or left > estimate

    def budget(self, reserve: float = 0.0) -> Any:
        """A fresh tracker whose wall limit ends ``reserve`` s before the deadline (none without one)."""
        from flowopt.compiler.budget import Budget, BudgetTracker

        left = self.left()
        return BudgetTracker(Budget(max_wall_s=max(1.0, left - reserve)) if left is not None else None)


def _student(args: Any, folder: Path) -> Any:
    """A fresh LocalLM (no adapter); ``tiny`` is saved to ``folder`` first, so it loads like a checkpoint."""
    from flowopt.lm import LocalLM

    name = args.model
    if name == "tiny":
        from flowopt.optimizers.weights.tiny import tiny_causal_lm

        if not (folder / "config.json").is_file():
            model, tokenizer = tiny_causal_lm(["calculator", "finish", *[str(n) for n in range(10)], "+", "*"],
                                              seed=0)
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        name = str(folder)
    return LocalLM(name, device=args.device, dtype=args.dtype, max_new_tokens=args.max_new_tokens, progress=False)


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


class Runner:
    """The splits, the contexts and the clock one run shares; :meth:`score` and :meth:`train` are its units."""

    def __init__(self, args: Any, run_dir: Path) -> None:
        from flowopt.benchmarks.datasets import load_split

        self.args, self.run_dir = args, run_dir
        self.clock = Clock(args.max_seconds)
        self.trainset = load_split("gsm8k-dspy", "train", limit=args.train, seed=0)
        self.testset = load_split("gsm8k-dspy", "test", limit=args.test, seed=0)
        self.seconds: dict[str, float] = {}  # the last time each kind of unit took ("score-react", "train-cot")

    def ctx(self, name: str, seed: int, budget: Any) -> Any:
        from flowopt.benchmarks.metrics import gsm8k_dspy_metric
        from flowopt.compiler.context import StageContext

        return StageContext(trainset=self.trainset, valset=self.testset, metric=gsm8k_dspy_metric, budget=budget,
                            seed=seed, rng=random.Random(seed), run_dir=self.run_dir / name, stage_name=name,
                            num_threads=self.args.eval_threads)

    def fits(self, *kinds: str) -> bool:
        return self.clock.fits(sum(self.seconds.get(kind, 0.0) for kind in kinds))

    def score(self, program: Any, name: str, kind: str) -> dict[str, Any] | None:
        """Held-out score and tool calls by status; ``None`` when the time budget ran out first."""
        from flowopt.errors import BudgetExhausted
        from flowopt.tools import tool_log

        ctx = self.ctx(name, 0, self.clock.budget())
        began = time.monotonic()
        try:
            with ctx.budget.activate(), tool_log() as log:
                result = ctx.evaluate(program, self.testset)
        except BudgetExhausted:
            logger.info("%s: not scored, the time budget ran out", name)
            return None
        self.seconds[f"score-{kind}"] = time.monotonic() - began
        statuses = Counter(call.status for call in log.calls)
        return {"score": result.score, "ci": list(result.ci), "scores": result.scores, "errors": result.errors,
                "tool_calls": dict(sorted(statuses.items())), "score_s": round(self.seconds[f"score-{kind}"], 1)}

    def train(self, arm: str, seed: int, local: Any) -> tuple[Any, dict[str, Any]]:
        """GRPO for ``arm`` on ``local``; stops between steps when only the scoring's time is left."""
        import dspy

        kind = "cot" if arm.startswith("cot") else "react"
        program = programs(self.args.max_steps)[kind]
        ctx = self.ctx(f"{arm}-{seed}", seed, self.clock.budget(reserve=self.seconds.get(f"score-{kind}", 0.0)))
        began = time.monotonic()
        with dspy.context(lm=local.lm.copy(cache=False)):  # the stage trains the LM the program runs on
            trained = stage_for(arm, self.args).run(program, ctx)
        self.seconds[f"train-{kind}"] = time.monotonic() - began
        keys = ("step", "mean_reward", "mean_score", "format_failures", "tool_calls", "intermediate_reward", "step_s")
        return trained, {"train_s": round(self.seconds[f"train-{kind}"], 1),
                         "steps_done": ctx.info.get("steps_done"), "stop_reason": ctx.info.get("stop_reason"),
                         "curve": [{k: p.get(k) for k in keys} for p in ctx.info["reward_curve"]]}


def schedule(seeds: list[int]) -> list[tuple[str, int | None]]:
    """The run's units in order: the tool-using agent's (untrained, then both reward settings per seed) before
    the no-tools baseline's, so a run cut short by its time budget still has the main comparison.

    Example:
        >>> schedule([0])
        [('untrained react', None), ('react-terminal', 0), ('react-intermediate', 0), ('untrained cot', None), \
('cot-terminal', 0)]
    """
    react = [(arm, seed) for seed in seeds for arm in ARMS if arm.startswith("react")]
    cot = [(arm, seed) for seed in seeds for arm in ARMS if arm.startswith("cot")]
    return [("untrained react", None), *react, ("untrained cot", None), *cot]


def run_all(args: Any, run_dir: Path, publish: Any) -> dict[str, Any]:
    """Every unit of :func:`schedule` with its held-out score; publishes the results after each one."""
    import dspy

    from flowopt.lm import AutoAdapter

    runner = Runner(args, run_dir)
    results: dict[str, Any] = {"status": "running", "untrained": {}, "seeds": {}, "not_run": []}
    units = [(arm, seed) for arm, seed in schedule(args.seeds)
             if not getattr(args, "units", None) or arm.replace(" ", "-") in args.units]
    with dspy.context(adapter=AutoAdapter()):
        for done, (arm, seed) in enumerate(units):
            kind = "cot" if "cot" in arm else "react"
            reason = None
            if seed is not None and not runner.fits(f"train-{kind}", f"score-{kind}"):
                reason = f"time budget (before {arm} seed {seed})"
            else:
                row = run_unit(runner, arm, seed, kind)
                if row is None:
                    reason = f"time budget ({arm}" + ("" if seed is None else f" seed {seed}") + ")"
                elif seed is None:
                    results["untrained"][kind] = row
                else:
                    results["seeds"].setdefault(str(seed), {})[arm] = row
            if reason is not None:
                results.update(status=f"stopped: {reason}",
                               not_run=[a if s is None else f"{a} seed {s}" for a, s in units[done:]])
                break
            publish(results)
        else:
            results["status"] = "complete"
    publish(results)
    return results


def run_unit(runner: Runner, arm: str, seed: int | None, kind: str) -> dict[str, Any] | None:
    """One unit on a fresh student: score the untrained program, or train ``arm`` with ``seed`` and score it."""
    import dspy

    local = _student(runner.args, runner.run_dir / "tiny-model")
    try:
        if seed is None:
            program, info = programs(runner.args.max_steps)[kind], {}
        else:
            program, info = runner.train(arm, seed, local)
        with dspy.context(lm=local.lm.copy(cache=False)):
            row = runner.score(program, arm if seed is None else f"{arm}-{seed}", kind)
    finally:
        local.close()
    if row is not None:
        logger.info("%s%s: held-out %.3f", arm, "" if seed is None else f" seed {seed}", row["score"])
    return None if row is None else {**info, **row}


def pooled(results: dict[str, Any], arm: str, base: str) -> dict[str, Any] | None:
    """``arm - base`` paired per (seed, question) over every seed where both were scored."""
    from flowopt.benchmarks.scoring import paired_change

    pairs = [(arms[base]["scores"], arms[arm]["scores"]) for arms in results["seeds"].values()
             if arm in arms and base in arms]
    if not pairs:
        return None
    return paired_change({"scores": [s for b, _ in pairs for s in b]}, {"scores": [s for _, a in pairs for s in a]})


def report_body(args: Any, results: dict[str, Any]) -> list[str]:
    from flowopt.benchmarks.scoring import paired_change

    def cell(row: dict[str, Any]) -> str:
        return f"{row['score']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]"

    def change(c: dict[str, Any] | None) -> str:
        return "-" if c is None else f"{c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]"

    def tools(row: dict[str, Any]) -> str:
        calls = row.get("tool_calls") or {}
        return ", ".join(f"{k} {v}" for k, v in calls.items()) or "none"

    rows = [[f"untrained {name}", "-", "-", cell(row), "-", tools(row)] for name, row in results["untrained"].items()]
    for seed, arms in results["seeds"].items():
        for arm, row in arms.items():
            paired = change(paired_change(arms["react-terminal"], row)) if arm != "react-terminal" else "-"
            rows.append([arm, seed, f"{row['steps_done']}/{args.steps}", cell(row), paired, tools(row)])
    curves = [[arm, seed, " ".join(f"{p['mean_reward']:.2f}" for p in row["curve"]),
               sum(p.get("tool_calls") or 0 for p in row["curve"]), row["train_s"]]
              for seed, arms in results["seeds"].items() for arm, row in arms.items()]
    summary = [["intermediate - terminal (react)", change(pooled(results, "react-intermediate", "react-terminal"))],
               ["tools - no tools (trained, terminal)", change(pooled(results, "react-terminal", "cot-terminal"))]]
    untrained = results["untrained"]
    if "react" in untrained and "cot" in untrained:
        summary.append(["tools - no tools (untrained)", change(paired_change(untrained["cot"], untrained["react"]))])
    return [f"Status: **{results['status']}**" + (f"; not run: {', '.join(results['not_run'])}"
                                                   if results["not_run"] else "") + ".", "",
            f"Student: {args.model} on {args.device}; {args.train} GSM8K training questions, {args.test} held-out "
            f"test questions (DSPy's split and metric); GRPO {args.steps} steps, B={args.batch} x G={args.group}, "
            f"lr {args.lr:g}; ReAct max_steps {args.max_steps}, {args.max_new_tokens} new tokens a call; tool "
            f"rewards ok {args.tool_ok:g}, error {args.tool_error:g}, unknown tool {args.tool_unknown:g}.", "",
            *markdown_table(["program", "seed", "GRPO steps", "held-out score [95% CI]",
                             "paired vs react-terminal [95% CI]", "held-out tool calls"], rows, align="llrrrl"),
            "", "Pooled over seeds (paired per seed and question):", "",
            *markdown_table(["change", "mean [95% CI]"], summary, align="lr"),
            "", "Training (mean reward per GRPO step):", "",
            *markdown_table(["arm", "seed", "mean reward by step", "tool calls in rollouts", "train s"], curves,
                            align="llrrr")]


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
