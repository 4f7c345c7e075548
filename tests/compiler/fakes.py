"""Scripted tasks for compiler tests: an LM whose answers depend on the demos in its prompt."""

from __future__ import annotations

import uuid

import dspy

from flowopt.testing import scripted_lm

CATS = "abc"


def _model(kwargs):
    # A fresh model name per LM: DSPy's disk cache is shared by the whole test session.
    kwargs.setdefault("model", f"scripted/{uuid.uuid4().hex[:10]}")
    return kwargs


def reverse_answer(question: str) -> str:
    return "#" + question[::-1]


def demo_task_lm(*, latency_s: float = 0.0, cache: bool = True, needed: int = 2, **kwargs):
    """Answers right only if the prompt carries ``needed`` demos in the right format (answers with '#')."""

    def answer(req):
        q = req.inputs.get("question", "")
        good = sum(1 for d in req.demos if str(d.get("answer", "")).startswith("#")) >= needed
        return {"answer": reverse_answer(q) if good else q}

    return scripted_lm(answer, latency_s=latency_s, cache=cache, **_model(kwargs))


def category_lm(*, latency_s: float = 0.0, cache: bool = True, **kwargs):
    """Answers right only if a well-formed demo of the question's category ('a:', 'b:', 'c:') is shown."""

    def answer(req):
        q = req.inputs.get("question", "")
        cats = {str(d.get("question", "")).split(":")[0] for d in req.demos
                if str(d.get("answer", "")).startswith("#")}
        return {"answer": reverse_answer(q) if q.split(":")[0] in cats else q}

    return scripted_lm(answer, latency_s=latency_s, cache=cache, **_model(kwargs))


def examples(n: int, start: int = 0, *, categories: bool = False) -> list[dspy.Example]:
    out = []
    for i in range(start, start + n):
        q = f"{CATS[i % 3]}:w{i}" if categories else f"word{i}"
        out.append(dspy.Example(question=q, answer=reverse_answer(q)).with_inputs("question"))
    return out


def exact(example, pred, trace=None) -> bool:
    return example.answer == pred.answer
