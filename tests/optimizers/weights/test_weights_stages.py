"""The stages around the learning: IR weights entry and reload, stage chaining, checkpoints and resume,
the budget, rewards, and settings errors."""

from __future__ import annotations

import hashlib

import dspy
import pytest

import flowopt
from flowopt.errors import ConfigError
from flowopt.lm import AutoAdapter
from flowopt.optimizers.weights import GRPO, BootstrapFinetune, LoraSettings
from flowopt.optimizers.weights.rewards import score_rollout
from flowopt.optimizers.weights.rollout import Rollout
from flowopt.testing import scripted_lm

LORA = LoraSettings(r=4, alpha=8)


def _teacher(task):
    return scripted_lm(task.oracle, cache=False)


def _workflow(lm):
    from flowopt.modules import Predict

    wf = flowopt.Workflow("noise, cue -> word", name="cue-word")
    wf.add("solve", Predict(dspy.Signature("noise, cue -> word", "Answer.")), lm="default")
    wf.lms["default"] = lm
    return wf


def _predictions(program, examples):
    """Greedy answers (or the error) of ``program``; its LM must not cache, so the model is really asked."""
    out = []
    with dspy.context(adapter=AutoAdapter()):
        for ex in examples:
            try:
                out.append(str(program(**ex.inputs()).word))
            except Exception as err:  # an unparseable answer is an answer too
                out.append(f"error: {type(err).__name__}")
    return out


