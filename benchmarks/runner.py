"""``flowopt bench``: baseline -> compile -> compiled, on one protocol, with every number written down.

Outputs in ``--out``: ``results.json`` (configuration, versions, per-stage scores with intervals, LM
calls, tokens, cost, times), ``results.md`` (tables), ``scores.png`` (score per stage; score against
cost), ``compiled.json`` (the compiled workflow) and ``run/`` (the compiler's checkpoints, for --resume).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import dspy

from flowopt.errors import ConfigError
from flowopt.io import atomic_write_json, atomic_write_text

from .datasets import get_protocol, list_protocols, load_split
from .programs import PROGRAMS, build_program

logger = logging.getLogger(__name__)


def run_bench(args: argparse.Namespace) -> int:
    if args.list or not args.protocol:
        lines = ["protocols:"]
        for name in list_protocols():
            proto = get_protocol(name)
            lines.append(f"  {name:<20} {proto.description}")
        lines.append(f"programs: {', '.join(PROGRAMS)}")
        lines.append("stages: labeled, demos, search, structure, finetune, grpo (comma-separated) or none")
        sys.stdout.write("\n".join(lines) + "\n")
        return 0
    started = time.perf_counter()
    proto = get_protocol(args.protocol)
    metric = proto.metric_fn()
    names = [] if args.stages.strip() in ("", "none") else [s.strip() for s in args.stages.split(",")]
    stages = [("search", {"n_candidates": args.candidates}) if name == "search" else name for name in names]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainset, valset = _train_and_dev(proto, args.train, args.dev, args.seed)
    testset = load_split(proto, proto.report_split, limit=args.test, seed=args.seed)
    lm, adapter = make_lm(args.lm, api_base=args.api_base, max_tokens=args.max_tokens)
    program = build_program(proto.name, args.program)

    from flowopt.compiler import Budget, compile
    from flowopt.compiler.evaluate import Evaluator

    evaluator = Evaluator(metric, num_threads=args.threads, quiet=args.quiet, max_errors=len(testset))
    with dspy.context(lm=lm, adapter=adapter):
        baseline = _cached_eval(out / "baseline_test.json", evaluator, program, testset, "baseline on test", args)
        budget = Budget(max_lm_calls=args.max_lm_calls, max_cost_usd=args.max_cost_usd, max_wall_s=args.max_wall_s)
        compiled = compile(program, trainset, metric, valset=valset, stages=stages, budget=budget, seed=args.seed,
                           run_dir=out / "run", resume=args.resume, quiet=args.quiet)
        final = _cached_eval(out / "compiled_test.json", evaluator, compiled, testset, "compiled on test", args,
                             key=compiled.canonical_json())
    compiled.save(out / "compiled.json")
    report = compiled.report
    results = {
        "protocol": proto.name,
        "config": {k: v for k, v in vars(args).items() if k not in ("list", "func")},
        "versions": _versions(),
        "machine": f"{platform.platform()}, python {platform.python_version()}",
        "splits": {"train": len(trainset), "dev": len(valset), "test": len(testset),
                   "report_split": proto.report_split, "metric": proto.metric},
        "test": {"baseline": baseline, "compiled": final, "change": final["score"] - baseline["score"]},
        "compile": report.to_dict(),
        "wall_s": time.perf_counter() - started,
    }
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "results.md", _markdown(results, report))
    _plot(results, out / "scores.png")
    sys.stdout.write(f"{report}\n\n{_test_table(results)}\nresults in {out}/\n")
    return 0


def make_lm(model: str, *, api_base: str | None = None, max_tokens: int = 256) -> tuple[Any, Any]:
    """The LM and adapter for ``--lm``: local models (embedded name or folder) get the completion adapter."""
    if model.startswith("local/") or model == "gemma-3-270m" or Path(model).is_dir():
        from flowopt.lm import LocalLM, adapter_for

        local = LocalLM(model.removeprefix("local/"), max_new_tokens=max_tokens)
        return local.lm, adapter_for(local.lm)
    if "/" not in model:
        raise ConfigError(f"--lm {model!r} is neither a local model nor a litellm provider/model name",
                          fix="use e.g. --lm openai/gpt-4o-mini, --lm gemma-3-270m or a model folder")
    kwargs: dict[str, Any] = {"max_tokens": max_tokens}
    if api_base:
        kwargs["api_base"] = api_base
    if api_base and model.startswith("openai/"):
        kwargs["api_key"] = "local"  # OpenAI-compatible local servers ignore it; litellm insists on one
    return dspy.LM(model, **kwargs), None


def _train_and_dev(proto: Any, n_train: int, n_dev: int, seed: int) -> tuple[list, list]:
    if proto.train_split != proto.search_split:
        return (load_split(proto, proto.train_split, limit=n_train, seed=seed),
                load_split(proto, proto.search_split, limit=n_dev, seed=seed))
    # One split serves both (AFlow's protocols): disjoint slices of one seeded shuffle.
    pool = load_split(proto, proto.train_split)
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    if n_train + n_dev > len(pool):
        raise ConfigError(f"--train {n_train} + --dev {n_dev} exceeds the {len(pool)} examples of "
                          f"{proto.name}'s {proto.train_split} split", fix="lower --train or --dev")
    return [pool[i] for i in order[:n_train]], [pool[i] for i in order[n_train:n_train + n_dev]]


def _cached_eval(path: Path, evaluator: Any, program: Any, examples: list, desc: str, args: Any,
                 key: str | None = None) -> dict[str, Any]:
    """Evaluate once; with --resume, reuse a saved result of the same program and examples."""
    ident = {"n": len(examples), "seed": args.seed, "key": key}
    if args.resume and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("ident") == ident:
            return saved["result"]
    result = evaluator.evaluate(program, examples, desc=desc).to_dict()
    atomic_write_json(path, {"ident": ident, "result": result})
    return result


def _versions() -> dict[str, str]:
    import flowopt

    return {"flowopt": flowopt.__version__, "dspy": dspy.__version__, "python": platform.python_version()}


def _test_table(results: dict[str, Any]) -> str:
    t = results["test"]
    split = results["splits"]

    def row(name: str, r: dict[str, Any]) -> str:
        return f"| {name} | {r['score']:.3f} | [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] | {r['errors']} |"

    return "\n".join([
        f"Report split: {results['protocol']} {split['report_split']} ({split['test']} examples, "
        f"metric {split['metric']})", "",
        "| program | score | 95% interval | errors |", "|---|---:|---|---:|",
        row("baseline", t["baseline"]), row("compiled", t["compiled"]),
    ]) + "\n"


def _markdown(results: dict[str, Any], report: Any) -> str:
    cfg = results["config"]
    return "\n".join([
        f"# flowopt bench {results['protocol']}", "",
        f"LM `{cfg['lm']}`, program `{cfg['program']}`, stages `{cfg['stages']}`, seed {cfg['seed']}, "
        f"train {results['splits']['train']}, dev {results['splits']['dev']}.  ",
        f"Machine: {results['machine']}; wall time {results['wall_s']:.0f} s.", "",
        _test_table(results), "## Compile (validation split)", "", "```", str(report), "```", "",
    ])


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    stages = results["compile"]["stages"]
    names = [s["name"] for s in stages]
    scores = [s["score"] for s in stages]
    lows = [s["score"] - s["ci"][0] for s in stages]
    highs = [s["ci"][1] - s["score"] for s in stages]
    cost = [s.get("lm_calls_total", s.get("lm_calls", 0)) for s in stages]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, scores, yerr=[lows, highs], capsize=4, color="#4a86e8")
    left.set_ylabel("validation score")
    left.set_title("score per stage")
    left.set_ylim(0, 1)
    right.plot(cost, scores, marker="o")
    for name, x, y in zip(names, cost, scores):
        right.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    right.set_xlabel("cumulative LM calls")
    right.set_ylabel("validation score")
    right.set_title("score against cost")
    fig.suptitle(f"{results['protocol']} ({results['config']['lm']})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
