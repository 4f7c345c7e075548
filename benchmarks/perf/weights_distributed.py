"""The weights stages on 2 CPU processes against 1, launched as a user launches them (accelerate launch).

Run: python -m flowopt.benchmarks.perf.weights_distributed [--examples 24] [--epochs 4] [--steps 4] [--repeats 1]
Writes benchmarks/results/weights_distributed.{json,md} (``--out STEM``). Goal (issue 16): the adapter
BootstrapFinetune trains on 2 processes equals the 1-process one, max abs difference <= 1e-5 in float32.

A tiny random Llama-shaped model (float32, saved to a temporary folder) on the cue -> word task; each
run is ``accelerate launch --num_processes N -m flowopt.optimizers.weights`` compiling a saved workflow
with BootstrapFinetune then GRPO, one torch thread per process. SFT trains on the gold labels (no
sampling), so both runs see the same batches and their adapters must agree. GRPO then samples its
rollouts, and the ranks draw their own samples, so its 2-process adapter is not expected to equal the
1-process one (its equality on the same rollouts is the test
``tests/optimizers/weights/test_distributed.py``); it shows the launched path end to end, with rewards.
Wall times include starting the processes and loading torch in each (about 10 s a process here), and
they vary with the machine's load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flowopt.benchmarks import cue_word
from flowopt.benchmarks.perf.harness import Goal, PerfParser, interleaved, markdown_table, setup_logging, start_run
from flowopt.ports import free_port

SMOKE = {"examples": 8, "epochs": 1, "steps": 1, "repeats": 1}
STAGES = ("finetune", "grpo")
LABELS = ["Noise:", "Cue:", "Word:", "---", "Given", "fields", "produce", "`noise`,", "`cue`,", "`word`."]


def write_task(folder: Path, examples: int) -> dict[str, Path]:
    """The tiny model, a workflow on it (float32, CPU) and the train/validation JSON Lines files."""
    import dspy

    import flowopt
    from flowopt.lm import LocalLM
    from flowopt.modules import Predict
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm([*cue_word.COLORS, *cue_word.ANIMALS, *cue_word.NOISE, *LABELS], seed=0)
    model.save_pretrained(folder / "tiny-model")
    tokenizer.save_pretrained(folder / "tiny-model")
    local = LocalLM(str(folder / "tiny-model"), name="tiny", device="cpu", dtype="float32", max_new_tokens=4,
                    progress=False)
    wf = flowopt.Workflow("noise, cue -> word", name="cue-word")
    wf.add("solve", Predict(dspy.Signature("noise, cue -> word", "Answer.")), lm="default")
    wf.lms["default"] = local.lm
    files = {"program": wf.save(folder / "wf.json"), "train": folder / "train.jsonl", "val": folder / "val.jsonl"}
    local.close()
    for name, seed, n in (("train", 5, examples), ("val", 6, 8)):
        rows = [{"noise": ex.noise, "cue": ex.cue, "word": ex.word} for ex in cue_word.make_examples(n, seed=seed)]
        files[name].write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return files


def launch_command(processes: int, port: int) -> list[str]:
    """``accelerate launch``: N > 1 goes through its torchrun launcher (``--multi_gpu``), whose processes
    join a gloo group on a CPU-only machine and an NCCL group on GPUs."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if processes > 1:
        command += ["--multi_gpu", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    return command


def run_stages(processes: int, stage: list[str], files: dict[str, Path], run_dir: Path) -> float:
    """One launched compile of the stages ``stage`` (``--stage ... --set ...``); returns its wall seconds."""
    command = [*launch_command(processes, free_port()), "-m", "flowopt.optimizers.weights",
               "--program", str(files["program"]), "--trainset", str(files["train"]), "--valset", str(files["val"]),
               "--inputs", "noise,cue", "--metric", "flowopt.benchmarks.cue_word:metric", *stage,
               "--run-dir", str(run_dir)]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=1800)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds


def adapter(run_dir: Path, index: int, stage: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "stages" / f"{index:02d}-{stage}" / "adapter" / "adapter_model.safetensors"))