def test_finetuned_workflow_records_its_adapter_and_reloads(tiny_saved_local, task, tmp_path):
    wf = _workflow(tiny_saved_local.lm)
    ctx = task.ctx(task.examples(24, seed=5), task.examples(8, seed=6), run_dir=tmp_path / "run" / "finetune",
                   stage_name="finetune")
    stage = BootstrapFinetune(teacher=_teacher(task), epochs=6, learning_rate=1e-2, lora=LORA)
    with dspy.context(adapter=AutoAdapter()):
        out = stage.run(wf, ctx)
        preds = [out(**ex.inputs()).word for ex in ctx.valset]
    entry = out.weights["student"]
    assert entry["base"] == "tiny" and entry["adapter"] == "finetune/adapter"
    weights = tmp_path / "run" / entry["adapter"] / "adapter_model.safetensors"
    assert entry["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert set(out.node_lms.values()) == {"student"}
    saved = out.save(tmp_path / "run" / "program.json")
    data = flowopt.load(saved).to_dict()
    assert data["weights"] == out.weights and data["lms"]["student"]["adapter"].endswith("finetune/adapter")
    # A fresh load builds its own LocalLM from the spec (base folder + adapter) and answers the same.
    loaded = flowopt.load(saved)
    with dspy.context(adapter=AutoAdapter()):
        again = [loaded(**ex.inputs()).word for ex in ctx.valset]
    assert again == preds
    assert sum(task.metric(ex, dspy.Prediction(word=p)) for p, ex in zip(preds, ctx.valset)) >= 4


def test_grpo_continues_from_the_finetuned_adapter_and_leaves_it_intact(tiny_local, task, tmp_path):
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = tiny_local.lm.copy(cache=False)
    trainset = task.examples(32, seed=7)
    before = _predictions(program, trainset[:8])
    sft_ctx = task.ctx(trainset, [], run_dir=tmp_path / "finetune", stage_name="finetune")
    grpo_ctx = task.ctx(trainset, [], run_dir=tmp_path / "grpo", stage_name="grpo")
    with dspy.context(adapter=AutoAdapter()):
        # Stages work on the copy compile() hands them; the caller's program shares the LocalLM.
        tuned = BootstrapFinetune(teacher=_teacher(task), epochs=5, learning_rate=1e-2,
                                  lora=LORA).run(program.deepcopy(), sft_ctx)
        sft_state = {k: v.clone() for k, v in _adapter_state(tiny_local, "finetune").items()}
        trained = GRPO(steps=2, batch_size=4, group_size=4, max_new_tokens=2, learning_rate=1e-2).run(tuned, grpo_ctx)
    # Both adapters are attached, but unpinned calls (the input program's) still run on the base weights:
    # each trained program is pinned to its own adapter.
    assert tiny_local.adapters == ["finetune", "grpo"] and tiny_local.active_adapter is None
    assert _predictions(program, trainset[:8]) == before
    assert trained.lm.engine.adapter == "grpo"
    # GRPO started from the fine-tuned weights: its first rollouts already score well
    assert grpo_ctx.info["reward_curve"][0]["mean_score"] > 0.5
    after = _adapter_state(tiny_local, "finetune")
    assert all(bool((after[k] == sft_state[k]).all()) for k in sft_state)


def _adapter_state(local, name):
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(local.model, adapter_name=name)


class _Crash(Exception):
    pass


def test_resume_after_a_crash_repeats_the_uninterrupted_run(make_tiny_local, task, tmp_path, monkeypatch):
    from flowopt.optimizers.weights import learner as learner_module

    trainset = task.examples(32, seed=8)
    stage = GRPO(steps=4, batch_size=2, group_size=4, max_new_tokens=2, learning_rate=1e-2, checkpoint_every=2,
                 lora=LORA)

    def run(run_dir, resume=False):
        program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
        program.lm = make_tiny_local().lm
        ctx = task.ctx(trainset, [], run_dir=run_dir, resume=resume)
        with dspy.context(adapter=AutoAdapter()):
            stage.run(program, ctx)
        return ctx.info

    reference = run(tmp_path / "straight")
    calls = {"n": 0}
    original = learner_module.GRPOLearner.update

    def crash_on_third(self, items):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Crash("killed")
        return original(self, items)

    monkeypatch.setattr(learner_module.GRPOLearner, "update", crash_on_third)
    with pytest.raises(_Crash):
        run(tmp_path / "crashed")
    monkeypatch.setattr(learner_module.GRPOLearner, "update", original)
    assert (tmp_path / "crashed" / "checkpoint-2" / "learner.pt").is_file()
    resumed = run(tmp_path / "crashed", resume=True)
    assert [p["step"] for p in resumed["reward_curve"]] == [1, 2, 3, 4]
    for a, b in zip(reference["reward_curve"], resumed["reward_curve"]):
        assert a["mean_reward"] == b["mean_reward"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert resumed["adapter_sha256"] == reference["adapter_sha256"]


def test_budget_stops_grpo_cleanly(tiny_local, task, tmp_path):
    from flowopt.compiler.budget import Budget, BudgetTracker

    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = tiny_local.lm
    budget = BudgetTracker(Budget(max_lm_calls=20))
    ctx = task.ctx(task.examples(16, seed=9), [], run_dir=tmp_path / "grpo", budget=budget)
    stage = GRPO(steps=10, batch_size=2, group_size=4, max_new_tokens=2, lora=LORA)
    with budget.activate(), dspy.context(adapter=AutoAdapter()):
        out = stage.run(program, ctx)
    assert ctx.outcome.stop_reason == "budget: max_lm_calls"
    assert 1 <= ctx.info["steps_done"] < 10
    assert out.lm.adapter == "grpo" and (tmp_path / "grpo" / "adapter").is_dir()


def test_finetune_without_passing_traces_leaves_the_program_unchanged(tiny_local, task):
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = tiny_local.lm
    wrong = scripted_lm(lambda req: {"word": "nothing"}, cache=False)
    ctx = task.ctx(task.examples(8, seed=10), [], stage_name="finetune")
    with dspy.context(adapter=AutoAdapter()):
        out = BootstrapFinetune(teacher=wrong, lora=LORA).run(program, ctx)
    assert out is program and ctx.info["pairs"] == 0 and "no teacher trace" in ctx.outcome.stop_reason
    assert tiny_local.adapters == []


def test_rollout_reward_adds_node_rewards_and_penalises_format_failures():
    example = dspy.Example(cue="red", word="cat").with_inputs("cue")
    metric = lambda ex, pred, trace=None: float(pred.word == ex.word)  # noqa: E731
    good = Rollout(0, 0, example, prediction=dspy.Prediction(word="cat"),
                   trace=[("draft", {"cue": "red"}, {"word": "cat"}), ("final", {"cue": "red"}, {"word": "cat"})])
    node_rewards = {"draft": lambda ex, inputs, outputs: 0.25}
    assert score_rollout(good, metric, node_rewards=node_rewards) == pytest.approx(1.25)
    assert good.score == 1.0
    failed = Rollout(0, 1, example, error="AdapterParseError: no word")
    assert score_rollout(failed, metric, format_penalty=0.5) == -0.5 and failed.score is None
    with pytest.raises(flowopt.MetricError):
        score_rollout(Rollout(0, 2, example, prediction=dspy.Prediction(word="x")), lambda *a: "high")


@pytest.mark.parametrize(("stage", "kwargs", "message"), [
    (GRPO, {"group_size": 1}, "group_size"),
    (GRPO, {"aggregation": "mean"}, "aggregation"),
    (GRPO, {"scaling": "std"}, "scaling"),
    (GRPO, {"temperature": 0.0}, "temperature"),
    (GRPO, {"beta": -0.1}, "beta"),
    (GRPO, {"lr_schedule": "step"}, "lr_schedule"),
    (GRPO, {"node_rewards": {"solve": 1.0}}, "node_rewards"),
    (BootstrapFinetune, {"epochs": 0}, "epochs"),
    (BootstrapFinetune, {"teacher": "gpt-4o"}, "teacher"),
])
def test_bad_settings_say_how_to_fix(stage, kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        stage(**kwargs)
    assert "Fix:" in str(err.value)


def test_stages_are_registered_entry_points():
    from importlib.metadata import entry_points

    names = {ep.name: ep.load() for ep in entry_points(group="flowopt.stages") if ep.name in ("finetune", "grpo")}
    assert names == {"finetune": BootstrapFinetune, "grpo": GRPO}
    assert GRPO.name == "grpo" and BootstrapFinetune.name == "finetune"


def test_compile_runs_finetune_then_grpo_and_saves_a_loadable_program(tiny_saved_local, task, tmp_path):
    wf = _workflow(tiny_saved_local.lm.copy(cache=False))
    trainset, valset = task.examples(24, seed=11), task.examples(12, seed=12)
    before = _predictions(wf, valset)
    stages = [BootstrapFinetune(teacher=_teacher(task), epochs=6, learning_rate=1e-2, lora=LORA),
              GRPO(steps=2, batch_size=2, group_size=4, max_new_tokens=2, learning_rate=1e-3, lora=LORA)]
    with dspy.context(adapter=AutoAdapter()):
        best = flowopt.compile(wf, trainset, task.metric, valset=valset, stages=stages, run_dir=tmp_path / "run",
                               quiet=True, num_threads=4)
    # compile never changes its input: the caller's program answers as before (its LocalLM stays in base mode)
    assert _predictions(wf, valset) == before and tiny_saved_local.active_adapter is None
    rows = {row.name: row for row in best.report.stages}
    assert rows["finetune"].kept and rows["finetune"].score > rows["baseline"].score
    assert rows["grpo"].info["steps_done"] == 2 and len(rows["grpo"].info["reward_curve"]) == 2
    entry = best.weights["student"]
    assert entry["adapter"] in ("stages/00-finetune/adapter", "stages/01-grpo/adapter")
    assert (tmp_path / "run" / entry["adapter"] / "adapter_model.safetensors").is_file()
    loaded = flowopt.load(tmp_path / "run" / "program.json")
    assert loaded.weights == best.weights
    # the LM entry names the same adapter as the weights entry, whichever stage was kept
    assert loaded.lms["student"]["adapter"] == str((tmp_path / "run" / entry["adapter"]).resolve())
    def score(example):
        try:
            return task.metric(example, loaded(**example.inputs()))
        except Exception:  # an unparseable answer scores 0, as in the compiler's evaluation
            return 0.0

    with dspy.context(adapter=AutoAdapter()):
        mean = sum(score(ex) for ex in valset) / len(valset)
    assert mean == pytest.approx(best.report.best_score)


def test_lora_settings_are_recorded_field_by_field():
    """The report and the resume check see the LoRA's rank, not only its class name."""
    small, large = BootstrapFinetune(lora=LoraSettings(r=4)), BootstrapFinetune(lora=LoraSettings(r=16))
    assert small.settings()["lora"]["r"] == 4 and large.settings()["lora"]["r"] == 16
    assert small.settings() != large.settings()  # resuming with another rank is refused, not silently reused
    assert GRPO(lora=LoraSettings(alpha=8)).settings()["lora"]["alpha"] == 8


def test_the_student_is_the_configured_local_model_when_predictors_name_none(tiny_local):
    """A program run under dspy.context(lm=local) trains that LocalLM (its token limit and batch size
    included), not a second copy of the embedded model with default settings."""
    from flowopt.optimizers.weights.common import resolve_policy

    program = dspy.Predict("question -> answer")  # no LM of its own
    with dspy.context(lm=tiny_local.lm):
        policy, start = resolve_policy(None, program, LoraSettings(r=4))
    assert policy.local is tiny_local and start is None
    hosted = dspy.Predict("question -> answer")
    hosted.lm = dspy.LM("openai/some-hosted-model")
    with dspy.context(lm=tiny_local.lm):  # a predictor's own LM comes first, the configured one last
        assert resolve_policy(None, hosted, LoraSettings(r=4))[0].local is tiny_local


def test_a_rejected_grpo_output_runs_on_its_own_adapter_not_its_inputs(tiny_saved_local, task, tmp_path):
    """As ``flowopt bench`` runs the layers: GRPO compiles from the fine-tuned program, and the program it
    returned is rebuilt from its run folder to be scored whether kept or not. That program must run on
    GRPO's adapter; binding the input program's LM by name would score the fine-tuned weights again."""
    from flowopt.compiler import saved_output
    from flowopt.errors import LMError

    wf = _workflow(tiny_saved_local.lm.copy(cache=False))
    trainset, valset = task.examples(24, seed=11), task.examples(8, seed=12)
    with dspy.context(adapter=AutoAdapter()):
        tuned = flowopt.compile(wf, trainset, task.metric, valset=valset, run_dir=tmp_path / "ft", quiet=True,
                                stages=[BootstrapFinetune(teacher=_teacher(task), epochs=6, learning_rate=1e-2,
                                                          lora=LORA)])
        flowopt.compile(tuned, trainset, task.metric, valset=valset, run_dir=tmp_path / "grpo", quiet=True,
                        stages=[GRPO(steps=2, batch_size=2, group_size=4, max_new_tokens=2, learning_rate=1e-2,
                                     lora=LORA)])
    output = saved_output(tmp_path / "grpo", 0, "grpo", tuned)
    grpo_folder = (tmp_path / "grpo" / output.weights["student"]["adapter"]).resolve()
    assert output.weights["student"]["sha256"] != tuned.weights["student"]["sha256"]
    lm = output.lms["student"]
    assert lm.sha256 == output.weights["student"]["sha256"] and lm.adapter_path == str(grpo_folder)
    assert tiny_saved_local.adapter_path(lm.engine.adapter) == grpo_folder  # calls are pinned to it
    assert output.lms["student"] is not tuned.lms["student"]
    # the same rebuild of the fine-tuned stage's own output keeps the caller's LM: nothing differs
    assert saved_output(tmp_path / "ft", 0, "finetune", tuned).lms["student"] is tuned.lms["student"]
    # weights that are not the ones the program recorded are refused, not run
    (grpo_folder / "adapter_model.safetensors").write_bytes(b"other weights")
    with pytest.raises(LMError, match=r"not the .* the program recorded"):
        saved_output(tmp_path / "grpo", 0, "grpo", tuned)
