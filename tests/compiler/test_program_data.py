"""Plain dspy.Module programs as data: a predictor whose LM a stage changed keeps that LM on reload."""

from __future__ import annotations

import json
import logging

import dspy

from flowopt.compiler import program_from_data, program_to_data


class TwoSteps(dspy.Module):
    def __init__(self):
        super().__init__()
        self.draft = dspy.Predict("question -> answer")
        self.check = dspy.Predict("question, answer -> verdict")

    def forward(self, question):
        answer = self.draft(question=question).answer
        return self.check(question=question, answer=answer)


def test_a_changed_predictor_lm_is_rebuilt_and_an_unchanged_one_is_reused():
    shared = dspy.LM("openai/gpt-4o-mini", temperature=0.0, api_key="sk-secret")
    base = TwoSteps()
    base.draft.lm = shared
    base.check.lm = shared
    compiled = TwoSteps()
    compiled.draft.lm = shared
    compiled.check.lm = dspy.LM("openai/student-model", temperature=0.7, max_tokens=99, api_key="sk-other")
    compiled.draft.demos = [dspy.Example(question="1+1?", answer="2")]

    data = json.loads(json.dumps(program_to_data(compiled)))  # plain JSON on disk
    assert "sk-" not in json.dumps(data)
    restored = program_from_data(data, base)
    assert restored.draft.lm is shared  # same client: its key, cache and history stay
    assert restored.check.lm is not shared
    assert restored.check.lm.model == "openai/student-model"
    assert restored.check.lm.kwargs["temperature"] == 0.7 and restored.check.lm.kwargs["max_tokens"] == 99
    assert restored.draft.demos[0]["answer"] == "2"


def test_an_lm_that_cannot_be_described_falls_back_to_the_base_one_with_a_warning(caplog):
    class Opaque(dspy.BaseLM):  # no model name and no to_spec: nothing a file could rebuild
        def __init__(self):
            super().__init__(model="opaque")
            self.model = None

    base = TwoSteps()
    fallback = dspy.LM("openai/gpt-4o-mini")
    base.check.lm = fallback
    compiled = TwoSteps()
    compiled.check.lm = Opaque()
    with caplog.at_level(logging.WARNING, logger="flowopt.compiler.checkpoint"):
        data = program_to_data(compiled)
    assert "check" not in data["lms"]
    assert any("cannot be described" in r.getMessage() for r in caplog.records)
    assert program_from_data(data, base).check.lm is fallback


def test_a_loaded_programs_student_entry_yields_only_to_another_adapter_of_the_same_model():
    """A program loaded from a file holds its LM entries as descriptions. A weights stage's output saved
    from it names another adapter of the same model: that entry is kept (it runs the stage's weights),
    while any other change to the entry still yields to the caller's."""
    from flowopt.lm_spec import LoadedLMSpec
    from flowopt.modules import Predict
    from flowopt.workflow import Workflow

    spec = {"model": "local/gemma-3-270m", "source": "gemma-3-270m", "adapter": "/runs/a/finetune/adapter",
            "max_new_tokens": 8, "temperature": 0.0}
    base = Workflow("question -> answer", lms={"student": LoadedLMSpec(spec)}).add(
        "solve", Predict("question -> answer"), lm="student")
    data = json.loads(json.dumps(program_to_data(base)))
    data["workflow"]["lms"]["student"]["adapter"] = "/runs/b/grpo/adapter"
    assert program_from_data(data, base).lms["student"]["adapter"] == "/runs/b/grpo/adapter"
    data["workflow"]["lms"]["student"]["max_new_tokens"] = 512  # more than the adapter differs now
    assert program_from_data(data, base).lms["student"] is base.lms["student"]
