"""The same seeded GRPO steps give the same rewards and adapter as the code before the runtime move.

``data/grpo_reference.json`` holds, per step, the per-rollout rewards and losses and, per adapter
tensor, its sum and L2 norm, recorded from the code *before* issue 15 moved the sampler, scorer and
engine into ``flowopt.lm`` (commit 96dade9), twice:

- ``sampler-old``: that code as it was (old log-probs from the sampler);
- ``forward-old``: that code with issue 16's fix 1 as its only change (``old = logps.detach()``).

The code now has fix 1, so it must repeat ``forward-old``: the same rewards (the same tokens were
sampled) and the adapter within float32 rounding. Against ``sampler-old`` the rewards are still
identical and the adapter norms agree to 1e-4; per-tensor sums differ by up to about 0.2% because a
ratio that is 1 +- 1e-7 instead of exactly 1 changes gradients that AdamW's normalisation then
amplifies for near-zero entries.

Re-record (only when a change of behaviour is intended):
``FLOWOPT_RECORD_GRPO_REFERENCE=forward-old pytest <this file>``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import dspy
import pytest

from flowopt.lm import AutoAdapter
from flowopt.optimizers.weights import GRPO, LoraSettings

REFERENCE = Path(__file__).parent / "data" / "grpo_reference.json"
CONFIGS = {
    "dapo": {"aggregation": "dapo"},
    "grpo-kl-2passes": {"aggregation": "grpo", "beta": 0.04, "passes": 2, "epsilon_high": 0.28,
                        "scaling": "batch", "micro_batch_size": 3},
}


def _length_metric(example, prediction, trace=None):
    return len(str(getattr(prediction, "word", "") or "")) / 10


_late_done: set[tuple[int, int]] = set()  # rollouts already made late (the program is deep-copied every step)


class _LateOnce(dspy.Module):
    """The recorded program, with rollout ``late_key`` of the first step ``late_s`` late for its LM call."""

    def __init__(self, predict: dspy.Module, late_key: tuple[int, int], late_s: float) -> None:
        super().__init__()
        self.predict, self.late_key, self.late_s = predict, late_key, late_s

    def forward(self, **inputs):
        from flowopt.optimizers.weights.rollout import _rollout_key

        if _rollout_key() == self.late_key and self.late_key not in _late_done:
            _late_done.add(self.late_key)
            time.sleep(self.late_s)  # slow non-LM work: the other 7 rollouts already wait for the model
        return self.predict(**inputs)


def _run(local, task, monkeypatch, settings, late_s: float = 0.0):
    from flowopt.optimizers.weights import grpo as grpo_module

    rewards: list[float] = []
    score = grpo_module.score_rollout

    def recording(rollout, metric, **kwargs):
        value = score(rollout, metric, **kwargs)
        rewards.append(float(value))
        return value

    monkeypatch.setattr(grpo_module, "score_rollout", recording)
    program: dspy.Module = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = local.lm
    if late_s:
        _late_done.clear()
        program = _LateOnce(program, (1, 3), late_s)
    ctx = task.ctx(task.examples(16, seed=3), [], seed=11)
    ctx.metric = _length_metric  # graded rewards: every step has advantages to learn from
    stage = GRPO(steps=4, batch_size=2, group_size=4, max_new_tokens=3, learning_rate=2e-2,
                 lora=LoraSettings(r=4, alpha=8), plot=False, **settings)
    with dspy.context(adapter=AutoAdapter()):
        stage.run(program, ctx)
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(local.model, adapter_name="grpo")
    adapter = {k: {"sum": float(v.double().sum()), "norm": float(v.double().norm())} for k, v in sorted(state.items())}
    losses = [float(p["loss"]) for p in ctx.info["reward_curve"]]
    return {"rewards": rewards, "losses": losses, "adapter": adapter}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_seeded_grpo_steps_repeat_the_recorded_rewards_and_adapter(make_tiny_local, task, monkeypatch, config):
    # Each step's batches hold all 8 rollouts however late a rollout thread is (LockstepBatcher waits for
    # known rollouts), so the seeded stream's draws fall on the same rows under load too.
    got = _run(make_tiny_local(), task, monkeypatch, CONFIGS[config])
    record = os.environ.get("FLOWOPT_RECORD_GRPO_REFERENCE")
    if record:
        data = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}
        data.setdefault(record, {})[config] = got
        REFERENCE.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")
    references = json.loads(REFERENCE.read_text())
    want = references["forward-old"][config]
    assert got["rewards"] == want["rewards"]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-4, abs=1e-6)
    assert set(got["adapter"]) == set(want["adapter"])
    for key, stats in want["adapter"].items():
        assert got["adapter"][key]["norm"] == pytest.approx(stats["norm"], rel=1e-5, abs=1e-7), key
        assert got["adapter"][key]["sum"] == pytest.approx(stats["sum"], rel=1e-4, abs=1e-5), key
    before_fix = references["sampler-old"][config]
    assert got["rewards"] == before_fix["rewards"]
    for key, stats in before_fix["adapter"].items():
        assert got["adapter"][key]["norm"] == pytest.approx(stats["norm"], rel=1e-4, abs=1e-6), key


def test_a_rollout_late_by_more_than_the_batch_timeout_still_repeats_the_recording(make_tiny_local, task,
                                                                                   monkeypatch):
    # Rollout (1, 3) reaches its first call 0.8 s after the others (the lockstep timeout is 0.5 s): its
    # batch still waits for it, so the draws fall on the same rows and the recorded run repeats exactly.
    got = _run(make_tiny_local(), task, monkeypatch, CONFIGS["dapo"], late_s=0.8)
    assert _late_done == {(1, 3)}  # the delay did happen, in a rollout of the first step
    want = json.loads(REFERENCE.read_text())["forward-old"]["dapo"]
    assert got["rewards"] == want["rewards"]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-4, abs=1e-6)
