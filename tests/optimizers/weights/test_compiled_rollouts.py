"""GRPO on a LocalLM whose decode step is compiled (the default on CUDA): the first compiled step points the
model at flowopt's decode attention (flowopt.lm.attention), and the rollouts' decoder made after it, the
learner's forwards and the sampler/learner log-prob match all work on the model as it then is."""

from __future__ import annotations

import torch

from flowopt.lm.attention import DECODE_ATTENTION
from flowopt.lm.decoder import CompileSettings
from flowopt.lm.sampling import RowSettings
from flowopt.optimizers.weights.learner import GRPOLearner, ScoredTransition
from flowopt.optimizers.weights.policy import LoraSettings, Policy


def test_grpo_rollouts_and_an_update_after_a_compiled_step_switched_the_models_attention(make_tiny_local):
    local = make_tiny_local()
    # aot_eager: dynamo captures the step without inductor's code generation, so the test stays fast.
    local.compile_settings = CompileSettings(enabled=True, backend="aot_eager")
    prompt = local.render([{"role": "user", "content": "cue : red word :"}])
    served = local.complete_ids(prompt, RowSettings(max_new_tokens=3))  # the batcher's decoder compiles
    assert served.completion_ids and local.model.config._attn_implementation == DECODE_ATTENTION
    assert local.decode_stats.eager_reason is None

    policy = Policy(local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("compiled")
    rows = [RowSettings(max_new_tokens=4, temperature=1.0, logprobs=True)] * 8
    out = local.sample_ids([prompt] * 8, rows, adapter=policy.adapter, generator=torch.Generator().manual_seed(0))
    items = [ScoredTransition(prompt, o.completion_ids, o.logprobs.tolist(), 1.0 if i % 2 else -1.0)
             for i, o in enumerate(out)]
    stats = GRPOLearner(policy, total_steps=1, learning_rate=1e-2).update(items)
    assert not stats.skipped and stats.sampler_logprob_gap < 1e-4
