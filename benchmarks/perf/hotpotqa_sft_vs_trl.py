"""HotpotQA finetune: flowopt's BootstrapFinetune against TRL's SFTTrainer on the same pairs, LoRA and test.

Run: python -m flowopt.benchmarks.perf.hotpotqa_sft_vs_trl [--train 140] [--test 400] [--epochs 2]
Writes benchmarks/results/hotpotqa_sft_vs_trl.{json,md} (``--out STEM``). Issue 13 asks for the peer beside
the HotpotQA finetune row: the same training a user would otherwise run with TRL. Goal: flowopt's test
F1 is not below TRL's (the paired difference's 95% interval reaches 0 or above); training times are
reported beside it.

Both sides start from Gemma 3 270M (the embedded model, its weights as ``LocalLM`` loads them) and learn
from exactly the same token ids: the ``hotpotqa-aflow`` workflow program's answer call rendered for
each of the ``--train`` training questions with its gold answer as the completion (``labels="only"``;
no teacher is reachable offline), loss on the completion tokens only. Same LoRA (r=16, alpha=32, every
linear layer), AdamW at 2e-4 with a linear decay, batch 8, ``--epochs`` epochs, gradient clipping at 1.0.

- ``flowopt``: ``flowopt.compile(program, ..., stages=[BootstrapFinetune(labels="only")])``, the user's
  path (its dev-split check runs too; the trained program is scored whether the check keeps it or not);
- ``trl``: ``trl.SFTTrainer`` on the pre-tokenised pairs (``input_ids`` and ``labels``) with a
  ``peft.LoraConfig`` equal to flowopt's, TRL's defaults otherwise; its adapter is then loaded into the
  same ``LocalLM`` and the same program runs with it.

Both trained programs and the base program are scored with the protocol's reference metric (AFlow's F1)
on the same ``--test`` test questions; differences are paired per question with 95% intervals. One
training seed per side and run (``--train-seed``; the splits follow ``--seed``): the intervals cover the
test questions, not training noise, which runs with other ``--train-seed`` values on the same questions
measure. Test scores are kept in ``--work``/evals and reused by a rerun, and
flowopt's compile resumes from ``--work``/flowopt (a ``flowopt bench`` stage folder of the same settings,
``run/NN-finetune-*``, copied there is reused the same way; the results say when that happened).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import Goal, PerfParser, markdown_table, setup_logging, start_run
from flowopt.io import atomic_write_json

logger = logging.getLogger(__name__)

SMOKE = {"train": 8, "dev": 2, "test": 3, "epochs": 1, "threads": 2}
PROTOCOL, PROGRAM, MODEL = "hotpotqa-aflow", "workflow", "gemma-3-270m"


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("hotpotqa_sft_vs_trl", __doc__, smoke=SMOKE)
    parser.add_argument("--train", type=int, default=140, help="training questions (their gold answers)")
    parser.add_argument("--dev", type=int, default=60, help="flowopt's dev split (compile's keep-or-not check)")
    parser.add_argument("--test", type=int, default=400, help="test questions both trained programs answer")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens per answer")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--lm-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="the splits' seed (which questions train, dev, test)")
    parser.add_argument("--train-seed", type=int, default=None,
                        help="both trainings' seed (batch order, LoRA init; default: --seed): several runs with the "
                             "same --seed and other --train-seed values measure training noise on the same questions")
    parser.add_argument("--work", type=Path, default=Path("runs/hotpotqa_sft_vs_trl"),
                        help="adapters, flowopt's run folder and the kept test scores")
    run = start_run(parser, argv)
    args = run.args
    if args.train_seed is None:
        args.train_seed = args.seed
    try:
        import trl
    except ImportError:
        parser.error("TRL is not installed (pip install -e \".[bench]\")")
    import dspy

    from flowopt.benchmarks.cli import bench_parser
    from flowopt.benchmarks.scoring import TestScorer
    from flowopt.benchmarks.settings import plan_bench
    from flowopt.lm import LocalLM, adapter_for

    plan = plan_bench(bench_parser().parse_args([
        PROTOCOL, "--lm", MODEL, "--program", PROGRAM, "--stages", "finetune", "--labels", "only",
        "--epochs", str(args.epochs), "--train", str(args.train), "--dev", str(args.dev), "--test", str(args.test),
        "--seed", str(args.seed), "--out", str(args.work)]))
    stage = plan.stages[0]
    local = LocalLM(MODEL, max_new_tokens=args.max_tokens, max_batch_size=args.lm_batch)
    lm, adapter = local.lm, adapter_for(local.lm)
    scorer = TestScorer(plan.proto, args.work, num_threads=args.threads, quiet=True, resume=True, seed=args.seed)
    base_model = copy.deepcopy(local.model)  # before any adapter is attached: TRL's starting point
    dtype = local.dtype

    with dspy.context(lm=lm, adapter=adapter):
        data = training_pairs(plan.program, plan.trainset, adapter, local, stage.max_length)
        trl_run = train_trl(base_model, local.tokenizer, data, stage, args, args.work / "trl")
        del base_model
        trl_program = with_adapter(plan.program, local, args.work / "trl" / "adapter")
        flowopt_run, flowopt_program = train_flowopt(plan, args)
        if flowopt_run["pairs"] != len(data):  # checked before the long scoring, not after it
            raise RuntimeError(f"flowopt trained on {flowopt_run['pairs']} pairs, TRL on {len(data)}: "
                               "not the same data")
        tests = {"baseline": scorer.score(plan.program, plan.testset, "baseline"),
                 "flowopt": scorer.score(flowopt_program, plan.testset, "flowopt finetune"),
                 "trl": scorer.score(trl_program, plan.testset, "TRL SFT")}
    local.close()

    results = summarise(tests, flowopt_run, trl_run, data, trl.__version__, stage, str(dtype).removeprefix("torch."))
    results["seeds"] = {"splits": args.seed, "training": args.train_seed}
    run.finish("HotpotQA finetune on Gemma 3 270M: flowopt's BootstrapFinetune vs TRL's SFTTrainer", results,
               report_body(results, args), goals=goals(results))
    return 0


def training_pairs(program: Any, trainset: list[Any], adapter: Any, local: Any,
                   max_length: int) -> list[tuple[list[int], list[int]]]:
    """The (prompt ids, completion ids) pairs BootstrapFinetune(labels="only") trains on, built by its own code."""
    from flowopt.optimizers.weights.policy import Policy
    from flowopt.optimizers.weights.sft import token_pairs
    from flowopt.optimizers.weights.traces import label_pairs

    return token_pairs(Policy(local), label_pairs(program, trainset, adapter), max_length)


def train_trl(model: Any, tokenizer: Any, data: list[tuple[list[int], list[int]]], stage: Any,
              args: Any, folder: Path) -> dict[str, Any]:
    """TRL's SFTTrainer with the stage's LoRA and optimiser settings; saves the adapter to ``folder/adapter``
    and what the training did to ``folder/train.json``, which a rerun reuses instead of training again."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    record = folder / "train.json"
    fingerprint = hashlib.sha256(json.dumps([data, config_key(stage, args)]).encode()).hexdigest()
    if record.exists() and (folder / "adapter" / "adapter_config.json").exists():
        kept: dict[str, Any] = json.loads(record.read_text())
        if kept.get("fingerprint") != fingerprint:
            raise RuntimeError(f"{folder} holds a TRL run on other pairs or settings: pass another --work")
        logger.info("TRL: reusing the adapter trained earlier in %s", folder)
        return {**kept, "reused": True}
    rows = [{"input_ids": p + c, "labels": [-100] * len(p) + c} for p, c in data]
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    config = SFTConfig(
        output_dir=str(folder), num_train_epochs=stage.epochs, per_device_train_batch_size=stage.batch_size,
        gradient_accumulation_steps=1, learning_rate=stage.learning_rate, lr_scheduler_type=stage.lr_schedule,
        warmup_steps=stage.warmup_steps, weight_decay=stage.weight_decay, max_grad_norm=stage.max_grad_norm,
        seed=args.train_seed, data_seed=args.train_seed, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=bf16, max_length=stage.max_length, packing=False,
        gradient_checkpointing=stage.gradient_checkpointing, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer, peft_config=stage.lora.peft_config())
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    trainer.model.save_pretrained(str(folder / "adapter"))
    losses = [round(entry["loss"], 5) for entry in trainer.state.log_history if "loss" in entry]
    logger.info("TRL: %d pairs, %d steps in %.0f s, loss %.4f -> %.4f", len(data), len(losses), wall, losses[0],
                losses[-1])
    result = {"pairs": len(data), "steps": len(losses), "train_wall_s": round(wall, 1), "train_cpu_s": round(cpu, 1),
              "loss_curve": losses, "fingerprint": fingerprint}
    atomic_write_json(record, result)
    return result


