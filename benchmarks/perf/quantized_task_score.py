"""Task scores with the quantized decode twin against the exact weights, paired on the same test questions.

Run: python -m flowopt.benchmarks.perf.quantized_task_score [--protocol hotpotqa-aflow] [--program workflow]
     [--adapter DIR] [--test 100] [--max-tokens 8] [--settings int8,int4,int4-compiled] [--threads 1]
Writes benchmarks/results/quantized_task_score.{json,md} (``--out STEM``).

``LocalLM(quantize=...)`` (:mod:`flowopt.lm.quantize`) changes greedy tokens; this script asks what that costs
on a benchmark. One process scores the same program on the same report-split questions with the same model,
first with the exact weights, then with each quantized twin (``-compiled``: its decode step compiled too, as
``LocalLM(quantize=..., compile=True)``; inductor rounds differently), ``--threads`` calls at a time (1: every
decode step has one row, the twin's weight-only kernels; 8: most steps have 5-8 rows, its int8 activations; the
decode counters in the JSON give the steps by rows). Each setting gets its own ``LocalLM`` and DSPy's cache is
off, so every answer is decoded here. Scores are paired per question against
the exact weights (mean change, 95% interval) and the questions whose score moved are counted.

``--adapter`` (a finetune stage's ``adapter`` folder, e.g. from the README's main command) is merged into the
embedded Gemma first (PEFT's ``merge_and_unload``): the twin quantizes plain weights, and a finetuned student
scores well above the base model's floor, where a change can show. Without it the base model is scored.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.search_tasks import dspy_cache_off

logger = logging.getLogger(__name__)

SMOKE = {"model": "tiny", "test": 2, "max_tokens": 2, "settings": "int8"}
SETTINGS = ("int8", "int4", "int8-compiled", "int4-compiled")


def merged_model(adapter: Path, folder: Path) -> Path:
    """The embedded Gemma with ``adapter`` merged into its weights, saved to ``folder`` (bf16)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flowopt.lm.gemma import ensure_gemma

    base = ensure_gemma(progress=False)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def tiny_model(folder: Path) -> Path:
    """A tiny random model for the smoke size (its answers are noise; the run checks the plumbing)."""
    from flowopt.benchmarks.perf.local_lm_cuda import build_model

    return build_model(folder, layers=2)


def score_setting(model: str, setting: str, args: Any, program: Any, testset: list[Any],
                  proto: Any, folder: Path) -> dict[str, Any]:
    """One setting's (``exact`` or one of :data:`SETTINGS`) per-question scores on ``testset``, its wall time
    and its decode counters."""
    import dspy

    from flowopt.benchmarks.lms import make_lm
    from flowopt.benchmarks.scoring import TestScorer

    scheme = None if setting == "exact" else setting.removesuffix("-compiled")
    lm, adapter = make_lm(model, max_tokens=args.max_tokens, batch=args.threads,
                          compile=setting.endswith("-compiled"), quantize=scheme)
    scorer = TestScorer(proto, folder / setting, num_threads=args.threads, quiet=True, resume=False, seed=0)
    began = time.perf_counter()
    try:
        with dspy.context(lm=lm, adapter=adapter):
            row = scorer.score(program, testset, setting)
        stats = lm.local.decode_stats.summary()  # every model here is local (make_lm's LocalLM)
    finally:
        lm.local.close()
    return {**row, "wall_s": time.perf_counter() - began, "decode": stats}


def compare(exact: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    from flowopt.benchmarks.scoring import paired_change

    moved = [i for i, (a, b) in enumerate(zip(exact["scores"], other["scores"], strict=True)) if a != b]
    up = sum(1 for i in moved if other["scores"][i] > exact["scores"][i])
    return {"change": paired_change(exact, other), "moved": len(moved), "up": up, "down": len(moved) - up}


def page(results: dict[str, Any]) -> list[str]:
    threads = results["threads"]
    calls = "one call at a time" if threads == 1 else f"{threads} calls at a time"
    rows = []
    for name, row in results["settings"].items():
        vs = results["against_exact"].get(name)
        change = "—" if vs is None else (f"{vs['change']['mean']:+.3f} [{vs['change']['ci'][0]:+.3f}, "
                                         f"{vs['change']['ci'][1]:+.3f}]")
        moved = "—" if vs is None else f"{vs['moved']} ({vs['up']} up, {vs['down']} down)"
        rows.append([name, f"{row['score']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]", change, moved,
                     f"{row['errors']}", f"{row['wall_s']:.0f}"])
    return [f"Model: {results['model']}; program `{results['program']}` on {results['protocol']} "
            f"({results['n']} report-split questions, {results['metric']}); {calls}, greedy, "
            f"at most {results['max_tokens']} new tokens, DSPy's cache off.", "",
            *markdown_table(["decode weights", "score [95% CI]", "change vs exact (paired) [95% CI]",
                             "questions whose score moved", "failed", "wall s"], rows)]


def main(argv: list[str] | None = None) -> int:
    from flowopt.benchmarks.datasets import get_protocol, load_split
    from flowopt.benchmarks.programs import build_program

    parser = PerfParser("quantized_task_score", __doc__, smoke=SMOKE)
    parser.add_argument("--protocol", default="hotpotqa-aflow")
    parser.add_argument("--program", default="workflow")
    parser.add_argument("--model", choices=["gemma", "tiny"], default="gemma")
    parser.add_argument("--adapter", type=Path, default=None, help="a finetuned LoRA adapter folder to merge first")
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="concurrent calls (decode rows per step)")
    parser.add_argument("--settings", default="int8,int4,int4-compiled",
                        help=f"comma-separated, each one of {', '.join(SETTINGS)}; the exact weights always run first")
    run = start_run(parser, argv)
    args = run.args
    names = [s for s in args.settings.split(",") if s]
    if any(name not in SETTINGS for name in names):
        parser.error(f"--settings {args.settings}: each must be one of {', '.join(SETTINGS)}")
    proto = get_protocol(args.protocol)
    program = build_program(proto.name, args.program)
    testset = load_split(proto, proto.report_split, limit=args.test, seed=0)
    with tempfile.TemporaryDirectory(prefix="flowopt-qscore-") as tmp, dspy_cache_off():
        folder = Path(tmp)
        if args.model == "tiny":
            model, label = str(tiny_model(folder / "tiny")), "a tiny random model"
        elif args.adapter is not None:
            model, label = str(merged_model(args.adapter, folder / "merged")), f"gemma-3-270m + {args.adapter} (merged)"
        else:
            model, label = "gemma-3-270m", "gemma-3-270m"
        settings: dict[str, Any] = {}
        for setting in ["exact", *names]:
            logger.info("scoring with the %s weights", setting)
            settings[setting] = score_setting(model, setting, args, program, testset, proto, folder)
    exact = settings["exact"]
    results = {"model": label, "protocol": proto.name, "program": args.program, "metric": proto.metric,
               "n": len(testset), "max_tokens": args.max_tokens, "threads": args.threads, "settings": settings,
               "against_exact": {k: compare(exact, v) for k, v in settings.items() if k != "exact"}}
    run.finish("Task scores with the quantized decode twin against the exact weights", results, page(results))
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
