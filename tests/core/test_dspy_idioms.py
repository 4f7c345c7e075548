"""DSPy's own module idioms run against Workflows (a scripted LM stands in for the model).

The cases a client found failing (save/load both ways, acall/aforward, streamify on a branched
workflow) and the ones that held (deepcopy, reset_copy, Evaluate, batch, asyncify, set_lm, ...).
"""

from __future__ import annotations

import asyncio
import json
import pickletools
import re

import dspy
import pytest
from dspy.streaming import StreamListener, StreamResponse

import flowopt
from flowopt.errors import WorkflowError
from flowopt.modules import ChainOfThought, Custom, Predict, Programmer, Refine, Retrieve, ScEnsemble
from flowopt.program_files import DSPY_STATE, FLOWOPT_DOCUMENT
from flowopt.testing import AsyncScriptedEngine, ScriptedEngine, scripted_lm


def answer_fields(req):
    question = req.inputs.get("question", "?")
    fixed = {"is_correct": "True", "best_index": "1"}
    return {field: fixed.get(field, f"{field} of {question}") for field in req.output_fields}


@pytest.fixture
def lm():
    lm = scripted_lm(answer_fields, cache=False)
    with dspy.context(lm=lm):
        yield lm


def branched() -> flowopt.Workflow:
    """Two independent branches feeding a final node."""
    return (flowopt.Workflow("question -> answer", name="branched")
            .add("left", Predict("question -> notes_a"))
            .add("right", ChainOfThought("question -> notes_b"))
            .add("final", Predict("question, notes_a, notes_b -> answer")))


def with_demos() -> flowopt.Workflow:
    wf = branched()
    wf.nodes["left"].predict.demos = [dspy.Example(question="q0", notes_a="n0")]
    wf.nodes["final"].predict.signature = wf.nodes["final"].predict.signature.with_instructions("Be brief.")
    return wf


# ---------------------------------------------------------------- save / load, both ways
def test_save_then_load_into_a_fresh_workflow_reads_flowopt_document(tmp_path):
    wf = with_demos()
    path = wf.save(tmp_path / "x.json")
    fresh = flowopt.Workflow()
    assert fresh.load(path) == FLOWOPT_DOCUMENT
    assert fresh.canonical_json() == wf.canonical_json()
    assert fresh.nodes["left"].predict.demos[0]["notes_a"] == "n0"


def test_save_program_folder_is_read_by_dspy_load_and_flowopt_load(tmp_path, lm):
    wf = with_demos()
    folder = wf.save(tmp_path / "prog", save_program=True)
    by_dspy = dspy.load(str(folder), allow_pickle=True)
    by_flowopt = flowopt.load(folder)
    assert isinstance(by_dspy, flowopt.Workflow)
    assert by_dspy.canonical_json() == by_flowopt.canonical_json() == wf.canonical_json()
    assert by_dspy(question="q").answer == "answer of q"
    # The pickle holds the document and one call, no code: its only global is the loader function.
    globals_in_pickle = [arg for op, arg, _ in pickletools.genops((folder / "program.pkl").read_bytes())
                         if op.name in ("GLOBAL", "STACK_GLOBAL", "SHORT_BINUNICODE", "BINUNICODE")
                         and isinstance(arg, str) and len(arg) < 80]
    assert globals_in_pickle == ["flowopt.workflow", "workflow_from_program_json"]
    assert json.loads((folder / "metadata.json").read_text())["dependency_versions"]["dspy"] == dspy.__version__


def test_dspy_module_save_program_pickles_a_workflow(tmp_path):
    wf = with_demos()
    dspy.Module.save(wf, str(tmp_path / "prog"), save_program=True)  # was: cannot pickle '_thread.lock'
    assert dspy.load(str(tmp_path / "prog"), allow_pickle=True).canonical_json() == wf.canonical_json()


def test_save_program_refuses_a_path_with_a_suffix_or_a_file(tmp_path):
    with pytest.raises(WorkflowError, match="folder"):
        branched().save(tmp_path / "x.json", save_program=True)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(WorkflowError, match="is a file"):
        branched().save(tmp_path / "afile", save_program=True)


def test_load_reads_dspy_state_into_the_same_structure(tmp_path):
    dspy.Module.save(with_demos(), str(tmp_path / "state.json"))
    target = branched()
    assert target.load(tmp_path / "state.json") == DSPY_STATE
    assert target.nodes["left"].predict.demos[0]["notes_a"] == "n0"
    assert target.nodes["final"].predict.signature.instructions == "Be brief."


def test_load_of_dspy_state_from_another_program_names_the_predictor(tmp_path):
    dspy.Module.save(with_demos(), str(tmp_path / "state.json"))
    other = flowopt.Workflow("question -> answer").add("solo", Predict("question -> answer"))
    with pytest.raises(WorkflowError, match=re.escape("nodes['solo'].predict")):
        other.load(tmp_path / "state.json")
    assert other.node_ids == ["solo"]


def test_dspy_pickled_state_needs_allow_pickle(tmp_path):
    with_demos().save(tmp_path / "state.pkl")
    target = branched()
    with pytest.raises(ValueError, match="allow_pickle"):
        target.load(tmp_path / "state.pkl")
    assert target.load(tmp_path / "state.pkl", allow_pickle=True) == DSPY_STATE
    assert target.nodes["left"].predict.demos[0]["notes_a"] == "n0"


