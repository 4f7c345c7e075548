"""The GRPO objective against direct reference computations on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from flowopt.lm.packing import pack
from flowopt.optimizers.weights.advantages import group_advantages
from flowopt.optimizers.weights.loss import aggregate, kl_k3, sequence_weights, token_loss

# ----------------------------------------------------------------------------- advantages


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # unbiased, as TRL
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 0.0, 3.0]]


def test_group_advantages_match_hand_computation():
    got = group_advantages(torch.tensor(REWARDS), "group", eps=1e-4)
    for row, out in zip(REWARDS, got.tolist()):
        m, s = _mean(row), _std(row)
        assert out == pytest.approx([(r - m) / (s + 1e-4) for r in row], abs=1e-6)
    assert got[1].abs().max() == 0.0  # a group of equal rewards teaches nothing


def test_batch_scaling_uses_one_std_and_group_means():
    got = group_advantages(torch.tensor(REWARDS), "batch", eps=1e-4)
    s = _std([r for row in REWARDS for r in row])
    for row, out in zip(REWARDS, got.tolist()):
        m = _mean(row)
        assert out == pytest.approx([(r - m) / (s + 1e-4) for r in row], abs=1e-6)


def test_no_scaling_only_centres():
    got = group_advantages(torch.tensor(REWARDS), "none")
    for row, out in zip(REWARDS, got.tolist()):
        assert out == pytest.approx([r - _mean(row) for r in row], abs=1e-6)


def test_advantage_errors():
    with pytest.raises(ValueError, match="scaling"):
        group_advantages(torch.zeros(2, 2), "median")
    with pytest.raises(ValueError, match="shape"):
        group_advantages(torch.zeros(4), "group")


# ----------------------------------------------------------------------------- clipped surrogate


def _reference_token(logp, old, adv, eps_low, eps_high, beta=0.0, ref=None):
    ratio = math.exp(logp - old)
    clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
    value = -min(ratio * adv, clipped * adv)
    if beta:
        d = ref - logp
        value += beta * (math.exp(d) - d - 1)
    return value


def test_token_loss_matches_reference_and_clips_both_sides():
    # rows: positive advantage with a large ratio (clipped above), negative advantage with a small ratio
    # (clipped below), and ratios inside the trust region (not clipped).
    logp = torch.tensor([[-0.5, -1.0, -2.0], [-3.0, -1.0, -0.2], [-1.0, -1.05, -0.95]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    adv = torch.tensor([2.0, -1.5, 0.7])
    out = token_loss(logp, old, adv, epsilon=0.2, epsilon_high=0.28)
    for i in range(3):
        for j in range(3):
            expected = _reference_token(float(logp[i, j]), float(old[i, j]), float(adv[i]), 0.2, 0.28)
            assert float(out.loss[i, j]) == pytest.approx(expected, rel=1e-6)
    # row 0 token 0: ratio e^0.5 = 1.65 > 1.28 with A > 0 -> clipped above, no gradient through it
    assert bool(out.clipped_high[0, 0]) and not bool(out.clipped_low[0, 0])
    # row 1 token 0: ratio e^-2 = 0.14 < 0.8 with A < 0 -> clipped below
    assert bool(out.clipped_low[1, 0]) and not bool(out.clipped_high[1, 0])
    # a large ratio with a negative advantage is NOT clipped (pessimistic bound keeps the gradient)
    assert not bool(out.clipped_low[1, 2]) and not bool(out.clipped_high[1, 2])
    assert not out.clipped_low[2].any() and not out.clipped_high[2].any()


def test_clipped_tokens_get_no_gradient_and_unclipped_get_the_policy_gradient():
    logp = torch.tensor([[0.0, -2.0]], requires_grad=True)  # ratio e^1 (clipped above), e^-1 (inside? no: 0.37)
    old = torch.tensor([[-1.0, -1.0]])
    adv = torch.tensor([1.0])
    loss = token_loss(logp, old, adv, epsilon=0.2, epsilon_high=0.2).loss.sum()
    loss.backward()
    # token 0: clipped above with A > 0 -> zero gradient; token 1: ratio 0.37 < 0.8 but A > 0, so the
    # min picks the unclipped term and the gradient is -A * ratio.
    assert logp.grad[0, 0] == 0.0
    assert float(logp.grad[0, 1]) == pytest.approx(-math.exp(-1.0), rel=1e-6)


def test_epsilon_high_defaults_to_epsilon():
    logp, old, adv = torch.tensor([[0.3]]), torch.tensor([[0.0]]), torch.tensor([1.0])
    a = token_loss(logp, old, adv, epsilon=0.2).loss
    b = token_loss(logp, old, adv, epsilon=0.2, epsilon_high=0.2).loss
    assert torch.equal(a, b)
    assert float(a) == pytest.approx(-1.2)


# ----------------------------------------------------------------------------- KL


def test_k3_kl_matches_formula_and_is_non_negative():
    logp = torch.tensor([[-1.0, -0.5, -2.0, -0.1]])
    ref = torch.tensor([[-1.0, -1.5, -0.5, -0.3]])
    got = kl_k3(logp, ref)
    for j in range(4):
        d = float(ref[0, j] - logp[0, j])
        assert float(got[0, j]) == pytest.approx(math.exp(d) - d - 1, rel=1e-6)
    assert float(got[0, 0]) == 0.0 and (got >= 0).all()


def test_k3_is_an_unbiased_kl_estimate():
    # Samples from p; mean of k3 approaches KL(p || q).
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    estimate = kl_k3(p.log()[samples], q.log()[samples]).mean()
    exact = float((p * (p / q).log()).sum())
    assert float(estimate) == pytest.approx(exact, abs=0.01)


def test_beta_adds_kl_per_token():
    logp = torch.tensor([[-1.0, -0.5]])
    old = logp.clone()
    ref = torch.tensor([[-1.2, -0.1]])
    adv = torch.tensor([0.5])
    out = token_loss(logp, old, adv, epsilon=0.2, beta=0.1, ref_logps=ref)
    for j in range(2):
        expected = _reference_token(float(logp[0, j]), float(old[0, j]), 0.5, 0.2, 0.2, 0.1, float(ref[0, j]))
        assert float(out.loss[0, j]) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logps"):
        token_loss(logp, old, adv, beta=0.1)


# ----------------------------------------------------------------------------- aggregation and masking

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [5.0, 6.0, 100.0, 100.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])


def test_grpo_aggregation_is_mean_of_sequence_means():
    expected = _mean([_mean([1, 2, 3]), 4.0, _mean([5, 6])])
    assert float(aggregate(PER_TOKEN, MASK, "grpo")) == pytest.approx(expected)


def test_dapo_aggregation_is_token_mean():
    expected = _mean([1, 2, 3, 4, 5, 6])
    assert float(aggregate(PER_TOKEN, MASK, "dapo")) == pytest.approx(expected)


def test_masked_tokens_never_count():
    changed = PER_TOKEN.clone()
    changed[MASK == 0] = -1e6
    for mode in ("grpo", "dapo"):
        assert float(aggregate(changed, MASK, mode)) == pytest.approx(float(aggregate(PER_TOKEN, MASK, mode)))


def test_accumulated_micro_batches_equal_the_full_batch():
    for mode in ("grpo", "dapo"):
        full = aggregate(PER_TOKEN, MASK, mode)
        parts = sum(aggregate(PER_TOKEN[i:i + 1], MASK[i:i + 1], mode, total_sequences=3, total_tokens=6)
                    for i in range(3))
        assert float(parts) == pytest.approx(float(full))


def test_unknown_aggregation():
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(PER_TOKEN, MASK, "mean")


def test_pack_masks_prompt_and_padding_tokens():
    batch = pack([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_id=0)
    # prompts left-padded, completions right-padded: completion token j sits in column P + j
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 10, 0], [0, 0, 8, 11, 12, 13]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.completion_ids.tolist() == [[9, 10, 0], [11, 12, 13]]
    assert batch.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]


def test_full_loss_on_a_model_ignores_prompt_and_padding(tiny_local):
    """End to end through the model: changing prompt-side padding or completion padding ids does not
    change the per-sequence loss."""
    from flowopt.lm.scoring import completion_logprobs

    model = tiny_local.model
    prompts, completions = [[2, 5, 6, 7], [2, 8]], [[9, 10], [11, 12, 13]]
    with torch.no_grad():
        a = completion_logprobs(model, pack(prompts, completions, pad_id=0))
        b = completion_logprobs(model, pack(prompts, completions, pad_id=17))  # different padding token
        alone = completion_logprobs(model, pack(prompts[:1], completions[:1], pad_id=0))
    mask = pack(prompts, completions, pad_id=0).completion_mask
    assert torch.allclose(a * mask, b * mask, atol=1e-5)
    assert torch.allclose(a[0, :2], alone[0, :2], atol=1e-5)  # batch-mates and their padding do not leak


# ----------------------------------------------------------------------------- issue 16's fixes 2 and 3


def test_grpo_aggregation_weighs_every_rollout_the_same_however_many_calls_it_made():
    """Rollout 0 made two LM calls (2 + 2 tokens), rollout 1 one call (3 tokens): each counts 1/2."""
    per_token = torch.tensor([[1.0, 3.0, 0.0], [5.0, 7.0, 0.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    weights = torch.tensor(sequence_weights([2, 2, 3], [0, 0, 1], "grpo"))
    expected = _mean([_mean([1, 3, 5, 7]), 2.0])
    assert float(aggregate(per_token, mask, weights=weights)) == pytest.approx(expected)
    # A per-call mean would give rollout 0 two thirds of the weight.
    assert float(aggregate(per_token, mask, "grpo")) == pytest.approx(_mean([2.0, 6.0, 2.0]))
    # Micro-batches with the whole batch's weights add up to the whole batch's loss.
    parts = sum(aggregate(per_token[i:i + 1], mask[i:i + 1], weights=weights[i:i + 1]) for i in range(3))
    assert float(parts) == pytest.approx(expected)
    dapo = torch.tensor(sequence_weights([2, 2, 3], [0, 0, 1], "dapo"))
    assert float(aggregate(per_token, mask, weights=dapo)) == pytest.approx(float(aggregate(per_token, mask, "dapo")))


def test_every_transition_carries_its_rollouts_index():
    from flowopt.optimizers.weights.grpo import scored_transitions
    from flowopt.optimizers.weights.rollout import Rollout, Transition

    call = Transition([2, 5], [6, 3], [-0.1, -0.2], "x", "stop")
    rollouts = [Rollout(0, 0, None, transitions=[call, call]), Rollout(0, 1, None, transitions=[call])]
    items = scored_transitions(rollouts, [0.5, -0.5])
    assert [(t.rollout, t.advantage) for t in items] == [(0, 0.5), (0, 0.5), (1, -0.5)]


def test_padding_is_masked_before_exp_so_the_kl_loss_stays_finite():
    """A padding column holding log-prob -100 against a reference 0: exp(100) is inf in float32."""
    values = [[-1.0, -100.0], [-0.5, -0.7]]
    ref = torch.tensor([[-1.2, 0.0], [-0.4, -0.9]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    advantages = torch.tensor([1.0, -1.0])
    before = torch.tensor(values, requires_grad=True)  # what happened before the fix: a NaN gradient
    unmasked = token_loss(before, before.detach(), advantages, beta=0.04, ref_logps=ref)
    aggregate(unmasked.loss, mask, "grpo").backward()
    assert not torch.isfinite(before.grad).all()
    logps = torch.tensor(values, requires_grad=True)
    out = token_loss(logps, logps.detach(), advantages, beta=0.04, ref_logps=ref, mask=mask)
    loss = aggregate(out.loss, mask, "grpo")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logps.grad).all()
    assert out.kl is not None and float(out.kl[0, 1]) == 0.0
    # Real tokens are untouched by the mask.
    assert torch.allclose(out.loss[mask.bool()], unmasked.loss[mask.bool()])
