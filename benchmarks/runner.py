"""``flowopt bench``: baseline -> each stage in turn, every stage scored on the report split, nothing lost.

Every setting is checked first (:func:`~flowopt.benchmarks.settings.plan_bench`). Then the baseline and,
after each stage, the best program so far are scored on the report split with the protocol's reference
metric and its strict metrics; so is each stage's own output when the dev split rejected it (what the
layer gives by itself, paired against the program it started from). ``--out`` is rewritten:
``results.json`` (configuration, versions, machine, one row per stage with validation and test scores,
95% intervals, failed examples, LM calls, tokens, wall and CPU seconds), ``results.md`` (tables),
``scores.png`` (test score per stage; score against cumulative LM calls) and ``compiled.json``. A stage
that raises becomes a row with its error (and the run goes on from the best program so far), never a
crash. Each stage compiles in its own ``run/NN-name-<input program>`` folder, so ``--resume`` skips
finished stages, re-tries a failed one and reuses every scored evaluation.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import dspy

from flowopt.compiler import saved_output
from flowopt.compiler.evaluate import program_key
from flowopt.errors import ConfigError
from flowopt.io import atomic_write_json, atomic_write_text

from .datasets import get_protocol, list_protocols
from .lms import make_lm
from .programs import PROGRAMS
from .report import markdown, plot_scores, score_table
from .scoring import TestScorer, paired_change
from .settings import BenchPlan, plan_bench

logger = logging.getLogger(__name__)


def run_bench(args: argparse.Namespace) -> int:
    if args.list or not args.protocol:
        lines = ["protocols:"]
        for name in list_protocols():
            lines.append(f"  {name:<20} {get_protocol(name).description}")
        lines.append(f"programs: {', '.join(PROGRAMS)}")
        lines.append("stages: labeled, demos, search, structure, finetune, grpo (comma-separated) or none")
        sys.stdout.write("\n".join(lines) + "\n")
        return 0
    plan = plan_bench(args)  # every setting checked: nothing written, no LM called before this passes
    lm, adapter = make_lm(args.lm, api_base=args.api_base, max_tokens=args.max_tokens, batch=args.lm_batch,
                          compile={"auto": None, "on": True, "off": False}[args.lm_compile],
                          quantize=args.lm_quantize)
    plan.out.mkdir(parents=True, exist_ok=True)
    results = _Run(plan, args, decode_stats=_decode_stats_of(lm)).run(lm, adapter)
    sys.stdout.write(f"{score_table(results)}\nresults in {plan.out}/\n")
    return 0 if not any(row["status"] == "failed" for row in results["stages"]) else 1


class _Run:
    """One bench run: the rows so far, rewritten to ``--out`` after each of them."""

    def __init__(self, plan: BenchPlan, args: argparse.Namespace, *, decode_stats: Any = None) -> None:
        self.plan, self.args = plan, args
        self.decode_stats = decode_stats  # a local LM's DecodeStats: how full its batches were, compile seconds
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()
        self.scorer = TestScorer(plan.proto, plan.out, num_threads=args.threads, quiet=args.quiet,
                                 resume=args.resume, seed=args.seed)
        self.results: dict[str, Any] = {
            "protocol": plan.proto.name,
            "config": {k: v for k, v in vars(args).items() if k not in ("list", "func", "command", "verbose")},
            "versions": _versions(),
            "machine": f"{platform.platform()}, python {platform.python_version()}",
            "splits": {"train": len(plan.trainset), "dev": len(plan.valset), "test": len(plan.testset),
                       "report_split": plan.proto.report_split, "metric": plan.proto.metric,
                       "strict_metrics": list(plan.proto.extra_metrics)},
            "stages": [],
            "status": "running",
        }

    def run(self, lm: Any, adapter: Any) -> dict[str, Any]:
        from flowopt.compiler import Budget, compile

        plan, args = self.plan, self.args
        with dspy.context(lm=lm, adapter=adapter):
            t0, c0 = time.perf_counter(), time.process_time()
            best = plan.program
            baseline = self.scorer.score(best, plan.testset, "baseline")
            self._add({"name": "baseline", "status": "ok", "test": baseline, "kept": True,
                       "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0})
            calls_used = 0
            for index, (name, stage) in enumerate(zip(plan.stage_names, plan.stages), start=1):
                t0, c0 = time.perf_counter(), time.process_time()
                row: dict[str, Any] = {"name": name}
                stage_dir, start = self._stage_dir(index, name, best), best
                start_test = self.results["stages"][-1]["test"]
                output = None
                budget = Budget(max_lm_calls=None if args.max_lm_calls is None else args.max_lm_calls - calls_used,
                                max_cost_usd=args.max_cost_usd, max_wall_s=args.max_wall_s)
                try:
                    if budget.max_lm_calls is not None and budget.max_lm_calls < 1:
                        raise ConfigError("the --max-lm-calls budget is spent", fix="raise --max-lm-calls")
                    compiled = compile(best, plan.trainset, plan.proto.metric_fn(), valset=plan.valset,
                                       stages=[stage], budget=budget, seed=args.seed,
                                       run_dir=stage_dir, resume=args.resume,
                                       num_threads=args.threads, quiet=args.quiet)
                except Exception as err:  # a failed stage is a row: the run goes on from the best so far
                    logger.error("stage %s failed: %s: %s", name, type(err).__name__, err)
                    row.update(status="failed", error=f"{type(err).__name__}: {err}", kept=False)
                else:
                    stage_row = compiled.report.stages[-1]
                    row["lm_calls"] = sum(s.lm_calls for s in compiled.report.stages)  # validation baseline too
                    row["tokens"] = sum(s.tokens for s in compiled.report.stages)
                    calls_used += row["lm_calls"]
                    row.update(status="ok" if not stage_row.stop_reason.startswith("error") else "failed",
                               # GRPO's normal end is "steps", a finetune's may be "no teacher trace passed":
                               # shown beside the status; only an error is an error
                               error=stage_row.stop_reason if stage_row.stop_reason.startswith("error") else None,
                               stop_reason=stage_row.stop_reason,
                               kept=stage_row.kept, val=_val(compiled.report), compile=stage_row.to_dict())
                    # The stage's own output, kept or not: what this layer contributes by itself.
                    output = compiled if stage_row.kept else saved_output(stage_dir, 0, name, start)
                    best = compiled
                row["test"] = self.scorer.score(best, plan.testset, f"after {name}")
                if output is not None:
                    own = self.scorer.score(output, plan.testset, f"{name}'s own output")
                    row["own"] = {k: own[k] for k in ("score", "ci", "n", "errors")}
                    row["own"]["change"] = paired_change(start_test, own)
                row.update(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
                self._add(row)
            if hasattr(best, "save"):
                best.save(plan.out / "compiled.json")
        self.results["status"] = "done"
        self._write()
        return self.results

    def _stage_dir(self, index: int, name: str, program: Any) -> Path:
        """``run/NN-name-<input program>``: a stage resumes only from the same input program."""
        text = program.canonical_json() if hasattr(program, "canonical_json") else program_key(program)
        return self.plan.out / "run" / f"{index:02d}-{name}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"

    def _add(self, row: dict[str, Any]) -> None:
        row.setdefault("lm_calls", 0)  # compile cost; scoring on the report split is not counted
        self.results["stages"].append(row)
        rows = self.results["stages"]
        self.results["test"] = {"baseline": rows[0]["test"], "compiled": rows[-1]["test"],
                                "change": paired_change(rows[0]["test"], rows[-1]["test"])}
        self._write()

    def _write(self) -> None:
        out = self.plan.out
        self.results["wall_s"] = time.perf_counter() - self.started
        self.results["cpu_s"] = time.process_time() - self.cpu_started
        if self.decode_stats is not None:
            self.results["decode"] = self.decode_stats.summary()
        atomic_write_json(out / "results.json", self.results)
        atomic_write_text(out / "results.md", markdown(self.results))
        plot_scores(self.results, out / "scores.png")


def _decode_stats_of(lm: Any) -> Any:
    """The decode loop's counters when ``lm`` is a local model (rows per step over time), else None."""
    local = getattr(lm, "local", None)
    return getattr(local, "decode_stats", None)


def _val(report: Any) -> dict[str, Any]:
    """The stage's validation row: the compile baseline's score and the stage's."""
    base, stage = report.stages[0], report.stages[-1]
    return {"before": base.score, "score": stage.score, "ci": list(stage.ci) if stage.ci else None}


def _versions() -> dict[str, str]:
    import flowopt

    return {"flowopt": flowopt.__version__, "dspy": dspy.__version__, "python": platform.python_version()}

