"""Baseline programs per benchmark protocol: ``predict``, ``cot`` and a multi-node ``workflow``.

Example:
    >>> from flowopt.benchmarks.programs import build_program, program_names
    >>> program_names("gsm8k-aflow")
    ['cot', 'predict', 'workflow']
    >>> build_program("hotpotqa-aflow", "workflow").node_ids
    ['retrieve', 'answer']
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flowopt import Workflow
from flowopt.errors import ConfigError
from flowopt.modules import ChainOfThought, Predict, Programmer, Refine, Retrieve
from flowopt.workflow import load

from .datasets import get_protocol


def _gsm8k(kind: str) -> Workflow:
    wf = Workflow("question -> answer", name=f"gsm8k-{kind}")
    if kind == "predict":
        return wf.add("solve", Predict("question -> answer"))
    if kind == "cot":
        return wf.add("solve", ChainOfThought("question -> answer"))
    # Reason and compute independently (they run concurrently), then pick the answer.
    return (wf.add("reason", ChainOfThought("question -> reasoned_answer"))
              .add("compute", Programmer("question -> computed_answer", on_failure="empty"))
              .add("select", Predict(
                  "question, reasoned_answer, computed_answer -> answer",
                  "Two methods answered a math word problem; computed_answer is empty when the program "
                  "failed. Give the final numeric answer.")))


def _hotpot_context(kind: str) -> Workflow:
    wf = Workflow("question, context: list[str] -> answer", name=f"hotpotqa-{kind}")
    if kind == "predict":
        return wf.add("answer", Predict("question, context: list[str] -> answer"))
    if kind == "cot":
        return wf.add("answer", ChainOfThought("question, context: list[str] -> answer"))
    # Keep the 2 paragraphs that best match the question (BM25) and answer from them directly: a fifth of
    # AFlow's 10-paragraph prompt, so a small model on a CPU reads (and trains on) far fewer tokens.
    return (wf.add("retrieve", Retrieve(k=2))
              .add("answer", Predict("question, passages: list[str] -> answer",
                                     "Answer with a short span (a few words) copied from the passages.")))


def _hotpot_closedbook(kind: str) -> Workflow:
    wf = Workflow("question -> answer", name=f"hotpotqa-closedbook-{kind}")
    if kind == "predict":
        return wf.add("answer", Predict("question -> answer"))
    if kind == "cot":
        return wf.add("answer", ChainOfThought("question -> answer"))
    return wf.add("answer", Refine("question -> answer", "Answer with a short span (a few words).", max_rounds=1))


_BUILDERS: dict[str, Callable[[str], Workflow]] = {
    "gsm8k-dspy": _gsm8k,
    "gsm8k-aflow": _gsm8k,
    "hotpotqa-aflow": _hotpot_context,
    "hotpotqa-closedbook": _hotpot_closedbook,
}
PROGRAMS = ("cot", "predict", "workflow")


def program_names(protocol: str) -> list[str]:
    get_protocol(protocol)
    return list(PROGRAMS)


def build_program(protocol: str, name: str) -> Workflow:
    """A fresh baseline program for ``protocol`` (``predict``, ``cot`` or ``workflow``), or the saved program
    in the ``.json`` file ``name`` (an earlier run's ``compiled.json``: later stages continue from it)."""
    proto = get_protocol(protocol)
    if name.endswith(".json"):
        return _saved_program(proto.name, Path(name))
    if name not in PROGRAMS:
        raise ConfigError(f"unknown program {name!r} for {proto.name}",
                          fix=f"use one of {list(PROGRAMS)}, or a program file saved by Workflow.save")
    return _BUILDERS[proto.name](name)


def _saved_program(protocol: str, path: Path) -> Workflow:
    """A saved workflow whose inputs and outputs are those of ``protocol``'s programs."""
    program = load(path)  # refuses a file that routes credentials (api_base and the like) on its own
    expected = _BUILDERS[protocol]("predict").io
    got = (program.io.input_names, program.io.output_names)
    if got != (expected.input_names, expected.output_names):
        raise ConfigError(f"the program in {path} maps {got[0]} -> {got[1]}, but {protocol}'s examples give "
                          f"{expected.input_names} -> {expected.output_names}",
                          fix=f"pass a program saved from a {protocol} run (its compiled.json)")
    return program