# ---------------------------------------------------------------- async
def test_acall_runs_independent_branches_concurrently():
    # Each call awaits 50 ms on the event loop, long enough for both branches' calls to overlap there.
    engine = AsyncScriptedEngine(ScriptedEngine(answer_fields, latency_s=0.05))
    lm = dspy.LM("scripted/lm", engine=engine.sync, async_engine=engine, cache=False)
    with dspy.context(lm=lm):
        result = asyncio.run(branched().acall(question="q"))
    assert result.answer == "answer of q"
    assert engine.peak_in_flight == 2  # left and right were awaited together, final after them


def test_acall_raises_the_failing_node_error():
    def failing(req):
        if "notes_b" in req.output_fields:
            raise RuntimeError("right branch broke")
        return answer_fields(req)

    with dspy.context(lm=scripted_lm(failing, cache=False)), pytest.raises(dspy.LMError, match="right branch broke"):
        asyncio.run(branched().acall(question="q"))


def test_acall_without_an_input_names_it():
    with pytest.raises(WorkflowError, match="question"):
        asyncio.run(branched().acall(topic="q"))


@pytest.mark.parametrize("op", [
    Predict("question -> answer"),
    ChainOfThought("question -> answer"),
    Custom("question -> answer", instruction="Answer."),
    Refine("question -> answer", max_rounds=2),
    ScEnsemble("question -> answer", n=3),
    ScEnsemble("question -> answer", n=2, select="lm"),
], ids=lambda op: type(op).op_name)
def test_every_lm_operator_answers_acall(op, lm):
    assert asyncio.run(op.acall(question="q")).answer == "answer of q"


def test_retrieve_answers_acall():
    op = Retrieve(k=1, corpus=["cats purr", "dogs bark"])
    assert asyncio.run(op.acall(question="do dogs bark")).passages == ["dogs bark"]


def test_programmer_answers_acall():
    with dspy.context(lm=scripted_lm(lambda req: {"reasoning": "r", "code": "print(6 * 7)"}, cache=False)):
        assert asyncio.run(Programmer("question -> answer").acall(question="6*7?")).answer == "42"


# ---------------------------------------------------------------- streaming
def stream_chunks(program, listener_predict) -> tuple[list[StreamResponse], dspy.Prediction]:
    streamed = dspy.streamify(program, stream_listeners=[StreamListener("answer", predict=listener_predict)])

    async def collect():
        return [value async for value in streamed(question="q")]

    values = asyncio.run(collect())
    return [v for v in values if isinstance(v, StreamResponse)], values[-1]


@pytest.mark.parametrize("is_async", [False, True])
def test_streamify_streams_the_final_node_of_a_branched_workflow(lm, is_async):
    wf = branched()
    streamed = dspy.streamify(wf, stream_listeners=[StreamListener("answer", predict=wf.nodes["final"].predict)],
                              is_async_program=is_async)

    async def collect():
        return [value async for value in streamed(question="q")]

    values = asyncio.run(collect())
    chunks = [v for v in values if isinstance(v, StreamResponse)]
    assert len(chunks) >= 3  # word by word, not one block
    assert "".join(c.chunk for c in chunks).strip() == "answer of q"
    assert isinstance(values[-1], dspy.Prediction) and values[-1].answer == "answer of q"


def test_streamify_streams_a_linear_workflow(lm):
    wf = flowopt.chain("question -> answer", Predict("question -> answer"))
    chunks, final = stream_chunks(wf, wf.nodes["predict"].predict)
    assert "".join(c.chunk for c in chunks).strip() == final.answer == "answer of q"


# ---------------------------------------------------------------- the idioms that held, still holding
def test_deepcopy_and_reset_copy_are_independent(lm):
    wf = with_demos()
    copy = wf.deepcopy()
    copy.nodes["left"].predict.demos.append(dspy.Example(question="q1", notes_a="n1"))
    assert len(wf.nodes["left"].predict.demos) == 1
    assert wf.reset_copy().nodes["left"].predict.demos == []


def test_evaluate_with_threads_batch_and_asyncify(lm):
    wf = branched()
    dev = [dspy.Example(question=f"q{i}", answer=f"answer of q{i}").with_inputs("question") for i in range(6)]
    result = dspy.Evaluate(devset=dev, metric=lambda ex, pred, trace=None: ex.answer == pred.answer,
                           num_threads=3)(wf)
    assert result.score == 100.0
    assert [p.answer for p in wf.batch(dev[:3], num_threads=2)] == ["answer of q0", "answer of q1", "answer of q2"]
    assert asyncio.run(dspy.asyncify(wf)(question="qa")).answer == "answer of qa"


def test_set_lm_and_inspect_history(capsys):
    wf = branched()
    own = scripted_lm(lambda req: {f: "own" for f in req.output_fields}, cache=False)
    wf.set_lm(own)
    assert wf(question="q").answer == "own"
    wf.inspect_history(n=1)
    assert "own" in capsys.readouterr().out
