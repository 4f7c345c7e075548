"""The one sampler: inverse-CDF draws, per-row settings, early exit, and log-probs the scorer reproduces."""

from __future__ import annotations

import pytest
import torch

from flowopt.lm.packing import pack
from flowopt.lm.sampling import RowSettings, inverse_cdf, sample
from flowopt.lm.scoring import completion_logprobs

PROMPTS = [[2, 30, 31], [2, 31], [2, 32, 33, 34], [2, 35], [2, 30], [2, 33, 31], [2, 34, 35], [2, 36]]


def test_inverse_cdf_draws_in_proportion_and_never_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3]])
    uniforms = (torch.arange(10_000, dtype=torch.float32) + 0.5) / 10_000
    picked = inverse_cdf(probs.log().expand(len(uniforms), -1), uniforms)
    counts = torch.bincount(picked, minlength=5).float() / len(uniforms)
    assert torch.allclose(counts, probs[0], atol=1e-3)
    assert inverse_cdf(probs.log(), torch.tensor([0.0])).item() == 1  # u = 0 still lands on mass


def test_rows_that_end_early_leave_the_batch_and_the_rest_are_unchanged(tiny_local, monkeypatch):
    """Rows with their own limits, temperatures and seeds end at different steps and leave the batch (their
    slots freed) while the others go on; every row must match its solo run, log-probs included."""
    from flowopt.lm.decoder import Decoder

    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    rows = [RowSettings(max_new_tokens=2 + i, temperature=0.0 if i % 2 else 0.8, seed=50 + i, logprobs=True)
            for i in range(len(PROMPTS))]
    running: list[int] = []
    original = Decoder.harvest
    monkeypatch.setattr(Decoder, "harvest", lambda self, run: (original(self, run), running.append(len(run.rows)))[0])
    batched = sample(model, tokenizer, PROMPTS, rows)
    assert any(0 < n < len(PROMPTS) for n in running), "no row left the batch while others ran"
    alone = [sample(model, tokenizer, [p], [r])[0] for p, r in zip(PROMPTS, rows)]
    for b, a, row in zip(batched, alone, rows):
        assert b.completion_ids == a.completion_ids and b.finish_reason == a.finish_reason
        assert len(b.completion_ids) <= row.max_new_tokens
        assert torch.allclose(b.logprobs, a.logprobs, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sampler_logprobs_equal_the_scorers_at_the_sampling_temperature(tiny_local, temperature):
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    rows = [RowSettings(max_new_tokens=6, temperature=temperature, seed=i, logprobs=True) for i in range(4)]
    out = sample(model, tokenizer, PROMPTS[:4], rows)
    batch = pack([s.prompt_ids for s in out], [s.completion_ids for s in out], tiny_local.pad_id)
    with torch.no_grad():
        scored = completion_logprobs(model, batch, temperature or 1.0)
    for i, s in enumerate(out):
        assert torch.allclose(scored[i, :len(s.completion_ids)], s.logprobs, atol=1e-5)


def test_one_generator_seeds_the_whole_batch_and_top_k_1_is_greedy(tiny_local):
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    rows = [RowSettings(max_new_tokens=6, temperature=1.0)] * 4
    first = sample(model, tokenizer, PROMPTS[:4], rows, generator=torch.Generator().manual_seed(3))
    again = sample(model, tokenizer, PROMPTS[:4], rows, generator=torch.Generator().manual_seed(3))
    assert [s.completion_ids for s in first] == [s.completion_ids for s in again]
    greedy = sample(model, tokenizer, PROMPTS[:4], [RowSettings(max_new_tokens=6)] * 4)
    top1 = sample(model, tokenizer, PROMPTS[:4], [RowSettings(max_new_tokens=6, temperature=1.5, top_k=1, seed=i)
                                                  for i in range(4)])
    assert [s.completion_ids for s in top1] == [s.completion_ids for s in greedy]


def test_a_stop_string_ends_its_row_only(tiny_local):
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    free = sample(model, tokenizer, PROMPTS[:2], [RowSettings(max_new_tokens=8)] * 2)
    word = tokenizer.decode(free[0].completion_ids[1:2], skip_special_tokens=True).strip()
    assert word, "the greedy completion needs a second token with text"
    rows = [RowSettings(max_new_tokens=8, stop=(word,)), RowSettings(max_new_tokens=8)]
    out = sample(model, tokenizer, PROMPTS[:2], rows)
    assert out[0].finish_reason == "stop" and word not in out[0].text
    assert len(out[0].completion_ids) < len(free[0].completion_ids) or free[0].finish_reason == "stop"
    assert out[1].completion_ids == free[1].completion_ids


def test_a_seeded_row_draws_with_its_own_multinomial_whatever_rows_run_beside_it(tiny_local):
    # Without a batch generator, a seeded row's token is torch.multinomial's draw from its own generator
    # (an exponential race, robust to the batch's rounding), the same alone and batched.
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    seeded = [RowSettings(max_new_tokens=1, temperature=0.8, seed=10 + i, logprobs=True) for i in range(4)]
    batched = sample(model, tokenizer, PROMPTS[:4], seeded)
    for i, s in enumerate(batched):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPTS[i]])).logits[0, -1].float() / 0.8
        probs = torch.softmax(logits, -1)
        expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(10 + i)).item()
        assert s.completion_ids == [expected]
        assert sample(model, tokenizer, [PROMPTS[i]], [seeded[i]])[0].completion_ids == [expected]


def test_choose_takes_the_steps_argmax_for_greedy_rows_and_recomputes_it_beside_sampled_ones():
    from flowopt.lm.decode import Row, choose

    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    greedy_rows = [Row([1], RowSettings(max_new_tokens=2)) for _ in range(2)]
    assert choose(greedy_rows, logits, None)[0] == [1, 0]
    # a compiled step hands over its in-graph argmax and greedy rows take it as is (here a made-up one, to see it)
    assert choose(greedy_rows, logits, None, torch.tensor([2, 2]))[0] == [2, 2]
    # beside a sampled row the argmax comes from the scores again: the greedy row gets its true argmax
    mixed = [Row([1], RowSettings(max_new_tokens=2), index=0),
             Row([1], RowSettings(max_new_tokens=2, temperature=1.0, top_k=1), index=1)]
    assert choose(mixed, logits, torch.tensor([0.5, 0.5]), torch.tensor([2, 2]))[0] == [1, 0]
