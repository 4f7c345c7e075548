"""``python -m flowopt.optimizers.weights``: compile a saved workflow with the weights stages, on one process
or launched on several (``accelerate launch [--cpu] --num_processes N -m flowopt.optimizers.weights ...``).

The workflow is a JSON file (``Workflow.save``), the data JSON Lines (one example per line, the input
fields named by ``--inputs``), the metric ``module:function``. Each ``--stage`` (``finetune``, ``grpo``,
in order) takes settings as ``--set STAGE.KEY=VALUE`` (VALUE read as JSON, else as a string). The best
program goes to ``RUN_DIR/program.json``; ``--resume`` continues an interrupted run.

Example::

    accelerate launch --num_processes 2 -m flowopt.optimizers.weights --program wf.json \\
        --trainset train.jsonl --inputs question --metric mytask:exact_match \\
        --stage grpo --set grpo.steps=50 --set grpo.group_size=8 --run-dir runs/grpo
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowopt.errors import ConfigError, DataError

logger = logging.getLogger("flowopt.optimizers.weights")


def read_examples(path: Path, inputs: Sequence[str]) -> list[Any]:
    """``dspy.Example`` objects from a JSON Lines file, with ``inputs`` as their input fields."""
    import dspy

    if not path.is_file():
        raise DataError(f"no data file at {path}", fix="pass a JSON Lines file, one example object per line")
    examples = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number} is not JSON ({err.msg})", fix="write one JSON object per line") from err
        missing = [name for name in inputs if name not in row]
        if not isinstance(row, dict) or missing:
            raise DataError(f"{path}:{number} lacks the input fields {missing or list(inputs)}",
                            fix="give every example the fields named by --inputs")
        examples.append(dspy.Example(**row).with_inputs(*inputs))
    return examples


def load_metric(spec: str) -> Any:
    """The function ``module:function`` names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--metric {spec!r} is not module:function", fix="pass e.g. --metric mytask:exact_match")
    try:
        metric = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"--metric {spec!r} cannot be imported ({err})",
                          fix="make the module importable (PYTHONPATH) and check the function's name") from err
    if not callable(metric):
        raise ConfigError(f"--metric {spec!r} is not callable", fix="name a function metric(example, pred, trace)")
    return metric


def stage_settings(stages: Sequence[str], assignments: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """``[(stage, settings)]`` from ``--stage`` names and ``--set STAGE.KEY=VALUE`` assignments.

    Example:
        >>> stage_settings(["grpo"], ["grpo.steps=5", "grpo.scaling=batch"])
        [('grpo', {'steps': 5, 'scaling': 'batch'})]
    """
    settings: dict[str, dict[str, Any]] = {name: {} for name in stages}
    for assignment in assignments:
        target, sep, raw = assignment.partition("=")
        stage, dot, key = target.partition(".")
        if not sep or not dot or stage not in settings:
            raise ConfigError(f"--set {assignment!r} does not name one of the stages {list(settings)}",
                              fix="write --set STAGE.KEY=VALUE, e.g. --set grpo.steps=20")
        try:
            settings[stage][key] = json.loads(raw)
        except json.JSONDecodeError:
            settings[stage][key] = raw
    return [(name, settings[name]) for name in stages]


def build_stages(pairs: Sequence[tuple[str, dict[str, Any]]]) -> list[Any]:
    from flowopt.optimizers.weights import GRPO, BootstrapFinetune, LoraSettings

    kinds = {"finetune": BootstrapFinetune, "grpo": GRPO}
    stages = []
    for name, settings in pairs:
        if name not in kinds:
            raise ConfigError(f"--stage {name!r} is not a weights stage", fix="pass --stage finetune or --stage grpo")
        if isinstance(settings.get("lora"), dict):
            settings = {**settings, "lora": LoraSettings(**settings["lora"])}
        try:
            stages.append(kinds[name](**settings))
        except TypeError as err:
            raise ConfigError(f"--set for {name}: {err}", fix=f"use the settings of {kinds[name].__name__}") from err
    return stages


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowopt.optimizers.weights", description=__doc__.splitlines()[0])
    parser.add_argument("--program", type=Path, required=True, help="workflow JSON (Workflow.save)")
    parser.add_argument("--trainset", type=Path, required=True, help="JSON Lines, one example per line")
    parser.add_argument("--valset", type=Path, help="JSON Lines (default: a seeded split of the trainset)")
    parser.add_argument("--inputs", required=True, help="the input fields, comma-separated")
    parser.add_argument("--metric", required=True, help="module:function")
    parser.add_argument("--stage", action="append", required=True, choices=["finetune", "grpo"])
    parser.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import flowopt
    from flowopt.compiler.processes import launched_processes
    from flowopt.optimizers.weights.distributed import current_world

    current_world()  # join the process group (and take this rank's GPU) before the workflow loads its model
    inputs = [name.strip() for name in args.inputs.split(",") if name.strip()]
    stages = build_stages(stage_settings(args.stage, args.set))
    trainset = read_examples(args.trainset, inputs)
    valset = read_examples(args.valset, inputs) if args.valset else None
    program = flowopt.load(args.program)
    best = flowopt.compile(program, trainset, load_metric(args.metric), valset=valset, stages=stages,
                           seed=args.seed, run_dir=args.run_dir, resume=args.resume, quiet=True)
    rank, processes = launched_processes()
    if rank == 0:
        logger.info("best program (score %s, %d process(es)): %s", best.report.best_score, processes,
                    args.run_dir / "program.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
