"""Packed prefill (flowopt.lm.prefill): prompts admitted together share rows, and each decodes as it would alone."""

from __future__ import annotations

import pytest
import torch

from flowopt.lm.decoder import Decoder
from flowopt.lm.prefill import pack_prompts, packed_masks
from flowopt.lm.sampling import RowSettings, sample

TEXTS = ["Question: What is two plus two?", "The quick brown fox jumps over the lazy dog. A stitch in time saves",
         "hello", "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 and symbols [[ ## ]] $ % , . ; : ! ? Reasoning:"]


def test_pack_prompts_fills_rows_longest_first_within_capacity():
    prompts = [[1] * 5, [2] * 9, [3] * 2, [4] * 4, [5] * 12]
    packed = pack_prompts(prompts, pad=0, capacity=10, width_multiple=5)
    # A row holds max(capacity, longest) = 12 tokens. Longest first: 12 -> row 0; 9 -> row 1; 5 -> row 2;
    # 4 -> row 2 (9 + 4 > 12); 2 -> row 1 (the first row it fits).
    assert packed.places == [(2, 0), (1, 0), (1, 9), (2, 5), (0, 0)]
    assert packed.ids.shape == (3, 15)  # the fullest row's 12 tokens, rounded up to a multiple of 5
    for i, prompt in enumerate(prompts):
        row, first = packed.places[i]
        assert packed.ids[row, first:first + len(prompt)].tolist() == prompt
        assert packed.positions[row, first:first + len(prompt)].tolist() == list(range(len(prompt)))
        assert (packed.segments[row, first:first + len(prompt)] == i).all()
    assert int((packed.segments >= 0).sum()) == sum(len(p) for p in prompts)  # the rest is padding
    with pytest.raises(ValueError, match="at least one token"):
        pack_prompts([[1], []], pad=0, capacity=8, width_multiple=1)


def test_packed_masks_keep_prompts_apart_and_apply_the_window():
    segments = torch.tensor([[0, 0, 0, 1, 1, -1]])
    masks = packed_masks(segments, window=2)
    full, sliding = masks["full_attention"][0, 0], masks["sliding_attention"][0, 0]
    assert full[2].tolist() == [True, True, True, False, False, False]
    assert full[4].tolist() == [False, False, False, True, True, False]  # the second prompt sees only itself
    assert sliding[2].tolist() == [False, True, True, False, False, False]  # the last 2 of its own tokens
    assert full[5].tolist() == [False] * 5 + [True]  # padding sees itself only: no empty softmax row


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # eager attention adds its masks: they are converted
def test_prompts_prefilled_together_decode_as_each_does_alone(tiny_local, tiny_model_dir, attention):
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_local.tokenizer
    model = tiny_local.model if attention == "sdpa" else AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True).eval()
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert max(len(p) for p in prompts) > 16  # longer than the tiny model's sliding window
    settings = RowSettings(max_new_tokens=10, logprobs=True)
    decoder = Decoder(lambda: model, tokenizer)
    together = sample(model, tokenizer, prompts, [settings] * len(prompts), decoder=decoder)
    alone = [sample(model, tokenizer, [p], [settings], decoder=Decoder(lambda: model, tokenizer))[0] for p in prompts]
    for joint, single in zip(together, alone):
        assert joint.completion_ids == single.completion_ids
        assert torch.allclose(joint.logprobs, single.logprobs, atol=1e-5)
    assert any(s.completion_ids for s in alone)