def max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    if a.keys() != b.keys():
        raise RuntimeError("the two adapters hold different tensors")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def stage_infos(run_dir: Path) -> dict[str, dict[str, Any]]:
    report = json.loads((run_dir / "report.json").read_text())
    return {row["name"]: dict(row["info"]) for row in report["stages"][1:]}


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("weights_distributed", __doc__, smoke=SMOKE)
    parser.add_argument("--examples", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    run = start_run(parser, argv)
    args = run.args
    lora = '{"r": 4, "alpha": 8}'
    stages = ["--stage", "finetune", "--set", "finetune.labels=only", "--set", f"finetune.epochs={args.epochs}",
              "--set", "finetune.batch_size=4", "--set", "finetune.learning_rate=0.01",
              "--set", f"finetune.lora={lora}",
              "--stage", "grpo", "--set", f"grpo.steps={args.steps}", "--set", "grpo.batch_size=2",
              "--set", "grpo.group_size=4", "--set", "grpo.max_new_tokens=4", "--set", "grpo.learning_rate=0.001",
              "--set", f"grpo.lora={lora}"]
    with tempfile.TemporaryDirectory(prefix="flowopt-weights-distributed-") as tmp:
        folder = Path(tmp)
        files = write_task(folder, args.examples)
        counter = {"n": 0}

        def case(processes: int) -> Any:
            def go() -> dict[str, Any]:
                counter["n"] += 1
                run_dir = folder / f"run-{processes}-{counter['n']}"
                seconds = run_stages(processes, stages, files, run_dir)
                return {"seconds": seconds, "info": stage_infos(run_dir),
                        "adapters": {stage: adapter(run_dir, i, stage) for i, stage in enumerate(STAGES)}}
            return go

        runs = interleaved({f"{n} process(es)": case(n) for n in (1, 2)}, args.repeats)
    one, two = runs["1 process(es)"][0], runs["2 process(es)"][0]
    results: dict[str, Any] = {"processes": [1, 2], "wall_s": {k: [round(r["seconds"], 2) for r in v]
                                                                for k, v in runs.items()}}
    for stage in STAGES:
        results[stage] = {"max_abs_difference": max_difference(one["adapters"][stage], two["adapters"][stage]),
                          "largest_lora_B": max(float(v.abs().max()) for k, v in one["adapters"][stage].items()
                                                if "lora_B" in k)}
    results["finetune"].update(pairs=one["info"]["finetune"]["pairs"],
                               loss_curve_1=one["info"]["finetune"]["loss_curve"],
                               loss_curve_2=two["info"]["finetune"]["loss_curve"])
    for n, side in ((1, one), (2, two)):
        info = side["info"].get("grpo", {})
        results["grpo"][f"mean_reward_{n}"] = [round(p["mean_reward"], 4) for p in info.get("reward_curve", [])]
        results["grpo"][f"processes_{n}"] = info.get("processes")
    rows = [[stage, f"{results[stage]['max_abs_difference']:.2e}", f"{results[stage]['largest_lora_B']:.2e}"]
            for stage in STAGES]
    body = [f"Tiny random model (float32), cue -> word; SFT on {args.examples} gold labels for {args.epochs} epochs "
            f"(global batch 4), then GRPO {args.steps} steps of 2 examples x 4 rollouts. One torch thread per "
            f"process. Wall s (whole launched compile, process start included): {results['wall_s']}.", "",
            *markdown_table(["stage", "max abs diff, 2 vs 1 process", "largest LoRA B entry"], rows, align="lrr"),
            "", "GRPO's two runs sample different rollouts (each rank draws its own), so its difference is not the "
            "equality check; its mean reward per step: 1 process "
            f"{results['grpo']['mean_reward_1']}, 2 processes {results['grpo']['mean_reward_2']}."]
    goals = [Goal.at_most("SFT adapter, max abs difference 2 vs 1 process", results["finetune"]["max_abs_difference"],
                          1e-5)]
    run.finish("Weights stages on 2 CPU processes (accelerate launch) vs 1", results, body, goals=goals)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
