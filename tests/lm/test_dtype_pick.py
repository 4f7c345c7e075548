"""Which dtype LocalLM picks when none is given: bf16 where the hardware computes in it, else float32."""

from __future__ import annotations

import pytest
import torch

from flowopt.errors import ConfigError
from flowopt.lm import loading as loading_module
from flowopt.lm.loading import pick_dtype
from flowopt.lm.local import LocalLM


@pytest.mark.parametrize(("avx512_bf16", "amx", "expected"), [
    (True, False, torch.bfloat16),
    (False, True, torch.bfloat16),
    (False, False, torch.float32),
])
def test_cpu_default_follows_native_bf16_support(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert pick_dtype("cpu") == expected


def test_an_explicit_dtype_wins_and_a_bad_one_names_the_choices(monkeypatch):
    monkeypatch.setattr(loading_module, "cpu_has_native_bf16", lambda: True)
    assert pick_dtype("cpu", "float32") == torch.float32
    assert pick_dtype("cpu", torch.float16) == torch.float16
    with pytest.raises(ConfigError, match="bfloat16"):
        pick_dtype("cpu", "float33")


def test_a_bf16_local_model_generates_and_scores(tiny_model_dir):
    local = LocalLM(tiny_model_dir, device="cpu", dtype="bfloat16", max_new_tokens=6)
    try:
        assert local.dtype == torch.bfloat16
        sample = local.generate(["Question: red\nAnswer:"], max_new_tokens=6)[0]
        assert 1 <= len(sample.completion_ids) <= 6
        scores = local.token_logprobs([sample.prompt_ids], [sample.completion_ids])
        assert scores.shape == (1, len(sample.completion_ids))
        assert torch.isfinite(scores).all() and (scores <= 0).all()
        # LoRA weights train in float32 over the bf16 base (PEFT's adapter autocast), for both the
        # first adapter and a later one.
        for name in ("first", "second"):
            model = local.add_adapter(name)
            trainable = [p for p in model.parameters() if p.requires_grad]
            assert trainable and all(p.dtype == torch.float32 for p in trainable)
    finally:
        local.close()


def test_the_output_projection_always_gets_a_contiguous_input(tiny_model_dir):
    """transformers hands lm_head a strided slice of the hidden states; on CPU in bf16 with frozen
    weights (any LoRA) torch's linear then copies the whole weight per row (seconds, not milliseconds)."""
    local = LocalLM(tiny_model_dir, device="cpu", dtype="bfloat16", max_new_tokens=4)
    try:
        local.add_adapter("frozen-base")  # PEFT freezes the base weights: the slow case
        head = local.base_model.get_output_embeddings()
        seen = []
        head.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
        prompt = local.render("Question: red\nAnswer:")
        local.token_logprobs([prompt, prompt[:3]], [[5, 6, 7], [8]])  # keeps 4 of the last positions
        local.generate(["Question: red\nAnswer:"], max_new_tokens=3, logprobs=False)
        assert seen and all(seen)
        hooks_before = len(head._forward_pre_hooks)
        LocalLM.from_model(local.base_model, local.tokenizer, name="again").close()  # wrapping twice adds none
        assert len(head._forward_pre_hooks) == hooks_before
    finally:
        local.close()
