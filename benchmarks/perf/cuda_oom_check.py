"""CUDA out of memory in a real SFT step becomes flowopt's OutOfMemoryError naming the setting to lower.

Run on a GPU machine (meant to take under a minute on an H100 or H200):
    python -m flowopt.benchmarks.perf.cuda_oom_check --device cuda

A random Llama-shaped model (width 2048, 8 layers: about 0.34 B parameters) is fine-tuned by
``BootstrapFinetune`` inside ``flowopt.compile`` with a deliberately huge micro-batch (256 sequences of
about 1,500 tokens in one forward pass: some 250 GiB of activations), so the first training step
meets ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``) from CUDA's allocator. The script
checks that the compile stops with :class:`flowopt.errors.OutOfMemoryError` caused by it, naming
``micro_batch_size`` with its value and the halved one to try, that the run folder holds only the
kept baseline, and that the GPU memory the failed step took was released; then it resumes the same run
folder with ``--resume-micro-batch`` and checks that the stage finishes. Writes
``benchmarks/results/cuda_oom_check.{json,md}``; the exit status is 1 when a check fails.

Without CUDA (or with ``--device cpu``) the CUDA part is skipped with a message saying so, and the same
compile runs at ``--smoke`` sizes on the CPU with a micro-batch that fits, which checks the script's
plumbing (the slow suite runs it that way).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run

logger = logging.getLogger(__name__)

SMOKE = {"hidden": 64, "layers": 2, "micro_batch": 4, "noise_repeats": 2, "resume_micro_batch": 2}


def _compile(local: Any, run_dir: Path, trainset: list[Any], valset: list[Any], micro: int, resume: bool) -> Any:
    """The fine-tune compile: gold labels, one epoch, the whole trainset as one batch of ``micro``-sized pieces."""
    import dspy

    import flowopt
    from flowopt.benchmarks import cue_word
    from flowopt.lm import AutoAdapter
    from flowopt.modules import Predict
    from flowopt.optimizers.weights import BootstrapFinetune, LoraSettings

    wf = flowopt.Workflow("noise, cue -> word", name="cue-word")
    wf.add("solve", Predict(dspy.Signature("noise, cue -> word", "Answer.")), lm="default")
    wf.lms["default"] = local.lm.copy(cache=False)
    # No token bound: the micro-batch size alone decides what one forward pass holds.
    stage = BootstrapFinetune(labels="only", epochs=1, batch_size=len(trainset), micro_batch_size=micro,
                              micro_batch_tokens=None, max_length=2048, lora=LoraSettings(r=4, alpha=8))
    with dspy.context(adapter=AutoAdapter()):
        return flowopt.compile(wf, trainset, cue_word.metric, valset=valset, stages=[stage], run_dir=run_dir,
                               resume=resume, quiet=True, num_threads=1)


def _out_of_memory(local: Any, run_dir: Path, trainset: list[Any], valset: list[Any], micro: int) -> dict[str, Any]:
    """Compile with a micro-batch that cannot fit; what was raised, and what the GPU and run folder kept."""
    import torch

    from flowopt.errors import OutOfMemoryError

    seen: dict[str, Any] = {"micro_batch_size": micro}
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        _compile(local, run_dir, trainset, valset, micro, resume=False)
        seen["raised"] = None
    except OutOfMemoryError as err:
        seen.update(raised=type(err).__name__, cause=type(err.__cause__).__name__,
                    cause_is_cuda_oom=isinstance(err.__cause__, torch.cuda.OutOfMemoryError),
                    message=str(err), settings=err.settings)
    seen["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    seen["allocated_before_gib"] = round(before / 2**30, 3)
    seen["allocated_after_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    seen["files_after_error"] = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    return seen


def _checks(oom: dict[str, Any], resumed: dict[str, Any]) -> list[tuple[str, bool]]:
    micro = oom["micro_batch_size"]
    message = oom.get("message", "")
    return [
        ("the compile raised flowopt's OutOfMemoryError", oom["raised"] == "OutOfMemoryError"),
        ("its cause is torch.cuda.OutOfMemoryError", bool(oom.get("cause_is_cuda_oom"))),
        (f"it names micro_batch_size={micro} and the value to try", f"micro_batch_size={micro} -> {micro // 2}"
         in message),
        ("its settings carry the micro-batch size", (oom.get("settings") or {}).get("micro_batch_size") == micro),
        ("only the baseline was kept in the run folder", oom["files_after_error"] == ["compile.json"]),
        # What may stay: the new LoRA adapter and its optimizer state (megabytes), not the step's activations.
        ("the failed step's GPU memory was released", oom["allocated_after_gib"] <= oom["allocated_before_gib"] + 1),
        ("the resumed run kept the baseline", bool(resumed.get("baseline_resumed"))),
        ("the resumed run with the smaller micro-batch finished", resumed.get("stop_reason") == "done"),
    ]


def _save_model(folder: Path, hidden: int, layers: int) -> Path:
    """A random word-level model over the task's vocabulary, saved where LocalLM (and the run folder) find it."""
    from flowopt.benchmarks import cue_word
    from flowopt.benchmarks.perf.weights_distributed import LABELS
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    words = [*cue_word.COLORS, *cue_word.ANIMALS, *cue_word.NOISE, *LABELS]
    model, tokenizer = tiny_causal_lm(words, hidden_size=hidden, layers=layers, heads=max(1, hidden // 128), seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _data(args: Any, count: int) -> tuple[list[Any], list[Any]]:
    from flowopt.benchmarks import cue_word

    noise = " ".join(cue_word.NOISE * args.noise_repeats)  # about 8 tokens a repeat (180: about 1,500 a prompt)
    trainset = [ex.copy(noise=noise) for ex in cue_word.make_examples(count, seed=1)]
    valset = [ex.copy(noise=noise) for ex in cue_word.make_examples(2, seed=2)]
    return trainset, valset


def _resumed_row(best: Any) -> dict[str, Any]:
    rows = {row.name: row.to_dict() for row in best.report.stages}
    return {"baseline_resumed": rows["baseline"]["resumed"], "stop_reason": rows["finetune"]["stop_reason"]}


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("cuda_oom_check", __doc__, smoke=SMOKE)
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the plumbing only)")
    parser.add_argument("--hidden", type=int, default=2048, help="width of the random model")
    parser.add_argument("--layers", type=int, default=8, help="layers of the random model")
    parser.add_argument("--micro-batch", type=int, default=256, help="sequences in one forward pass (too many)")
    parser.add_argument("--noise-repeats", type=int, default=180, help="prompt length: about 8 tokens each")
    parser.add_argument("--resume-micro-batch", type=int, default=8, help="micro-batch of the resumed run")
    run = start_run(parser, argv)
    args = run.args
    import torch

    from flowopt.lm.local import LocalLM

    cuda = args.device == "cuda" and torch.cuda.is_available()
    skipped = None if cuda else (f"CUDA is not available (torch {torch.__version__}, --device {args.device}): the "
                                 "CUDA out-of-memory check is skipped; the compile ran on the CPU at --smoke sizes "
                                 "with a micro-batch that fits")
    if skipped:
        logger.warning("%s", skipped)
        args = argparse.Namespace(**{**vars(args), **SMOKE})  # the plumbing only: the smallest sizes
    results: dict[str, Any] = {"device": "cuda" if cuda else "cpu", "cuda_check": skipped or "ran"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = _save_model(Path(tmp) / "model", args.hidden, args.layers)
        local = LocalLM(str(folder), name="random", device="cuda" if cuda else "cpu", max_new_tokens=2,
                        progress=False)
        trainset, valset = _data(args, args.micro_batch)
        run_dir = Path(tmp) / "run"
        if cuda:
            results["out_of_memory"] = _out_of_memory(local, run_dir, trainset, valset, args.micro_batch)
            best = _compile(local, run_dir, trainset, valset, args.resume_micro_batch, resume=True)
        else:  # the plumbing: the same compile, with a micro-batch that fits on the CPU
            best = _compile(local, run_dir, trainset, valset, args.resume_micro_batch, resume=False)
        results["resumed" if cuda else "cpu_run"] = _resumed_row(best)
        results["parameters_m"] = round(sum(p.numel() for p in local.base_model.parameters()) / 1e6, 1)
        local.close()
    checks = _checks(results["out_of_memory"], results["resumed"]) if cuda else []
    results["checks"] = {name: ok for name, ok in checks}
    rows = [[name, "yes" if ok else "**NO**"] for name, ok in checks] or [["CUDA check", skipped]]
    body = [f"Model: random Llama-shaped, width {args.hidden}, {args.layers} layers ({results['parameters_m']} M "
            f"parameters); {args.micro_batch} sequences of about {round(8.3 * args.noise_repeats)} tokens in one "
            f"micro-batch, then a resume with micro_batch_size={args.resume_micro_batch}.", "",
            *markdown_table(["check", "result"], rows, align="ll")]
    if cuda:
        oom = results["out_of_memory"]
        body += ["", f"Error: `{oom.get('message', '(none raised)')[:600]}`", "",
                 f"GPU memory: peak {oom['peak_allocated_gib']} GiB in the failed step; allocated "
                 f"{oom['allocated_before_gib']} GiB before it and {oom['allocated_after_gib']} GiB after."]
    run.finish("CUDA out of memory in an SFT step: flowopt's OutOfMemoryError and a resume", results, body)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
