"""The GRPO learner's memory settings: micro-batches bounded by padded tokens give the same update, and a
half-precision model with float32 LoRA weights trains under autocast without float32 copies of its
activations (issue 26: the update's peak GPU memory at most TRL's)."""

from __future__ import annotations

import pytest
import torch

from flowopt.lm.packing import pack
from flowopt.lm.sampling import RowSettings
from flowopt.lm.scoring import completion_logprobs
from flowopt.optimizers.weights import learner as learner_module
from flowopt.optimizers.weights.learner import GRPOLearner, ScoredTransition, mixed_precision
from flowopt.optimizers.weights.policy import LoraSettings, Policy


def _items(policy: Policy, n: int = 12) -> list[ScoredTransition]:
    prompt = policy.render([{"role": "user", "content": "cue : red word :"}])
    rows = [RowSettings(max_new_tokens=4, temperature=1.0, logprobs=True)] * n
    gen = torch.Generator().manual_seed(0)
    out = policy.local.sample_ids([prompt] * n, rows, adapter=policy.adapter, generator=gen)
    return [ScoredTransition(prompt, o.completion_ids, o.logprobs.tolist(), 1.0 if i % 3 else -1.0)
            for i, o in enumerate(out)]


def _trained(policy: Policy, items: list[ScoredTransition], **settings: object) -> dict[str, torch.Tensor]:
    state = policy.adapter_state()
    GRPOLearner(policy, total_steps=1, learning_rate=1e-2, beta=0.04, **settings).update(items)  # type: ignore[arg-type]
    trained = policy.adapter_state()
    policy.load_adapter_state(state)  # the next call starts from the same weights
    return trained


def test_micro_batch_tokens_splits_the_batch_and_gives_the_same_update(tiny_local, monkeypatch):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("tokens")
    items = _items(policy)
    whole = _trained(policy, items, micro_batch_size=len(items))
    forwards: list[int] = []
    original = learner_module.completion_logprobs

    def counted(model, batch, *args, **kwargs):
        forwards.append(batch.input_ids.numel())
        return original(model, batch, *args, **kwargs)

    monkeypatch.setattr(learner_module, "completion_logprobs", counted)
    longest = max(len(t.prompt_ids) + len(t.completion_ids) for t in items)
    budget = 4 * longest  # at most 4 rows per forward
    split = _trained(policy, items, micro_batch_size=len(items), micro_batch_tokens=budget)
    assert len(forwards) >= 2 * 3  # reference and training forwards, each over at least 3 micro-batches
    assert max(forwards) <= budget
    for name, value in whole.items():  # gradient accumulation: the same step as one forward of everything
        assert torch.allclose(value, split[name], atol=1e-6), name


def _saved_bytes(model: object, batch: object) -> tuple[int, torch.Tensor]:
    """Bytes of the activations the backward pass keeps (parameters left out), and the log-probs."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # type: ignore[attr-defined]
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logps = completion_logprobs(model, batch)
    return sum(saved.values()), logps


def test_bf16_model_with_float32_lora_trains_under_autocast_with_fewer_saved_bytes(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("mixed")
    model = policy.model
    model.get_base_model().to(torch.bfloat16)
    for p in policy.trainable_parameters():
        p.data = p.data.float()  # PEFT's default: float32 adapter weights on a half-precision model
    batch = pack([[2, 5, 6, 7]] * 3, [[8, 9, 3]] * 3, pad_id=policy.pad_id)
    with policy.training():
        plain_bytes, plain = _saved_bytes(model, batch)
        with mixed_precision(model):
            assert torch.is_autocast_enabled("cpu")
            mixed_bytes, mixed = _saved_bytes(model, batch)
            mixed.sum().backward()
    assert mixed_bytes < 0.9 * plain_bytes  # no float32 copy of each adapted layer's input
    assert torch.allclose(mixed, plain, atol=0.1)  # the same log-probs, to bf16's precision
    grads = [p.grad for p in policy.trainable_parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)  # the optimizer steps float32 weights
    assert any(float(g.abs().sum()) > 0 for g in grads)


def test_mixed_precision_leaves_a_float32_model_alone(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("fp32")
    with mixed_precision(policy.model):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("bad", [0, -5])
def test_grpo_stage_rejects_a_micro_batch_tokens_below_one(bad):
    from flowopt.errors import ConfigError
    from flowopt.optimizers.weights import GRPO

    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        GRPO(micro_batch_tokens=bad)


def _checkpointing_state(policy: Policy) -> tuple[int, list[object]]:
    """What a compiled decode step's guards see of gradient checkpointing: the embeddings' forward hooks and
    each layer's own ``gradient_checkpointing`` attribute."""
    base = policy.local.base_model
    layers = base.get_decoder().layers
    hooks = len(base.get_input_embeddings()._forward_hooks)
    return hooks, [layer.__dict__.get("gradient_checkpointing", "unset") for layer in layers]


def test_checkpointed_updates_leave_the_model_as_the_first_rollout_saw_it(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("ckpt")
    learner = GRPOLearner(policy, total_steps=3, learning_rate=1e-2, gradient_checkpointing=True)
    before = _checkpointing_state(policy)  # the model as the first rollout decodes with it
    for _ in range(3):
        learner.update(_items(policy, n=4))
    assert _checkpointing_state(policy) == before == (0, [False] * len(before[1]))  # no hook piled up per update


def test_a_half_precision_learner_pads_its_widths_to_the_multiple(tiny_local, monkeypatch):
    """bf16 CPU matmuls build a oneDNN kernel per shape, so a bf16 model's forwards take padded widths (a few
    shapes repeat); float32 keeps exact widths (the seeded float32 runs keep their recorded rounding)."""
    from flowopt.lm.packing import WIDTH_MULTIPLE

    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("widths")
    items = _items(policy, n=4)
    widths: list[int] = []
    original = learner_module.completion_logprobs

    def recorded(model, batch, *args, **kwargs):
        widths.append(int(batch.input_ids.shape[1]))
        return original(model, batch, *args, **kwargs)

    monkeypatch.setattr(learner_module, "completion_logprobs", recorded)
    exact = max(len(t.prompt_ids) + len(t.completion_ids) for t in items)
    _trained(policy, items)
    assert widths and max(widths) == exact < WIDTH_MULTIPLE
    widths.clear()
    model = policy.model
    model.get_base_model().to(torch.bfloat16)
    for p in policy.trainable_parameters():
        p.data = p.data.float()
    _trained(policy, items)
    assert widths and set(widths) == {WIDTH_MULTIPLE}
