"""The DSPy side: custom engine contract, DSPy's cache and n fan-out, specs and DSPy state files."""

from __future__ import annotations

import contextlib
import json

import dspy
import pytest

from flowopt.errors import ConfigError
from flowopt.lm import CompletionAdapter, LocalDSPyLM, LocalEngine, adapter_for, lm_from_spec, local_of


@pytest.fixture
def counted(tiny_local, monkeypatch):
    """Count the generations that reach the model."""
    calls = []
    original = tiny_local.complete_ids

    def counting(prompt_ids, settings, **kwargs):
        calls.append(settings)
        return original(prompt_ids, settings, **kwargs)

    monkeypatch.setattr(tiny_local, "complete_ids", counting)
    return calls


def test_lm_is_a_dspy_lm_with_a_custom_engine(tiny_local):
    lm = tiny_local.lm
    assert isinstance(lm, dspy.LM) and isinstance(lm, LocalDSPyLM)
    assert isinstance(lm.engine, LocalEngine)
    assert local_of(lm) is tiny_local and local_of(dspy.LM("openai/gpt-4o-mini")) is None
    assert lm.model.startswith("local/tiny@")  # a folder model: the tag names these exact weights


def test_a_repeated_request_is_served_from_dspys_cache(tiny_local, counted):
    dspy.configure(lm=tiny_local.lm, adapter=adapter_for(tiny_local.lm))
    predict = dspy.Predict("question -> answer")
    first = predict(question="What is the capital of France?")
    reached = len(counted)
    assert reached >= 1
    second = predict(question="What is the capital of France?")
    assert len(counted) == reached  # nothing new reached the engine
    assert second.answer == first.answer


def test_n_fans_out_to_one_engine_call_per_candidate(tiny_local, counted):
    outputs = tiny_local.lm("hello there", n=3, temperature=1.0, cache=False)
    assert len(outputs) == 3 and len(counted) == 3
    assert all(s.temperature == 1.0 for s in counted)


def test_request_settings_reach_the_generation(tiny_local, counted):
    tiny_local.lm("hello", temperature=0.5, max_tokens=3, stop=["zz"], seed=7, top_p=0.9, cache=False)
    row = counted[-1]
    assert (row.temperature, row.max_new_tokens, row.stop, row.seed, row.top_p) == (0.5, 3, ("zz",), 7, 0.9)


def test_base_models_get_the_completion_adapter(tiny_local):
    assert tiny_local.is_base
    assert isinstance(adapter_for(tiny_local.lm), CompletionAdapter)
    assert isinstance(adapter_for(dspy.LM("openai/gpt-4o-mini")), dspy.ChatAdapter)


def test_spec_round_trip_and_shared_weights(tiny_local, tiny_model_dir):
    spec = tiny_local.lm.copy(temperature=0.3).to_spec()
    assert spec["model"] == "local/tiny" and spec["source"] == str(tiny_model_dir.resolve())
    assert spec["temperature"] == 0.3 and spec["adapter"] is None
    lm_a = lm_from_spec(spec)
    lm_b = lm_from_spec({**spec, "temperature": 0.0})
    assert local_of(lm_a) is local_of(lm_b)  # one copy of the weights per process
    assert lm_a.kwargs["temperature"] == 0.3 and lm_b.kwargs["temperature"] == 0.0
    assert lm_a("hello", cache=False, temperature=0.0) == tiny_local.lm("hello", cache=False, temperature=0.0)


def test_spec_errors_are_config_errors(tiny_model_dir):
    from flowopt.lm import LocalLM

    with pytest.raises(ConfigError, match="unknown settings"):
        LocalLM.from_spec({"model": "local/tiny", "source": str(tiny_model_dir), "temprature": 1})
    with pytest.raises(ConfigError, match="no local model"):
        LocalLM("/nonexistent/folder")


def test_dspy_state_files_record_the_spec_and_load_back(tiny_local):
    state = tiny_local.lm.dump_state()
    assert state["engine"]["class"] == "flowopt.lm.engine:LocalEngine"
    assert state["engine"]["state"]["source"] == tiny_local.source
    engine = LocalEngine.load_state(state["engine"]["state"])
    assert engine.local.source == tiny_local.source
    assert "api_key" not in str(state)


@contextlib.contextmanager
def twin_of(local):
    """A LocalLM with ``local``'s spec, for tests that attach adapters (the session's ``tiny_local`` keeps none:
    PEFT leaves the base weights frozen after an adapter comes off)."""
    from flowopt.lm import LocalLM

    twin = LocalLM.from_spec(local.to_spec())
    try:
        yield twin
    finally:
        twin.close()


