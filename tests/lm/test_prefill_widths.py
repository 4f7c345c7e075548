"""Prefill widths are padded to a multiple (so that on CPU a few matmul shapes repeat and oneDNN's per-shape
kernels stop piling up while scoring); the padding is masked, so tokens and log-probs do not change.
Prompts admitted together are packed into shared rows (flowopt.lm.prefill)."""

from __future__ import annotations

import pytest
import torch

from flowopt.errors import ConfigError
from flowopt.lm.decode import Row
from flowopt.lm.decoder import Decoder, DecodeRun
from flowopt.lm.packing import WIDTH_MULTIPLE, padded_length
from flowopt.lm.prefill import PACK_TOKENS
from flowopt.lm.sampling import RowSettings, sample

TEXTS = ["Question: What is two plus two?", "The quick brown fox jumps over the lazy dog. A stitch in time saves",
         "hello", "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 and symbols [[ ## ]] $ % , . ; : ! ? Reasoning:"]


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def test_padded_prefill_leaves_greedy_tokens_and_logprobs_unchanged(tiny_local):
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    prompts = _prompts(tokenizer)
    assert len({len(p) for p in prompts}) == len(prompts) and max(len(p) for p in prompts) > 16  # > sliding window
    rows = [RowSettings(max_new_tokens=10, logprobs=True)] * len(prompts)
    outs = {m: sample(model, tokenizer, prompts, rows, decoder=Decoder(lambda: model, tokenizer, width_multiple=m))
            for m in (1, 7, WIDTH_MULTIPLE)}
    for m in (7, WIDTH_MULTIPLE):
        for tight, padded in zip(outs[1], outs[m]):
            assert padded.completion_ids == tight.completion_ids
            assert torch.allclose(padded.logprobs, tight.logprobs, atol=1e-5)
    assert any(s.completion_ids for s in outs[1])


def _joined(decoder: Decoder, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """The first prompt decodes alone for three steps, then the others join the running batch."""
    settings = RowSettings(max_new_tokens=8, logprobs=True)
    first, later = Row(list(prompts[0]), settings), [Row(list(p), settings) for p in prompts[1:]]
    run = DecodeRun()
    decoder.admit(run, [first])
    for _ in range(3):
        decoder.step(run)
        decoder.harvest(run)
    decoder.admit(run, later)  # longer prompts: the running row's columns shift right
    decoder.harvest(run)
    while run.rows:
        decoder.step(run)
        decoder.harvest(run)
    return [(r.tokens, r.logps) for r in (first, *later)]


def test_rows_joining_a_running_batch_decode_the_same_with_padded_widths(tiny_local):
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    prompts = _prompts(tokenizer)
    prompts = [prompts[2], prompts[1], prompts[3]]  # the shortest first, so the joining rows need a shift
    tight = _joined(Decoder(lambda: model, tokenizer, width_multiple=1), prompts)
    padded = _joined(Decoder(lambda: model, tokenizer, width_multiple=WIDTH_MULTIPLE), prompts)
    for (tokens, logps), (want_tokens, want_logps) in zip(padded, tight):
        assert tokens == want_tokens
        assert logps == pytest.approx(want_logps, abs=1e-5)


def test_the_model_sees_only_bucketed_prefill_widths(tiny_local):
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    decoder = Decoder(lambda: model, tokenizer)
    widths: list[int] = []
    hook = decoder.parts().decoder.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(int(kwargs["input_ids"].shape[1])), with_kwargs=True)
    try:
        prompts = _prompts(tokenizer)
        long_prompt = prompts[1] * 3  # over one multiple
        for batch in ([prompts[0]], prompts[:2], prompts, [long_prompt, prompts[2]]):
            sample(model, tokenizer, batch, [RowSettings(max_new_tokens=3)] * len(batch), decoder=decoder)
    finally:
        hook.remove()
    prefills = [w for w in widths if w != 1]  # decode steps feed one column
    assert len(prefills) == 4
    assert all(w % WIDTH_MULTIPLE == 0 for w in prefills)
    # the prompts of each batch are packed into one row (flowopt.lm.prefill), its width rounded up
    batches = ([prompts[0]], prompts[:2], prompts, [long_prompt, prompts[2]])
    assert all(sum(len(p) for p in batch) <= PACK_TOKENS for batch in batches)
    assert prefills == [padded_length(sum(len(p) for p in batch), WIDTH_MULTIPLE) for batch in batches]
    assert prefills[0] == WIDTH_MULTIPLE < prefills[3]
    with pytest.raises(ConfigError, match="width_multiple"):
        Decoder(lambda: model, tokenizer, width_multiple=0)
