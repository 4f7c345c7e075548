"""Nodes run in dependency order; independent branches run at the same time with the caller's context."""

import threading

import dspy
import pytest

import flowopt
from flowopt.modules import Predict
from flowopt.testing import scripted_lm


def branchy() -> flowopt.Workflow:
    return (flowopt.Workflow("question -> answer")
            .add("left", Predict("question -> a"))
            .add("right", Predict("question -> b"))
            .add("join", Predict("question, a, b -> answer")))


def test_values_flow_along_edges():
    def answer(request):
        if "answer" in request.output_fields:
            return {"answer": f"{request.inputs['a']}+{request.inputs['b']}"}
        field = request.output_fields[0]
        return {field: f"{field}({request.inputs['question']})"}

    dspy.configure(lm=scripted_lm(answer))
    assert branchy()(question="q").answer == "a(q)+b(q)"


def test_independent_branches_overlap_and_see_the_callers_context():
    both_started = threading.Barrier(2, timeout=5)
    threads = set()

    def answer(request):
        threads.add(threading.get_ident())
        if "answer" in request.output_fields:
            return {"answer": "done"}
        both_started.wait()  # deadlocks (BrokenBarrierError) unless left and right run at the same time
        return {request.output_fields[0]: "x"}

    # The LM is set only through dspy.context in this thread: worker threads must inherit it.
    with dspy.context(lm=scripted_lm(answer, cache=False)):
        assert branchy()(question="q").answer == "done"
    assert len(threads) >= 2


def test_a_chain_runs_in_the_callers_thread():
    seen = []
    dspy.configure(lm=scripted_lm(lambda r: seen.append(threading.get_ident()) or {r.output_fields[0]: "v"}))
    flowopt.chain("question -> answer", Predict("question -> draft"), Predict("draft -> answer"))(question="q")
    assert seen == [threading.get_ident()] * 2


def test_trace_is_recorded_from_worker_threads():
    dspy.configure(lm=scripted_lm(lambda r: {f: "v" for f in r.output_fields}))
    with dspy.context(trace=[]):
        branchy()(question="q")
        trace = dspy.settings.trace
    assert len(trace) == 3


def test_a_failing_node_raises_in_the_caller():
    def answer(request):
        if "b" in request.output_fields:
            raise RuntimeError("boom")
        return {f: "v" for f in request.output_fields}

    dspy.configure(lm=scripted_lm(answer, num_retries=0, cache=False))
    with pytest.raises(Exception, match="boom"):
        branchy()(question="q")
