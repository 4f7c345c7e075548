"""Training touches only the LoRA adapter; the reference model is the base model; sampling scores match."""

from __future__ import annotations

import dspy
import pytest
import torch

from flowopt.lm.packing import pack
from flowopt.lm.sampling import RowSettings, sample
from flowopt.lm.scoring import completion_logprobs
from flowopt.optimizers.weights.learner import GRPOLearner, ScoredTransition
from flowopt.optimizers.weights.policy import LoraSettings, Policy
from flowopt.optimizers.weights.sft import sft_train


def _base_weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}


def _items(policy: Policy) -> list[ScoredTransition]:
    prompt = policy.render([{"role": "user", "content": "Cue: red Word:"}])
    gen = torch.Generator().manual_seed(0)
    rows = [RowSettings(max_new_tokens=3, temperature=1.0, logprobs=True)] * 8
    out = policy.local.sample_ids([prompt] * 8, rows, adapter=policy.adapter, generator=gen)
    return [ScoredTransition(prompt, o.completion_ids, o.logprobs.tolist(), float(i % 2) - 0.5)
            for i, o in enumerate(out)]


def test_gradients_reach_only_lora_parameters(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("grpo-test")
    items = _items(policy)
    batch = pack([t.prompt_ids for t in items], [t.completion_ids for t in items], policy.pad_id)
    logps = completion_logprobs(policy.model, batch)
    (logps * batch.completion_mask).sum().backward()
    with_grad = {n for n, p in policy.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad, "no parameter got a gradient"
    assert all("lora_" in n and "grpo-test" in n for n in with_grad)
    frozen = [n for n, p in policy.model.named_parameters() if "lora_" not in n]
    assert frozen and all(not p.requires_grad for n, p in policy.model.named_parameters() if "lora_" not in n)


def test_grpo_update_changes_the_adapter_and_leaves_base_weights_unchanged(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("grpo-test")
    base = _base_weights(policy)
    adapter_before = policy.adapter_state()
    learner = GRPOLearner(policy, total_steps=3, learning_rate=1e-2, beta=0.04, passes=2, micro_batch_size=3)
    stats = learner.update(_items(policy))
    assert not stats.skipped and stats.transitions == 8
    after = _base_weights(policy)
    assert all(torch.equal(base[n], after[n]) for n in base)
    adapter_after = policy.adapter_state()
    assert any(not torch.equal(adapter_before[k], adapter_after[k]) for k in adapter_before)


def test_sft_leaves_base_weights_unchanged_and_lowers_the_loss(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("sft-test")
    base = _base_weights(policy)
    prompt = policy.render([{"role": "user", "content": "Cue: red Word:"}])
    pairs = [(prompt, policy.completion_ids("cat"))] * 4
    reported: list[float] = []
    losses = sft_train(policy, pairs, epochs=10, learning_rate=1e-2, batch_size=4, on_step=reported.append)
    assert losses[-1] < losses[0] / 2
    assert reported == losses and len(losses) == 10  # one progress update per optimizer step
    after = _base_weights(policy)
    assert all(torch.equal(base[n], after[n]) for n in base)


def test_reference_is_the_base_model(tiny_local):
    prompts = [[2, 30, 31, 32], [2, 33]]
    completions = [[34, 35], [36, 37, 38]]
    batch = pack(prompts, completions, pad_id=0)
    with torch.no_grad():
        base = completion_logprobs(tiny_local.model, batch)  # before any adapter exists
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("ref-test")
    GRPOLearner(policy, total_steps=1, learning_rate=5e-2).update(_items(policy))
    with torch.no_grad():
        trained = completion_logprobs(policy.model, batch)
        with policy.reference():
            reference = completion_logprobs(policy.model, batch)
        again = completion_logprobs(policy.model, batch)
    mask = batch.completion_mask.bool()
    assert torch.allclose(reference[mask], base[mask], atol=1e-5)  # adapter disabled = base model
    assert not torch.allclose(trained[mask], base[mask], atol=1e-4)  # the adapter matters...
    assert torch.allclose(trained, again)  # ...and is back on after the reference block


def test_sampled_logprobs_equal_training_forward_logprobs(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("logp-test")
    prompts = [policy.render([{"role": "user", "content": t}]) for t in ("Cue: red Word:", "Noise: sun Cue: blue")]
    for temperature in (1.0, 0.7):
        gen = torch.Generator().manual_seed(1)
        rows = [RowSettings(max_new_tokens=5, temperature=temperature, logprobs=True)] * 2
        out = policy.local.sample_ids(prompts, rows, adapter=policy.adapter, generator=gen)
        batch = pack(prompts, [o.completion_ids for o in out], policy.pad_id)
        with torch.no_grad():
            scored = completion_logprobs(policy.model, batch, temperature)
        for row, o in enumerate(out):
            assert scored[row, :len(o.logprobs)].tolist() == pytest.approx(o.logprobs.tolist(), abs=1e-4)


def test_greedy_sampling_matches_transformers_generate(tiny_local):
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    prompts = [[2, 30, 31, 32, 33], [2, 34]]
    out = sample(model, tokenizer, prompts, [RowSettings(max_new_tokens=6)] * 2)
    for prompt, o in zip(prompts, out):
        ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=0)[0, len(prompt):].tolist()
        assert o.completion_ids == ref[:len(o.completion_ids)] and len(ref) == len(o.completion_ids)
        assert o.finish_reason == ("stop" if ref[-1] == tokenizer.eos_token_id else "length")


def test_seeded_sampling_repeats(tiny_local):
    prompts = [[2, 30, 31], [2, 32]] * 3
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(123)
        rows = [RowSettings(max_new_tokens=4, temperature=1.0)] * len(prompts)
        runs.append([o.completion_ids for o in sample(tiny_local.model, tiny_local.tokenizer, prompts, rows,
                                                      generator=gen)])
    assert runs[0] == runs[1]


def test_rollouts_record_one_transition_per_lm_call(tiny_local, task):
    from flowopt.optimizers.weights.rollout import run_rollouts

    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("rollout-test")

    class TwoCalls(dspy.Module):
        def __init__(self):
            super().__init__()
            self.first = dspy.Predict("noise, cue -> word")
            self.second = dspy.Predict("noise, cue -> word")

        def forward(self, noise, cue):
            self.first(noise=noise, cue=cue)
            return self.second(noise=noise, cue=cue)

    from flowopt.lm import CompletionAdapter

    examples = task.examples(3, seed=0)
    gen = torch.Generator().manual_seed(0)
    rollouts = run_rollouts(TwoCalls(), examples, 2, policy, temperature=1.0, max_new_tokens=3, generator=gen,
                            adapter=CompletionAdapter(continue_missing=False))
    assert [(r.example_index, r.sample_index) for r in rollouts] == [(i, j) for i in range(3) for j in range(2)]
    for r in rollouts:
        assert len(r.transitions) == 2
        example = examples[r.example_index]
        for t in r.transitions:
            prompt = policy.decode(t.prompt_ids)
            assert f"Cue: {example.cue}" in prompt and prompt.endswith("Word:")
            assert len(t.completion_ids) == len(t.logprobs) >= 1
        if r.error is None:
            assert [node for node, _, _ in r.trace] == ["first", "second"]


def test_gradient_checkpointing_gives_the_same_gradient(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("ckpt-test")
    GRPOLearner(policy, total_steps=1, learning_rate=5e-2).update(_items(policy))  # non-zero LoRA B
    items = _items(policy)
    batch = pack([t.prompt_ids for t in items], [t.completion_ids for t in items], policy.pad_id)
    grads = []
    for checkpointing in (False, True):
        policy.model.zero_grad(set_to_none=True)
        with policy.training(gradient_checkpointing=checkpointing):
            (completion_logprobs(policy.model, batch) * batch.completion_mask).sum().backward()
        grads.append([p.grad.clone() for p in policy.trainable_parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
    assert not policy.model.training and not tiny_local.base_model.is_gradient_checkpointing


def test_sampling_stops_at_stop_strings(tiny_local):
    tokenizer = tiny_local.tokenizer
    prompts = [[2, 30, 31]] * 16
    free = sample(tiny_local.model, tokenizer, prompts, [RowSettings(max_new_tokens=12, temperature=1.0)] * 16,
                  generator=torch.Generator().manual_seed(0))
    # pick a word that some free sample produced, and stop there
    word = tokenizer.decode([next(f.completion_ids[1] for f in free if len(f.completion_ids) > 2)])
    out = sample(tiny_local.model, tokenizer, prompts,
                 [RowSettings(max_new_tokens=12, temperature=1.0, stop=(word,))] * 16,
                 generator=torch.Generator().manual_seed(0))
    stopped = 0
    for f, o in zip(free, out):
        # same random stream: the run ends at the first token after which the text holds the stop string
        ends = [k for k in range(1, len(f.completion_ids) + 1)
                if word in tokenizer.decode(f.completion_ids[:k], skip_special_tokens=True)]
        if ends:
            stopped += 1
            assert o.completion_ids == f.completion_ids[:ends[0]] and o.finish_reason == "stop"
            assert word not in o.text
        else:
            assert o.completion_ids == f.completion_ids and o.finish_reason == f.finish_reason
    assert stopped >= 1


def test_reference_can_be_the_starting_adapter(tiny_local):
    policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
    policy.start_adapter("first")
    GRPOLearner(policy, total_steps=1, learning_rate=5e-2).update(_items(policy))
    items = _items(policy)
    batch = pack([t.prompt_ids for t in items], [t.completion_ids for t in items], policy.pad_id)
    with torch.no_grad():
        first = completion_logprobs(policy.model, batch)
    policy.start_adapter("second", init_from="first")
    learner = GRPOLearner(policy, total_steps=2, learning_rate=5e-2, beta=0.1, reference_adapter="first")
    stats = learner.update(items)
    assert stats.kl == pytest.approx(0.0, abs=1e-6)  # before the step, policy == reference
    with torch.no_grad(), policy.reference("first"):
        reference = completion_logprobs(policy.model, batch)
    assert torch.allclose(reference, first, atol=1e-5)
    # Training adapters never become the default of unpinned calls; "second" is the trainable one.
    assert tiny_local.active_adapter is None and all("second" in n for n, p in policy.model.named_parameters()
                                                     if p.requires_grad)
    assert learner.update(items).kl > 0  # the second adapter moved away from the first


def test_rollouts_hide_dspys_truncation_warning_but_others_still_see_it(tiny_local, task):
    import contextlib
    import logging

    from flowopt.lm import CompletionAdapter
    from flowopt.optimizers.weights.rollout import policy_engine, policy_lm, run_rollouts

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler = Collect()
    lm_logger = logging.getLogger("dspy.clients.lm")
    lm_logger.addHandler(handler)
    level = lm_logger.level
    lm_logger.setLevel(logging.WARNING)  # whatever an earlier test in this process set it to
    try:
        policy = Policy(tiny_local, lora=LoraSettings(r=4, alpha=8))
        policy.start_adapter("quiet-test")
        examples = task.examples(2, seed=0)
        rollouts = run_rollouts(dspy.Predict("noise, cue -> word"), examples, 2, policy, temperature=1.0,
                                max_new_tokens=1, generator=torch.Generator().manual_seed(0),
                                adapter=CompletionAdapter(continue_missing=False))
        truncated = [t for r in rollouts for t in r.transitions if t.finish_reason == "length"]
        assert truncated  # one token is never a whole answer plus EOS
        assert not [m for m in handler.messages if "truncated" in m]
        # Outside a rollout the same truncation is still reported.
        outside = dspy.Predict("noise, cue -> word")
        outside.lm = policy_lm(policy_engine(policy, temperature=0.0, max_new_tokens=1))
        # A one-token answer may not parse; the warning comes first either way.
        with dspy.context(adapter=CompletionAdapter(continue_missing=False)), contextlib.suppress(Exception):
            outside(**examples[0].inputs())
        assert [m for m in handler.messages if "truncated" in m]
    finally:
        lm_logger.removeHandler(handler)
        lm_logger.setLevel(level)
