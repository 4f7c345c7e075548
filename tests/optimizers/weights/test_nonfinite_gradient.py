"""A step whose gradient norm is NaN (with a finite loss, as on the H200's GSM8K GRPO run) is skipped: the
adapter and the optimizer's moments stay as they were, the stats and the curve say so, a warning names the
step and what to change; ``NONFINITE_LIMIT`` such batches in a row stop training with a flowopt error,
leaving the last good checkpoint. The NaN is injected by a backward hook on the training forward's log-probs,
so the loss itself stays finite."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import dspy
import pytest
import torch

from flowopt.errors import FlowoptError, NonFiniteGradientError
from flowopt.lm import AutoAdapter
from flowopt.optimizers.weights import GRPO, LoraSettings, sft
from flowopt.optimizers.weights import learner as learner_module
from flowopt.optimizers.weights.distributed import World
from flowopt.optimizers.weights.learner import GRPOLearner, ScoredTransition
from flowopt.optimizers.weights.optim import NONFINITE_LIMIT, StepGuard, make_optimizer
from flowopt.optimizers.weights.policy import Policy

LORA = LoraSettings(r=4, alpha=8)


class Poison:
    """Wraps ``completion_logprobs``: while ``on(call)`` is true for a forward with gradients (counted from 1),
    its backward pass gets NaN gradients."""

    def __init__(self, score, on):
        self.score, self.on, self.calls = score, on, 0

    def __call__(self, model, batch, *args, **kwargs):
        out = self.score(model, batch, *args, **kwargs)
        if torch.is_grad_enabled():
            self.calls += 1
            if self.on(self.calls):
                out.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        return out


def _state(policy: Policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.adapter_state().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _items(policy: Policy) -> list[ScoredTransition]:
    prompt = policy.render([{"role": "user", "content": "Cue: red Word:"}])
    return [ScoredTransition(prompt, policy.completion_ids(word), [0.0] * len(policy.completion_ids(word)), adv)
            for word, adv in (("cat", 1.0), ("dog", -1.0), ("owl", 0.5), ("cat", -0.5))]


def test_grpo_update_with_a_nan_gradient_keeps_the_weights(tiny_local, monkeypatch, caplog):
    poison = Poison(learner_module.completion_logprobs, on=lambda call: call == 1)
    monkeypatch.setattr(learner_module, "completion_logprobs", poison)
    policy = Policy(tiny_local, lora=LORA)
    policy.start_adapter("nan")
    learner = GRPOLearner(policy, total_steps=4, learning_rate=1e-2, micro_batch_size=8)
    before = _state(policy)
    with caplog.at_level(logging.WARNING):
        stats = learner.update(_items(policy))
    assert stats.nonfinite_grad and not stats.skipped
    assert math.isfinite(stats.loss) and math.isnan(stats.grad_norm)  # the H200's symptom: a finite loss
    assert _same(before, _state(policy))  # bit-identical adapter
    assert not learner.optimizer.state  # AdamW's moments untouched: no step was taken
    assert learner.scheduler.last_epoch == 1  # the schedule counts the skipped step
    assert all(p.grad is None for p in learner.params)
    message = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "grpo update 1" in message and "learning_rate=0.01" in message and "max_grad_norm" in message
    clean = learner.update(_items(policy))  # the next batch's gradient is finite: a normal step
    assert not clean.nonfinite_grad and math.isfinite(clean.grad_norm) and clean.grad_norm > 0
    assert not _same(before, _state(policy))
    assert all(torch.isfinite(v).all() for v in _state(policy).values())


def test_grpo_stops_after_nonfinite_updates_in_a_row(tiny_local, monkeypatch):
    bad = {"on": True}
    monkeypatch.setattr(learner_module, "completion_logprobs",
                        Poison(learner_module.completion_logprobs, on=lambda call: bad["on"]))
    policy = Policy(tiny_local, lora=LORA)
    policy.start_adapter("nan")
    learner = GRPOLearner(policy, total_steps=10, learning_rate=1e-2)
    before = _state(policy)
    for _ in range(NONFINITE_LIMIT - 1):
        assert learner.update(_items(policy)).nonfinite_grad
    bad["on"] = False
    assert not learner.update(_items(policy)).nonfinite_grad  # a finite update breaks the run of bad ones
    after_good = _state(policy)
    assert not _same(before, after_good)
    bad["on"] = True
    for _ in range(NONFINITE_LIMIT - 1):
        learner.update(_items(policy))
    with pytest.raises(NonFiniteGradientError) as caught:
        learner.update(_items(policy))
    err = caught.value
    assert isinstance(err, FlowoptError) and err.steps == NONFINITE_LIMIT
    assert err.settings["learning_rate"] == 1e-2
    assert f"update {2 * NONFINITE_LIMIT}" in str(err) and "Fix:" in str(err) and "float32" in str(err)
    assert _same(after_good, _state(policy))  # the weights of the last finite step


def test_every_rank_skips_when_another_ranks_norm_is_not_finite(tiny_local):
    """The decision is collective (``World.any``): a rank whose own norm is finite still skips the step."""

    class OtherRankHasNaN(World):
        def any(self, flag: bool) -> bool:
            return True

    policy = Policy(tiny_local, lora=LORA)
    policy.start_adapter("nan")
    optimizer, scheduler = make_optimizer(policy.trainable_parameters(), lr=1e-2, weight_decay=0.0, total_steps=2,
                                          warmup=0, schedule="constant")
    params = policy.trainable_parameters()
    for p in params:
        p.grad = torch.ones_like(p)
    before = _state(policy)
    guard = StepGuard("grpo", settings={}, world=OtherRankHasNaN(rank=1, size=2))
    assert not guard.step(torch.tensor(1.0), optimizer, scheduler)
    assert _same(before, _state(policy)) and scheduler.last_epoch == 1
    assert all(p.grad is None for p in params)  # the skipped step's gradients are dropped
    for p in params:
        p.grad = torch.ones_like(p)
    assert StepGuard("grpo", settings={}).step(torch.tensor(1.0), optimizer, scheduler)  # one rank, finite
    assert not _same(before, _state(policy))


def _pairs(policy: Policy) -> list[tuple[list[int], list[int]]]:
    texts = [("Cue: red Word:", "cat"), ("Noise: sun moon Cue: blue Word:", "dog"), ("Cue: green", "owl"),
             ("Cue: red", "cat")]
    return [(policy.render([{"role": "user", "content": t}]), policy.completion_ids(w)) for t, w in texts]


def test_sft_step_with_a_nan_gradient_is_skipped(tiny_local, monkeypatch, caplog):
    # batch_size 4 of 4 pairs, no token budget: one forward per step; the first step's backward is NaN.
    monkeypatch.setattr(sft, "completion_logprobs", Poison(sft.completion_logprobs, on=lambda call: call == 1))
    policy = Policy(tiny_local, lora=LORA)
    policy.start_adapter("nan")
    before = _state(policy)
    states: list[dict[str, torch.Tensor]] = []
    with caplog.at_level(logging.WARNING):
        losses = sft.sft_train(policy, _pairs(policy), epochs=2, learning_rate=1e-2, batch_size=4,
                               micro_batch_tokens=None, on_step=lambda loss: states.append(_state(policy)))
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert _same(before, states[0])  # step 1 skipped: bit-identical
    assert not _same(before, states[1])  # step 2 a normal step
    assert all(torch.isfinite(v).all() for v in states[1].values())
    assert any("finetune step 1" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_sft_stops_after_nonfinite_steps_in_a_row(tiny_local, monkeypatch):
    monkeypatch.setattr(sft, "completion_logprobs", Poison(sft.completion_logprobs, on=lambda call: True))
    policy = Policy(tiny_local, lora=LORA)
    policy.start_adapter("nan")
    before = _state(policy)
    with pytest.raises(NonFiniteGradientError, match=f"finetune: .* {NONFINITE_LIMIT} batches in a row") as caught:
        sft.sft_train(policy, _pairs(policy), epochs=NONFINITE_LIMIT + 2, learning_rate=1e-2, batch_size=4,
                      micro_batch_tokens=None)
    assert caught.value.settings == {"learning_rate": 1e-2, "max_grad_norm": 1.0, "gradient_checkpointing": False}
    assert _same(before, _state(policy))


def test_grpo_stage_records_skipped_steps_and_stops_at_the_last_good_checkpoint(make_tiny_local, task, tmp_path,
                                                                              monkeypatch):
    """Update 1 is finite, updates 2.. are NaN: the curve marks steps 2 and 3, the stage raises at step
    ``1 + NONFINITE_LIMIT`` and its last checkpoint (after step 3) holds update 1's finite adapter."""
    kept: dict[str, dict[str, torch.Tensor]] = {}
    original = GRPOLearner.update

    def update(self, items):
        stats = original(self, items)
        kept.setdefault("after update 1", _state(self.policy))
        kept["now"] = _state(self.policy)
        return stats

    monkeypatch.setattr(GRPOLearner, "update", update)
    monkeypatch.setattr(learner_module, "completion_logprobs",
                        Poison(learner_module.completion_logprobs, on=lambda call: call > 1))
    # beta > 0: every update has a KL term to learn from (none is skipped for equal rewards); one micro-batch
    # per update, so forward n is update n.
    stage = GRPO(steps=NONFINITE_LIMIT + 3, batch_size=2, group_size=4, max_new_tokens=2, learning_rate=1e-2,
                 beta=0.04, micro_batch_size=64, checkpoint_every=1, lora=LORA)
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = make_tiny_local().lm
    run_dir = tmp_path / "run"
    ctx = task.ctx(task.examples(16, seed=3), [], run_dir=run_dir)
    with dspy.context(adapter=AutoAdapter()), pytest.raises(NonFiniteGradientError):
        stage.run(program, ctx)
    assert _same(kept["after update 1"], kept["now"])
    saved = json.loads((run_dir / "grpo.json").read_text())
    assert saved["step"] == NONFINITE_LIMIT and saved["folder"] == f"checkpoint-{NONFINITE_LIMIT}"
    curve = saved["reward_curve"]
    assert [p["nonfinite_grad"] for p in curve] == [False] + [True] * (NONFINITE_LIMIT - 1)
    assert all(math.isnan(p["grad_norm"]) for p in curve[1:]) and math.isfinite(curve[0]["grad_norm"])
    assert [p.name for p in Path(run_dir).glob("checkpoint-*")] == [f"checkpoint-{NONFINITE_LIMIT}"]
