"""Small workflows and a cheap structure-dependent score, shared by the structure search tests."""

from __future__ import annotations

import dspy
import pytest

from flowopt import Workflow
from flowopt.modules import ChainOfThought, Predict

BONUS = {"ChainOfThought": 0.10, "ScEnsemble": 0.15, "Refine": 0.08, "Programmer": 0.12}


def single() -> Workflow:
    """question -> answer with one Predict node that carries a demo."""
    wf = Workflow("question -> answer", name="single").add("solve", Predict("question -> answer"))
    wf.nodes["solve"].predict.demos = [dspy.Example(question="1+1?", answer="2")]
    return wf


def two_step() -> Workflow:
    """draft -> final, with demos and instructions on both nodes."""
    wf = (Workflow("question -> answer", name="two")
          .add("draft", Predict("question -> draft", instructions="Write a first draft."))
          .add("final", ChainOfThought("question, draft -> answer", instructions="Answer from the draft.")))
    wf.nodes["draft"].predict.demos = [dspy.Example(question="q", draft="d")]
    wf.nodes["final"].cot.predict.demos = [dspy.Example(question="q", draft="d", answer="a")]
    return wf


def with_context() -> Workflow:
    """A reader over a list of paragraphs (the shape Retrieve can be inserted into)."""
    return Workflow("question, context: list[str] -> answer", name="reader").add(
        "read", ChainOfThought("question, context: list[str] -> answer"))


def toy_score(wf: Workflow) -> float:
    """Known structure effects without any LM: operators add fixed amounts, size costs a little."""
    score = 0.3
    for op in wf.nodes.values():
        score += BONUS.get(op.op_name, 0.0)
        score += 0.01 * getattr(op, "n", 0) + 0.02 * (getattr(op, "max_rounds", 1) - 1)
    return round(min(score, 1.0) - 0.03 * len(wf.nodes), 6)


class Toys:
    single = staticmethod(single)
    two_step = staticmethod(two_step)
    with_context = staticmethod(with_context)
    score = staticmethod(toy_score)


@pytest.fixture
def toys() -> type[Toys]:
    return Toys
