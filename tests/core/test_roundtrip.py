"""JSON round-trips exactly, saved workflows behave the same, secrets are never written."""

import json
import os
import random

import dspy
import pytest

import flowopt
from flowopt.modules import ChainOfThought, Custom, Predict, Programmer, Refine, Retrieve, ScEnsemble
from flowopt.testing import scripted_lm

TYPES = ["str", "int", "float", "bool", "list[str]"]


def random_operator(rng: random.Random, inputs: list[tuple[str, str]], out_name: str):
    """An operator with a random kind, settings, field types, instructions and demos."""
    kind = rng.choice(["Predict", "ChainOfThought", "Custom", "ScEnsemble", "Refine", "Programmer", "Retrieve"])
    str_inputs = [(n, t) for n, t in inputs if t == "str"]
    if kind == "Retrieve" and str_inputs:
        op = Retrieve(f"{str_inputs[0][0]} -> {out_name}: list[str]", k=rng.randint(1, 4),
                      corpus=[f"doc {i}" for i in range(rng.randint(1, 3))])
        return op
    if kind == "Programmer" and str_inputs:
        return Programmer(f"{str_inputs[0][0]} -> {out_name}", timeout_s=rng.choice([1.0, 2.5]),
                          memory_mb=rng.choice([128, 256]), on_failure=rng.choice(["raise", "empty"]))
    sig = ", ".join(f"{n}: {t}" for n, t in inputs) + f" -> {out_name}: {rng.choice(TYPES)}"
    instructions = rng.choice([None, "Be brief.", "Think about units — and ünïcode."])
    if kind == "Predict" or (kind in ("Retrieve", "Programmer")):
        op = Predict(sig, instructions, temperature=rng.choice([None, 0.0, 0.7]))
    elif kind == "ChainOfThought":
        op = ChainOfThought(sig, instructions)
    elif kind == "Custom":
        op = Custom(sig, instruction=f"Custom step {rng.randint(0, 99)}")
    elif kind == "ScEnsemble":
        op = ScEnsemble(sig, instructions, n=rng.randint(1, 4), select=rng.choice(["majority", "lm"]))
    else:
        op = Refine(sig, instructions, max_rounds=rng.randint(1, 3))
    for name, predictor in op.named_predictors():
        predictor.demos = [dspy.Example(**{f: f"{name}-{f}-{j}" for f in predictor.signature.fields})
                           for j in range(rng.randint(0, 2))]
        if rng.random() < 0.3:  # an optimizer rewrote this predictor's instructions
            predictor.signature = predictor.signature.with_instructions(f"Rewritten {rng.random():.3f}")
    return op


def random_workflow(seed: int) -> flowopt.Workflow:
    rng = random.Random(seed)
    wf = flowopt.Workflow("question, context: list[str] -> answer", name=f"g{seed}")
    available = [("$input", "question", "str"), ("$input", "context", "list[str]")]
    for i in range(rng.randint(1, 6)):
        picks = rng.sample(available, k=min(len(available), rng.randint(1, 3)))
        names = {}
        for src, field, ftype in picks:
            names[f"in_{src.strip('$')}_{field}"] = (f"{src}.{field}", ftype)
        out_name = f"out{i}"
        op = random_operator(rng, [(n, t) for n, (_, t) in names.items()], out_name)
        inputs = {n: ref for n, (ref, _) in names.items() if op.spec.input(n) is not None}
        wf.add(f"n{i}", op, inputs=inputs, lm=rng.choice([None, "default"]))
        available.append((f"n{i}", out_name, op.spec.outputs[0].type))
    last = [(src, f) for src, f, t in available if t == "str" and src != "$input"]
    src, field = (last[-1] if last else ("$input", "question"))
    wf.output(answer=f"{src}.{field}")
    wf.lms["default"] = dspy.LM("openai/gpt-4o-mini", temperature=0.0, api_key="sk-secret-123")
    wf.meta["note"] = {"seed": seed}
    return wf


