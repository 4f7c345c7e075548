"""A training step's memory is bounded by its micro-batches' padded positions, without changing the step."""

from __future__ import annotations

import pytest
import torch

from flowopt.lm.packing import micro_batches, pack, padded_length
from flowopt.optimizers.weights import sft
from flowopt.optimizers.weights.policy import LoraSettings, Policy


def test_micro_batches_sort_by_length_and_keep_both_bounds():
    lengths = [9, 2, 7, 3, 3, 8, 1, 30]
    groups = micro_batches(lengths, max_rows=3, max_tokens=20)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row exactly once
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(lengths)  # similar lengths together: little padding
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) <= 3
        assert len(g) * longest <= 20 or len(g) == 1  # a row longer than the budget goes alone
    assert [lengths[i] for i in groups[-1]] == [30]
    assert micro_batches([4, 4, 4], max_rows=2) == [[0, 1], [2]]  # no token bound: rows only


def test_padded_lengths_take_few_widths():
    assert [padded_length(n, 64) for n in (1, 64, 65, 250, 555)] == [64, 64, 128, 256, 576]
    with pytest.raises(ValueError):
        pack([[5]], [[6]], pad_id=0, pad_to_multiple_of=0)


@pytest.mark.parametrize("bad", [{"max_rows": 0}, {"max_rows": 2, "max_tokens": 0}])
def test_micro_batches_refuse_empty_bounds(bad):
    with pytest.raises(ValueError):
        micro_batches([1, 2], **bad)


def _pairs(policy: Policy) -> list[tuple[list[int], list[int]]]:
    texts = [("Cue: red Word:", "cat"), ("Noise: sun moon Cue: blue Word:", "dog"), ("Cue: green", "owl"),
             ("Noise: tree Cue: red Noise: sun moon Word:", "cat")]
    return [(policy.render([{"role": "user", "content": t}]), policy.completion_ids(w)) for t, w in texts]


def test_token_budget_splits_the_forward_but_not_the_step(make_tiny_local, monkeypatch):
    """The step with micro-batches of a few padded positions equals the step over the whole batch at once,
    and the budget does cut the batch into several forward passes (each no wider than the budget allows)."""
    shapes: list[tuple[int, int]] = []
    widths: set[int] = set()
    score = sft.completion_logprobs

    def recording(model, batch, *args, **kwargs):
        shapes.append((len(batch.input_ids), int(batch.attention_mask.sum(1).max())))  # rows, longest row
        widths.add(int(batch.input_ids.shape[1]))
        return score(model, batch, *args, **kwargs)

    monkeypatch.setattr(sft, "completion_logprobs", recording)
    states, losses = [], []
    for budget in (None, 2 * sft.WIDTH_MULTIPLE):  # every pair is padded to one multiple: two rows a pass
        policy = Policy(make_tiny_local(), lora=LoraSettings(r=4, alpha=8))
        policy.start_adapter("budget", seed=0)
        pairs = _pairs(policy)
        shapes.clear()
        losses.append(sft.sft_train(policy, pairs, epochs=2, learning_rate=1e-2, batch_size=4,
                                    micro_batch_tokens=budget))
        states.append(policy.adapter_state())
        if budget is None:
            assert len(shapes) == 2  # one forward per step
        else:
            assert len(shapes) > 2
            assert all(rows == 1 or rows * longest <= budget for rows, longest in shapes)
            assert any(rows > 1 for rows, _ in shapes)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert all(torch.allclose(states[0][k], states[1][k], atol=1e-6) for k in states[0])
    assert widths == {sft.WIDTH_MULTIPLE}  # every forward had the same shape's width: kernels are reused


def test_padding_to_a_width_multiple_leaves_the_log_probs_unchanged(make_tiny_local):
    """Training pads each micro-batch's width up to a multiple (so shapes repeat); the extra left padding is
    masked, so the completion log-probs are those of the tight batch."""
    policy = Policy(make_tiny_local(), lora=LoraSettings(r=4, alpha=8))
    pairs = _pairs(policy)
    prompts, completions = [p for p, _ in pairs], [c for _, c in pairs]
    tight = pack(prompts, completions, policy.pad_id)
    padded = pack(prompts, completions, policy.pad_id, pad_to_multiple_of=16)
    assert padded.input_ids.shape[1] % 16 == 0 and padded.input_ids.shape[1] > tight.input_ids.shape[1]
    with torch.no_grad():
        expected = sft.completion_logprobs(policy.model, tight)
        got = sft.completion_logprobs(policy.model, padded)
    assert torch.allclose(got, expected, atol=1e-5)
    assert bool((expected != 0).any())


def test_finetune_stage_checks_the_token_budget():
    from flowopt.errors import ConfigError

    with pytest.raises(ConfigError):
        sft.BootstrapFinetune(labels="only", micro_batch_tokens=0)
    assert sft.BootstrapFinetune(labels="only", micro_batch_tokens=None).micro_batch_tokens is None


def test_training_keeps_one_frozen_copy_of_the_base_weights_in_their_dtype():
    """A bf16 student trains without float32 copies of its weights and without a second model: every base
    tensor keeps its dtype, storage and values, the reference model is the same storage with the adapter
    off, and only the adapter's parameters take gradients."""
    from flowopt.lm.local import LocalLM
    from flowopt.optimizers.weights.tiny import tiny_causal_lm
    from tests.optimizers.weights.conftest import WORDS

    model, tokenizer = tiny_causal_lm(WORDS, seed=0)
    local = LocalLM.from_model(model.to(torch.bfloat16), tokenizer, name="tiny-bf16", max_new_tokens=4)
    try:
        policy = Policy(local, lora=LoraSettings(r=4, alpha=8))
        policy.start_adapter("dtype", seed=0)
        base = {n: (p.dtype, p.data_ptr(), p.detach().clone()) for n, p in policy.model.named_parameters()
                if "lora_" not in n}
        sft.sft_train(policy, _pairs(policy), epochs=1, learning_rate=1e-2, batch_size=4, micro_batch_tokens=24)
        params = dict(policy.model.named_parameters())
        for name, (dtype, pointer, value) in base.items():
            p = params[name]
            assert p.dtype == dtype == torch.bfloat16 and p.data_ptr() == pointer and not p.requires_grad, name
            assert torch.equal(p.detach(), value), name
        assert {id(p) for p in policy.trainable_parameters()} == {id(p) for n, p in params.items() if "lora_" in n}
        with policy.reference() as reference:
            assert {n: p.data_ptr() for n, p in reference.named_parameters() if n in base} == {
                n: pointer for n, (_, pointer, _) in base.items()}
    finally:
        local.close()


def test_out_of_memory_suggests_a_smaller_token_budget():
    from flowopt.errors import OutOfMemoryError
    from flowopt.optimizers.weights.memory import out_of_memory_errors

    stage = sft.BootstrapFinetune(labels="only", micro_batch_tokens=768)
    assert "micro_batch_tokens" in stage.memory_settings  # may change on resume: same training, less memory
    guard = out_of_memory_errors("finetune", {"micro_batch_tokens": 768, "gradient_checkpointing": False}, {},
                                 resume_note="nothing is lost")
    with pytest.raises(OutOfMemoryError) as caught, guard:
        raise MemoryError("cannot allocate")
    assert "micro_batch_tokens=768 -> 384" in str(caught.value)