FRESH_LOAD = """
import json, sys

import dspy

before = sorted(m for m in sys.modules if m.startswith("flowopt"))
lms = []
for path in sys.argv[1:3]:  # DSPy's loader imports the saved LM's and engine's modules (flowopt.lm.engine, .pinned)
    predict = dspy.Predict("question -> answer")
    predict.load(path, allow_unsafe_lm_state=True)
    lms.append(predict.lm)

import flowopt

lms.append(flowopt.load(sys.argv[3]).lm_for("predict"))  # built from the saved spec on first use
print(json.dumps({
    "before": before,
    "types": [type(lm).__name__ for lm in lms],
    "models": [lm.model for lm in lms],
    "one_copy": len({id(lm.local) for lm in lms}) == 1,
    "kwargs": [lm.kwargs for lm in lms],
    "outputs": [lm("hello", cache=False, temperature=0.0) for lm in lms],
}))
"""


def test_saved_programs_with_a_local_lm_load_in_a_fresh_process(tiny_local, tiny_model_dir, tmp_path, make_adapter):
    """A new process that imports only what loading imports rebuilds the local LMs from files: DSPy's state
    format (its loader imports ``flowopt.lm.engine`` or ``flowopt.lm.pinned`` by the saved class path and calls
    ``load_state``, which builds the LocalLM through the builder ``flowopt.lm.local`` registers), for the
    model's own LM and an adapter-pinned one, and a flowopt workflow document."""
    import subprocess
    import sys

    import flowopt
    from flowopt.lm.pinned import saved_adapter_lm
    from flowopt.modules import Predict

    files = [tmp_path / "plain.json", tmp_path / "adapter.json", tmp_path / "workflow.json"]
    with twin_of(tiny_local) as twin:  # the adapter goes on a LocalLM of the same spec
        adapted = saved_adapter_lm(twin, make_adapter(tiny_model_dir, tmp_path / "adapter", seed=1))
        saved = [tiny_local.lm.copy(max_tokens=6), adapted]
        for lm, path in zip(saved, files):
            predict = dspy.Predict("question -> answer")
            predict.lm = lm
            predict.save(str(path))
        wf = flowopt.chain("question -> answer", Predict("question -> answer"))
        wf.lms["default"] = tiny_local.lm
        wf.node_lms["predict"] = "default"
        wf.save(files[2])
        expected = [lm("hello", cache=False, temperature=0.0) for lm in (*saved, tiny_local.lm)]

    run = subprocess.run([sys.executable, "-c", FRESH_LOAD, *map(str, files)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert loaded["before"] == []  # nothing of flowopt was imported by hand before DSPy's loader ran
    assert loaded["types"] == ["LocalDSPyLM", "AdapterLM", "LocalDSPyLM"]
    assert loaded["models"] == [saved[0].model, adapted.model, tiny_local.lm.model]  # the same weights' tags
    assert loaded["one_copy"]  # one LocalLM for the three: the adapter is attached to it, not a second model
    assert loaded["kwargs"][:2] == [{"temperature": 0.0, "max_tokens": 6}, {"temperature": 0.0, "max_tokens": 12}]
    assert loaded["outputs"] == expected  # float32 on CPU: the same weights give the same tokens


def test_a_saved_adapter_lm_refuses_other_adapter_weights(tiny_local, tiny_model_dir, tmp_path, make_adapter):
    import shutil

    from flowopt.errors import LMError
    from flowopt.lm.pinned import saved_adapter_lm

    folder = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    with twin_of(tiny_local) as twin:
        predict = dspy.Predict("question -> answer")
        predict.lm = saved_adapter_lm(twin, folder)
        predict.save(str(tmp_path / "program.json"))
    other = make_adapter(tiny_model_dir, tmp_path / "other", seed=2)
    shutil.copy(other / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    with pytest.raises(LMError, match=r"not the \w+ the program recorded"):
        dspy.Predict("question -> answer").load(str(tmp_path / "program.json"), allow_unsafe_lm_state=True)


def test_the_workflow_ir_round_trips_a_local_lm(tiny_local):
    from flowopt.lm_spec import lm_from_spec as ir_lm_from_spec
    from flowopt.lm_spec import lm_to_spec

    spec = lm_to_spec(tiny_local.lm.copy(temperature=0.2))
    assert spec["model"] == "local/tiny" and spec["temperature"] == 0.2
    rebuilt = ir_lm_from_spec(spec)
    assert local_of(rebuilt).source == tiny_local.source and rebuilt.kwargs["temperature"] == 0.2