@pytest.mark.parametrize("seed", range(60))
def test_generated_graphs_round_trip_exactly(seed):
    wf = random_workflow(seed)
    text = wf.to_json()
    loaded = flowopt.Workflow.from_json(text)
    assert loaded.to_json() == text
    assert loaded.canonical_json() == wf.canonical_json()
    assert "sk-secret-123" not in text
    assert loaded.edges() == wf.edges()
    for node_id, op in wf.nodes.items():
        other = loaded.nodes[node_id]
        assert type(other) is type(op) and other.config() == op.config()
        for (name, p), (name2, q) in zip(op.named_predictors(), other.named_predictors()):
            assert name == name2
            assert p.signature.instructions == q.signature.instructions
            assert [d.toDict() for d in p.demos] == [d.toDict() for d in q.demos]


def answer_by_demos(request):
    """Scripted LM: the answer depends on inputs, instructions and the number of demos shown."""
    text = request.inputs.get("question", "") + request.system[:40]
    return {name: f"{name}:{len(request.demos)}:{sum(map(ord, text)) % 97}" for name in request.output_fields}


def test_saved_then_loaded_workflow_gives_identical_outputs(tmp_path):
    lm = scripted_lm(answer_by_demos, cache=False)
    dspy.configure(lm=lm)
    wf = (flowopt.Workflow("question -> answer")
          .add("draft", ChainOfThought("question -> draft", "Draft an answer."))
          .add("final", Predict("question, draft -> answer")))
    wf.nodes["final"].predict.demos = [dspy.Example(question="q", draft="d", answer="a")]
    path = wf.save(tmp_path / "wf.json")
    loaded = flowopt.load(path)
    questions = [f"question {i}" for i in range(10)]
    assert [loaded(question=q).answer for q in questions] == [wf(question=q).answer for q in questions]
    assert lm.engine.calls == 40


def test_secrets_are_never_written(tmp_path):
    wf = flowopt.chain("question -> answer", Predict("question -> answer"))
    wf.lms["default"] = dspy.LM("openai/gpt-4o-mini", api_key="sk-live-abc", api_base="http://127.0.0.1:9/v1",
                                extra_headers={"Authorization": "Bearer tok-xyz"}, temperature=0.0, max_tokens=300)
    wf.node_lms["answer"] = None
    text = wf.save(tmp_path / "wf.json").read_text()
    assert "sk-live-abc" not in text and "tok-xyz" not in text
    spec = json.loads(text)["lms"]["default"]
    assert spec["model"] == "openai/gpt-4o-mini" and spec["api_base"] == "http://127.0.0.1:9/v1"
    assert spec["temperature"] == 0.0 and spec["max_tokens"] == 300  # a token limit is not a secret


@pytest.mark.parametrize("name", ["api_key", "OPENAI_API_KEY", "auth_token", "hf_token", "token", "client_secret",
                                  "password", "extra_headers", "Authorization", "aws_credentials"])
def test_credential_settings_are_recognised(name):
    from flowopt.lm_spec import is_secret_setting

    assert is_secret_setting(name)
    assert not is_secret_setting("max_tokens") and not is_secret_setting("max_new_tokens")


def test_a_bound_lm_is_used_by_its_nodes_and_survives_loading(tmp_path):
    used = []
    lm = scripted_lm(lambda r: used.append("bound") or {"answer": "bound"}, model="scripted/bound")
    ambient = scripted_lm(lambda r: used.append("ambient") or {"answer": "ambient"}, model="scripted/ambient")
    dspy.configure(lm=ambient)
    wf = flowopt.Workflow("question -> answer", lms={"main": lm}).add("a", Predict("question -> answer"), lm="main")
    assert wf(question="x").answer == "bound"
    loaded = flowopt.load(wf.save(tmp_path / "wf.json"), lms={"main": lm})
    assert loaded(question="y").answer == "bound" and used == ["bound", "bound"]


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "wf.json"
    wf = flowopt.chain("question -> answer", Predict("question -> answer"))
    wf.save(path)
    before = path.read_text()
    wf.meta["bad"] = object()  # not JSON: the save must fail without touching the old file
    with pytest.raises(flowopt.SchemaError, match="JSON cannot store"):
        wf.save(path)
    assert path.read_text() == before

    def crash(*args, **kwargs):
        raise OSError("disk full")

    del wf.meta["bad"]
    wf.meta["v"] = 2
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        wf.save(path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wf.json"]  # no temp file left behind