def config_key(stage: Any, args: Any) -> list[Any]:
    """What TRL's training depends on besides the pairs: a rerun reuses an adapter only when these match."""
    return [stage.epochs, stage.learning_rate, stage.batch_size, stage.lr_schedule, stage.warmup_steps,
            stage.weight_decay, stage.max_grad_norm, repr(stage.lora), args.train_seed]


def with_adapter(program: Any, local: Any, folder: Path) -> Any:
    """A copy of ``program`` whose every call runs ``local`` with the adapter saved in ``folder``."""
    from flowopt.lm.pinned import adapter_sha256
    from flowopt.optimizers.weights.student import attach

    name = local.load_adapter(folder, name="trl-sft", activate=False)
    return attach(program.deepcopy(), local, name, adapter_dir=folder, sha256=adapter_sha256(folder), run_root=None)


def train_flowopt(plan: Any, args: Any) -> tuple[dict[str, Any], Any]:
    """``flowopt.compile`` with the finetune stage; the stage's own output whether dev keeps it or not."""
    from flowopt.compiler import compile, saved_output

    run_dir = args.work / "flowopt"
    wall, cpu = time.perf_counter(), time.process_time()
    compiled = compile(plan.program, plan.trainset, plan.proto.metric_fn(), valset=plan.valset,
                       stages=list(plan.stages), seed=args.train_seed, run_dir=run_dir, resume=True,
                       num_threads=args.threads, quiet=True)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    row = compiled.report.stages[-1]
    info = row.info
    program = compiled if row.kept else saved_output(run_dir, 0, "finetune", plan.program)
    return {"pairs": info["pairs"], "steps": len(info["loss_curve"]), "train_wall_s": info["train_seconds"],
            "compile_wall_s": round(wall, 1), "compile_cpu_s": round(cpu, 1), "loss_curve": info["loss_curve"],
            "resumed": any(stage.resumed for stage in compiled.report.stages),
            "kept_on_dev": row.kept, "dev": {"before": compiled.report.stages[0].score, "after": row.score}}, program


