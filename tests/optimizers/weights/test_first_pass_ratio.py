"""Issue 16 fix 1: the first pass's old log-probs are the training forward's own (detached), so its ratio is
exactly 1 wherever the sampler's log-probs differ from the training forward's (bf16, a KV cache, or a
separate inference engine; here the sampler's values are shifted by +-0.05 to stand for that gap)."""

from __future__ import annotations

import pytest
import torch

from flowopt.lm.sampling import RowSettings
from flowopt.optimizers.weights.learner import GRPOLearner, ScoredTransition
from flowopt.optimizers.weights.policy import LoraSettings, Policy


def _items(policy: Policy, shift: float) -> list[ScoredTransition]:
    prompt = policy.render([{"role": "user", "content": "cue : red word :"}])
    rows = [RowSettings(max_new_tokens=4, temperature=1.0, logprobs=True)] * 16
    gen = torch.Generator().manual_seed(0)
    out = policy.local.sample_ids([prompt] * 16, rows, adapter=policy.adapter, generator=gen)
    return [ScoredTransition(prompt, o.completion_ids, [v + (shift if j % 2 else -shift) for j, v in
                                                        enumerate(o.logprobs.tolist())], 1.0 if i % 2 else -1.0)
            for i, o in enumerate(out)]


def test_first_pass_ratio_is_one_whatever_the_sampler_reported(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("first-pass")
    items = _items(policy, shift=0.05)
    # A 1e-6 clip range: any first-pass ratio off 1 by more would clip its token.
    learner = GRPOLearner(policy, total_steps=2, learning_rate=1e-3, epsilon=1e-6, micro_batch_size=5, passes=2)
    stats = learner.update(items)
    assert stats.sampler_logprob_gap == pytest.approx(0.05, abs=1e-4)  # the gap is reported...
    # ...but not used: the last pass (the second) compares with the first pass's forward, moved by one
    # step, so some tokens clip there; a fresh learner's single first pass clips none.
    single = GRPOLearner(policy, total_steps=1, learning_rate=1e-3, epsilon=1e-6, micro_batch_size=5)
    first = single.update(_items(policy, shift=0.05))
    assert first.clip_low == 0.0 and first.clip_high == 0.0
    assert stats.clip_low + stats.clip_high > 0.0
