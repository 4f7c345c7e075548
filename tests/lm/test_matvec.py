"""Batch-1 half-precision decode steps on CPU multiply by each weight as a matrix-vector product: the same
function as F.linear (to rounding), used only where it applies, and greedy decoding keeps its tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowopt.lm import matvec
from flowopt.lm.decoder import Decoder
from flowopt.lm.sampling import RowSettings, sample

TEXTS = ["Question: What is two plus two?", "The quick brown fox jumps over the lazy dog. A stitch in time saves"]


def test_one_half_precision_row_is_a_matrix_vector_product_and_the_rest_is_untouched():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=gen)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(1, 1, 32, generator=gen)
    with matvec.SingleRowMatVec():
        one = F.linear(x.bfloat16(), w.bfloat16(), bias.bfloat16())
        full = torch.nn.Linear(32, 48).bfloat16()(x.bfloat16())  # a module's forward goes through the mode too
        rows = F.linear(x.expand(1, 3, 32).bfloat16(), w.bfloat16())
        single = F.linear(x, w)
    assert one.shape == (1, 1, 48) and one.dtype == torch.bfloat16 and full.shape == (1, 1, 48)
    assert torch.allclose(one.float(), F.linear(x, w, bias), atol=0.1, rtol=0.02)
    assert torch.equal(rows, F.linear(x.expand(1, 3, 32).bfloat16(), w.bfloat16()))  # several rows: untouched
    assert torch.equal(single, F.linear(x, w))  # float32: untouched
    assert matvec.applies(torch.device("cpu"), torch.bfloat16, 1)
    assert not matvec.applies(torch.device("cpu"), torch.bfloat16, 2)
    assert not matvec.applies(torch.device("cpu"), torch.float32, 1)
    assert not matvec.applies(torch.device("cuda"), torch.bfloat16, 1)


def test_bf16_greedy_decoding_keeps_its_tokens_with_matrix_vector_steps(tiny_model_dir, monkeypatch):
    from flowopt.lm import LocalLM

    local = LocalLM(tiny_model_dir, device="cpu", dtype="bfloat16", max_new_tokens=8)
    try:
        model, tokenizer = local.model, local.tokenizer
        prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
        rows = [RowSettings(max_new_tokens=8, logprobs=True)]
        calls: list[int] = []
        mv = torch.mv
        monkeypatch.setattr(torch, "mv", lambda *a, **k: (calls.append(1), mv(*a, **k))[1])
        fast = [sample(model, tokenizer, [p], rows, decoder=Decoder(lambda: model, tokenizer))[0] for p in prompts]
        assert len(calls) > 0  # the steps did run as matrix-vector products
        monkeypatch.setattr(matvec, "applies", lambda *args: False)
        calls.clear()
        plain = [sample(model, tokenizer, [p], rows, decoder=Decoder(lambda: model, tokenizer))[0] for p in prompts]
        assert calls == []
    finally:
        local.close()
    for got, want in zip(fast, plain):
        assert got.completion_ids == want.completion_ids
        assert got.logprobs.tolist() == pytest.approx(want.logprobs.tolist(), abs=0.05)
    assert any(s.completion_ids for s in plain)