def summarise(tests: dict[str, dict[str, Any]], flowopt_run: dict[str, Any], trl_run: dict[str, Any],
              data: list[tuple[list[int], list[int]]], trl_version: str, stage: Any, dtype: str) -> dict[str, Any]:
    from flowopt.benchmarks.scoring import paired_change

    def brief(row: dict[str, Any]) -> dict[str, Any]:
        return {"score": row["score"], "ci": row["ci"], "n": row["n"], "failed": row["errors"],
                "strict": {k: {"score": v["score"], "ci": v["ci"]} for k, v in row["strict"].items()}}

    return {
        "protocol": PROTOCOL, "program": PROGRAM, "model": MODEL, "trl_version": trl_version, "dtype": dtype,
        "pairs": len(data), "prompt_tokens_mean": round(sum(len(p) for p, _ in data) / len(data), 1),
        "completion_tokens_mean": round(sum(len(c) for _, c in data) / len(data), 1),
        "settings": {"epochs": stage.epochs, "learning_rate": stage.learning_rate, "batch_size": stage.batch_size,
                     "lr_schedule": stage.lr_schedule, "max_grad_norm": stage.max_grad_norm,
                     "lora": {"r": stage.lora.r, "alpha": stage.lora.alpha, "dropout": stage.lora.dropout,
                              "target_modules": stage.lora.target_modules}},
        "test": {name: brief(row) for name, row in tests.items()},
        "paired": {"flowopt - baseline": paired_change(tests["baseline"], tests["flowopt"]),
                   "trl - baseline": paired_change(tests["baseline"], tests["trl"]),
                   "flowopt - trl": paired_change(tests["trl"], tests["flowopt"])},
        "train": {"flowopt": flowopt_run, "trl": trl_run},
        "train_time_ratio_flowopt_vs_trl": round(flowopt_run["train_wall_s"] / trl_run["train_wall_s"], 3),
    }


