"""The GRPO sampler: inverse-CDF draws, and rows that end leave the batch without changing the others."""

from __future__ import annotations

import torch

from flowopt.optimizers.weights.sampling import inverse_cdf, sample_batch


def test_inverse_cdf_draws_in_proportion_and_never_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3]])
    uniforms = (torch.arange(10_000, dtype=torch.float32) + 0.5) / 10_000
    picked = inverse_cdf(probs.log().expand(len(uniforms), -1), uniforms)
    counts = torch.bincount(picked, minlength=5).float() / len(uniforms)
    assert torch.allclose(counts, probs[0], atol=1e-3)
    assert inverse_cdf(probs.log(), torch.tensor([0.0])).item() == 1  # u = 0 still lands on mass


def test_rows_that_end_early_leave_the_batch_and_the_rest_are_unchanged(tiny_local, monkeypatch):
    """Greedy rows ending at EOS are dropped from the KV cache; every row must match its solo run."""
    from transformers import DynamicCache

    model = tiny_local.model
    prompts = [[2, 30, 31], [2, 31], [2, 32, 33, 34], [2, 35], [2, 30], [2, 33, 31], [2, 34, 35], [2, 36]]
    solo = [sample_batch(model, [p], max_new_tokens=10, temperature=0.0, eos_ids=[], pad_id=0)[0] for p in prompts]
    # Make rows end at different steps: each row's own third greedy token counts as its EOS.
    eos = sorted({s.completion_ids[2] for s in solo[:5]})
    selected: list[int] = []
    original = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices",
                        lambda self, idx: (selected.append(len(idx)), original(self, idx))[1])
    batched = sample_batch(model, prompts, max_new_tokens=10, temperature=0.0, eos_ids=eos, pad_id=0)
    alone = [sample_batch(model, [p], max_new_tokens=10, temperature=0.0, eos_ids=eos, pad_id=0)[0] for p in prompts]
    assert selected, "no row was ever dropped from the batch"
    for b, a in zip(batched, alone):
        assert b.completion_ids == a.completion_ids and b.finish_reason == a.finish_reason
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5)
