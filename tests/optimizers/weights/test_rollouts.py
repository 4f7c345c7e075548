"""Rollouts: B x G program runs through the local engine in lockstep, reusing a thread pool."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("workers", [8, 2])
def test_rollouts_reuse_a_shared_pool_or_start_their_own_when_it_is_too_small(tiny_local, task, workers):
    from concurrent.futures import ThreadPoolExecutor

    import dspy
    import torch

    from flowopt.lm import CompletionAdapter
    from flowopt.optimizers.weights.policy import LoraSettings, Policy
    from flowopt.optimizers.weights.rollout import run_rollouts

    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("pool-test")
    examples = task.examples(2, seed=0)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        runs = [run_rollouts(dspy.Predict("noise, cue -> word"), examples, 4, policy, temperature=1.0,
                             max_new_tokens=3, generator=torch.Generator().manual_seed(0), pool=pool,
                             adapter=CompletionAdapter(continue_missing=False)) for _ in range(2)]
    for rollouts in runs:
        assert len(rollouts) == 8 and all(len(r.transitions) == 1 for r in rollouts)
    # Same seed, same draws: reusing the threads changes nothing about the samples.
    assert [t.completion_ids for r in runs[0] for t in r.transitions] == \
           [t.completion_ids for r in runs[1] for t in r.transitions]