def report_body(r: dict[str, Any], args: Any) -> list[str]:
    def ci(row: dict[str, Any]) -> str:
        return f"{row['score']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]"

    def change(c: dict[str, Any]) -> str:
        return f"{c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]"

    t, p, train = r["test"], r["paired"], r["train"]
    strict = next(iter(t["baseline"]["strict"]), None)
    rows = []
    for name, label in (("baseline", "base model"), ("flowopt", "flowopt `finetune` stage"),
                        ("trl", f"TRL {r['trl_version']} `SFTTrainer`")):
        run_info = train.get(name)
        rows.append([label, ci(t[name]), f"{t[name]['strict'][strict]['score']:.3f}" if strict else "-",
                     f"{t[name]['failed']}/{t[name]['n']}",
                     change(p[f"{name} - baseline"]) if name != "baseline" else "—",
                     f"{run_info['steps']}" if run_info else "—",
                     f"{run_info['loss_curve'][0]:.3f} -> {run_info['loss_curve'][-1]:.3f}" if run_info else "—",
                     f"{run_info['train_wall_s']:.0f}" if run_info else "—"])
    f = train["flowopt"]
    return [
        f"`{PROTOCOL}`, `{PROGRAM}` program, {MODEL}; {r['pairs']} training pairs (gold answers; prompt "
        f"{r['prompt_tokens_mean']:.0f} tokens, completion {r['completion_tokens_mean']:.1f} tokens on average), "
        f"{args.epochs} epochs, LoRA r={r['settings']['lora']['r']} alpha={r['settings']['lora']['alpha']}, "
        f"lr {r['settings']['learning_rate']:g} ({r['settings']['lr_schedule']}), batch "
        f"{r['settings']['batch_size']}; {t['baseline']['n']} test questions, up to {args.max_tokens} new tokens "
        f"per answer, greedy. Training seed {args.train_seed} on both sides (splits: seed {args.seed}); the intervals "
        "cover the test questions, not training noise.", "",
        *markdown_table(["program", "test AFlow F1 [95% CI]", f"{strict or 'strict'}", "failed",
                         "vs base (paired)", "steps", "train loss first -> last", "train wall s"], rows,
                        align="llllllll"), "",
        f"* flowopt vs TRL, paired on the same questions: {change(p['flowopt - trl'])} AFlow F1.",
        f"* Training wall time flowopt / TRL: {r['train_time_ratio_flowopt_vs_trl']:.2f} ({r['dtype']} weights, "
        f"{r['train']['flowopt']['steps']} optimizer steps each). "
        + timing_note(f["resumed"], train["trl"].get("reused", False)),
        f"* flowopt's compile also checked the stage on {args.dev} dev questions (F1 {f['dev']['before']:.3f} -> "
        f"{f['dev']['after']:.3f}, kept: {f['kept_on_dev']}); the table scores the trained program either way.",
        "* Both loss curves are in the JSON (`train.*.loss_curve`, one value per optimizer step). TRL's logged "
        "loss is the mean over the step's completion tokens, as flowopt's is.",
    ]


def timing_note(flowopt_reused: bool, trl_reused: bool) -> str:
    """Whether the two training times were measured side by side, in this run."""
    reused = [side for side, was in (("flowopt", flowopt_reused), ("TRL", trl_reused)) if was]
    if not reused:
        return "Both trained in this run, one after the other, under the load recorded above."
    return (f"Not both trained in this run ({' and '.join(reused)} reused an earlier run's training in `--work`): "
            "a reused side's time was measured then, under that run's load.")


def goals(r: dict[str, Any]) -> list[Goal]:
    return [Goal.at_least("flowopt - TRL test F1: upper end of the paired 95% interval",
                          round(r["paired"]["flowopt - trl"]["ci"][1], 4), 0.0)]


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
