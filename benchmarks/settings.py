"""``flowopt bench`` settings: every command-line value checked before a file is written or an LM called.

:func:`plan_bench` turns the parsed arguments into a :class:`BenchPlan` (protocol, program, stages,
splits) or raises :class:`~flowopt.errors.ConfigError` naming the setting and its fix.

Example:
    >>> from flowopt.benchmarks.cli import bench_parser
    >>> plan = plan_bench(bench_parser().parse_args(["gsm8k-aflow", "--stages", "none", "--test", "5"]))
    >>> plan.stage_names, len(plan.testset)
    ([], 5)
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowopt.errors import ConfigError

from .datasets import Protocol, get_protocol, load_split
from .lms import make_lm
from .programs import build_program

#: The values ``--stages`` accepts besides a comma-separated list of stage names.
NO_STAGES = ("none",)


@dataclass
class BenchPlan:
    """What one ``flowopt bench`` run does, built from checked settings."""

    proto: Protocol
    program: Any
    stage_names: list[str]
    stages: list[Any]
    trainset: list[Any]
    valset: list[Any]
    testset: list[Any]
    out: Path


def _at_least(args: argparse.Namespace, name: str, low: float, fix: str | None = None) -> None:
    value = getattr(args, name)
    if value is not None and value < low:
        flag = "--" + name.replace("_", "-")
        raise ConfigError(f"{flag} must be >= {low:g}, got {value}", fix=fix or f"pass {flag} {low:g} or more")


def _check_numbers(args: argparse.Namespace) -> None:
    _at_least(args, "train", 1, "pass --train 1 or more (the examples the stages learn from)")
    _at_least(args, "dev", 1, "pass --dev 1 or more (the validation examples each stage is kept on)")
    _at_least(args, "test", 1, "pass --test 1 or more (the report-split examples)")
    _at_least(args, "candidates", 1)
    _at_least(args, "demos", 0, "pass --demos 0 or more, or leave it out for each stage's default")
    _at_least(args, "rounds", 1, "pass --rounds 1 or more, or leave it out for the stage's default")
    _at_least(args, "max_tokens", 1)
    _at_least(args, "threads", 1)
    _at_least(args, "lm_batch", 1)
    _at_least(args, "grpo_batch", 1, "pass --grpo-batch 1 or more (questions per GRPO step)")
    _at_least(args, "epochs", 1)
    _at_least(args, "grpo_steps", 1)
    _at_least(args, "group_size", 2, "pass --group-size 2 or more (GRPO compares answers within a group)")
    _at_least(args, "max_lm_calls", 1, "pass --max-lm-calls 1 or more, or leave it out for no limit")
    _at_least(args, "max_cost_usd", 0, "pass --max-cost-usd 0 or more, or leave it out")
    _at_least(args, "max_wall_s", 0, "pass --max-wall-s 0 or more, or leave it out")


def parse_stage_names(text: str) -> list[str]:
    """``"demos,search"`` -> ``["demos", "search"]``; ``"none"`` -> ``[]``; unknown names raise.

    Example:
        >>> parse_stage_names("none"), parse_stage_names(" demos , finetune ")
        ([], ['demos', 'finetune'])
    """
    from flowopt.compiler.stages import get_stage

    if text.strip().lower() in NO_STAGES:
        return []
    names = [s.strip() for s in text.split(",")]
    if not all(names):
        raise ConfigError(f"--stages {text!r} has an empty stage name",
                          fix="pass comma-separated names such as --stages demos,search, or --stages none")
    for name in names:
        get_stage(name)  # raises ConfigError listing the known stages
    if len(set(names)) != len(names):
        raise ConfigError(f"--stages {text!r} names a stage twice", fix="name each stage once")
    return names


def build_stage(name: str, args: argparse.Namespace) -> Any:
    """The stage object for ``name`` with the command line's settings (others take the stage's defaults)."""
    demos = args.demos
    if name == "search":
        few = {} if demos is None else {"max_labeled_demos": demos, "max_demos": min(demos, 4)}
        return ("search", {"n_candidates": args.candidates, **few})
    if name == "demos" and demos is not None:
        return ("demos", {"max_bootstrapped_demos": min(demos, 4), "max_labeled_demos": demos})
    if name == "labeled" and demos is not None:
        return ("labeled", {"k": demos})
    if name == "structure" and args.rounds is not None:
        return ("structure", {"max_rounds": args.rounds})
    if name == "finetune":
        from flowopt.optimizers.weights import BootstrapFinetune

        teacher = None
        if args.teacher:
            teacher, _ = make_lm(args.teacher, api_base=args.api_base, max_tokens=args.max_tokens)
        return BootstrapFinetune(student=args.student, teacher=teacher, epochs=args.epochs,
                                 labels=None if args.labels == "none" else args.labels,
                                 exclude_demos=args.exclude_demos)
    if name == "grpo":
        from flowopt.optimizers.weights import GRPO

        return GRPO(student=args.student, steps=args.grpo_steps, batch_size=args.grpo_batch,
                    group_size=args.group_size, max_new_tokens=args.max_tokens)
    return name


def _check_out_folder(out: Path) -> None:
    """--out must be a folder or creatable as one: neither it nor any folder above it may be a file."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder", fix="pass a folder path (new or an earlier run's)")
    blocking = next((parent for parent in out.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"--out {out} lies under {blocking}, which is a file, so the folder cannot be created",
                          fix=f"pass a folder path outside {blocking}, or move that file away")


def plan_bench(args: argparse.Namespace) -> BenchPlan:
    """Check every setting and build the run; nothing is written and no LM is called."""
    out = Path(args.out)
    _check_out_folder(out)
    if args.resume and not any((out / name).exists() for name in ("results.json", "run", "evals")):
        raise ConfigError(f"--resume: {out} holds no earlier run", fix="drop --resume or point --out at an earlier run")
    _check_numbers(args)
    if args.labels == "only" and args.teacher:
        raise ConfigError("--labels only and --teacher contradict each other",
                          fix="use --labels mix to add teacher traces to the labels, or drop --teacher")
    if args.student and args.student.removeprefix("local/") not in _embedded() and not Path(args.student).is_dir():
        raise ConfigError(f"--student {args.student!r} is neither an embedded model nor a model folder",
                          fix=f"pass --student {next(iter(_embedded()))} or a folder with a transformers model")
    names = parse_stage_names(args.stages)
    if args.exclude_demos and "finetune" not in names:
        raise ConfigError("--exclude-demos only applies to the finetune stage, which --stages lacks",
                          fix="add finetune to --stages or drop --exclude-demos")
    if args.labels != "none" and "finetune" not in names:
        raise ConfigError(f"--labels {args.labels} only applies to the finetune stage, which --stages lacks",
                          fix="add finetune to --stages or drop --labels")
    proto = get_protocol(args.protocol)
    program = build_program(proto.name, args.program)
    trainset, valset = _train_and_dev(proto, args.train, args.dev, args.seed)
    testset = load_split(proto, proto.report_split, limit=args.test, seed=args.seed)
    if len(testset) < args.test:
        raise ConfigError(f"--test {args.test} exceeds the {len(testset)} examples of {proto.name}'s "
                          f"{proto.report_split} split", fix=f"pass --test {len(testset)} or fewer")
    stages = [build_stage(name, args) for name in names]
    return BenchPlan(proto, program, names, stages, trainset, valset, testset, out)


def _embedded() -> tuple[str, ...]:
    from flowopt.lm.gemma import ALIASES

    return tuple(ALIASES)


def _train_and_dev(proto: Protocol, n_train: int, n_dev: int, seed: int) -> tuple[list, list]:
    if proto.train_split != proto.search_split:
        train = load_split(proto, proto.train_split, limit=n_train, seed=seed)
        dev = load_split(proto, proto.search_split, limit=n_dev, seed=seed)
        for flag, n, got, split in (("--train", n_train, train, proto.train_split),
                                    ("--dev", n_dev, dev, proto.search_split)):
            if len(got) < n:
                raise ConfigError(f"{flag} {n} exceeds the {len(got)} examples of {proto.name}'s {split} split",
                                  fix=f"pass {flag} {len(got)} or fewer")
        return train, dev
    # One split serves both (AFlow's protocols): disjoint slices of one seeded shuffle.
    pool = load_split(proto, proto.train_split)
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    if n_train + n_dev > len(pool):
        raise ConfigError(f"--train {n_train} + --dev {n_dev} exceeds the {len(pool)} examples of "
                          f"{proto.name}'s {proto.train_split} split", fix="lower --train or --dev")
    return [pool[i] for i in order[:n_train]], [pool[i] for i in order[n_train:n_train + n_dev]]
