"""Ctrl-C during compile(), in this process: a real SIGINT, sent by the LM itself at its fifth call (so it
lands inside the compile, on the main thread's handler), stops at the next safe point with Interrupted
(exit status 130), and a resume gives the uninterrupted run's program.

The same for SIGTERM mid-search, and the exit status of a real process, run as subprocesses in
``tests/faults/test_signals.py``.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from fakes import exact, examples, reverse_answer

import flowopt
from flowopt.compiler.interrupt import stop_on_signals
from flowopt.errors import Interrupted
from flowopt.modules import Predict
from flowopt.testing import scripted_lm


def _compile(lm, run_dir, *, resume: bool = False) -> flowopt.Workflow:
    import dspy

    with dspy.context(lm=lm):
        return flowopt.compile(flowopt.chain("question -> answer", Predict("question -> answer")),
                               examples(9, categories=True), exact, valset=examples(12, 100, categories=True),
                               stages=[("demos", {"max_labeled_demos": 3})], seed=7, run_dir=run_dir,
                               resume=resume, quiet=True, num_threads=1)


def _task_lm(model: str, calls: list[int], *, interrupt_at: int | None = None):
    def answer(req):
        calls.append(1)
        if len(calls) == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered to the main thread
        q = req.inputs.get("question", "")
        cats = {str(d.get("question", "")).split(":")[0] for d in req.demos
                if str(d.get("answer", "")).startswith("#")}
        return {"answer": reverse_answer(q) if q.split(":")[0] in cats else q}

    return scripted_lm(answer, model=model)


def test_ctrl_c_in_the_baseline_stops_with_130_and_resume_equals_the_uninterrupted_run(tmp_path):
    model = f"scripted/interrupt-{os.getpid()}-{tmp_path.name}"  # DSPy's disk cache is shared by the session
    before = signal.getsignal(signal.SIGINT)
    stopped_calls: list[int] = []
    with pytest.raises(Interrupted) as caught:
        _compile(_task_lm(model, stopped_calls, interrupt_at=5), tmp_path / "run")
    assert caught.value.signal == "SIGINT" and caught.value.exit_code == 130
    assert "safe point" in str(caught.value) and "resume" in str(caught.value)
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C behaves as before once compile() returned
    assert len(stopped_calls) < 12  # stopped inside the baseline (12 validation examples)
    assert not (tmp_path / "run" / "report.json").exists()
    for path in (tmp_path / "run").rglob("*.json"):  # every file left is whole
        json.loads(path.read_text())

    resumed_calls: list[int] = []
    resumed = _compile(_task_lm(model, resumed_calls), tmp_path / "run", resume=True)
    reference_calls: list[int] = []
    reference = _compile(_task_lm(f"{model}-reference", reference_calls), tmp_path / "reference")
    assert resumed.canonical_json() == reference.canonical_json()
    # Paid twice: at most the call in flight when the signal came (one thread).
    assert len(stopped_calls) + len(resumed_calls) - len(reference_calls) <= 1


def test_stop_on_signals_asks_once_then_restores_the_handlers():
    seen: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    with stop_on_signals(seen.append) as request:
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before the next statement
        assert seen == ["SIGINT"] and request.signal == "SIGINT" and request.number == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is before  # a second Ctrl-C stops at once, as without flowopt
    assert signal.getsignal(signal.SIGINT) is before
